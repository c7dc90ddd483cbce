"""Per-request sampling parameters and the target distribution they define.

Losslessness is defined against the *processed* target distribution ``p`` (temperature, then top-k, then
top-p), so AR sampling, rejection sampling and residual sampling must all use the very same ``p`` — which is
why there is exactly one function here that makes it.

Randomness is per request and keyed by position: the uniforms that decide generated token t of a request are
a hash of (its seed, t, what they are for), so its output never depends on which other requests share the
batch, when it joined, or how the decoding loop grouped its work into rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings. Beyond temperature / top-k / top-p, the history-dependent processors
    (penalties, ``logit_bias``, ``min_tokens``, a ``grammar``: ``processors.py``) and ``logprobs`` (None: off; k:
    the chosen token's logprob and the k most likely)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: Any = None  # grammar.Constraint

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not all(math.isfinite(b) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be finite")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be 0..20 (top logprobs), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether the row's history changes its logits (``processors.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.grammar is not None)


def per_request(n: int, **values) -> list[SamplingParams]:
    """Expand scalar-or-list keyword values into one ``SamplingParams`` per request."""
    out: list[dict] = [{} for _ in range(n)]
    for key, val in values.items():
        if key == "stop_token_ids":
            if val and isinstance(val[0], list | tuple):
                vals = [tuple(v) for v in val]
            else:
                vals = [tuple(val or ())] * n
        elif key == "logit_bias":  # {id: bias} for every prompt, or one dict (or None) per prompt
            per = val if isinstance(val, list | tuple) else [val] * n
            vals = [tuple(sorted((int(k), float(v)) for k, v in (d or {}).items())) for d in per]
        elif isinstance(val, list | tuple):
            vals = list(val)
        else:
            vals = [val] * n
        if len(vals) != n:
            raise ValueError(f"{key}: got {len(vals)} values for {n} prompts")
        for d, v in zip(out, vals):
            d[key] = v
    return [SamplingParams(**d) for d in out]


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & ((1 << 63) - 1))
    return g


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, T, V] -> probabilities [B, T, V] (fp32) of the processed target distribution, per row.

    Greedy rows get a one-hot at the argmax (their "distribution" is deterministic). One batched pass for all
    rows (per-row temperature, top-k and top-p as tensors): no Python loop over rows or positions.
    """
    logits = logits.float()
    B, T, V = logits.shape
    dev = logits.device
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
    if all(sp.greedy for sp in params):
        return onehot
    greedy = torch.tensor([sp.greedy for sp in params], dtype=torch.bool, device=dev)
    temp = torch.tensor([sp.temperature if not sp.greedy else 1.0 for sp in params], dtype=torch.float32, device=dev)
    lg = logits / temp[:, None, None]
    ks = [sp.top_k if 0 < sp.top_k < V and not sp.greedy else 0 for sp in params]
    if any(ks):
        kmax = max(ks)
        kth_idx = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long, device=dev)
        vals = lg.topk(kmax, dim=-1).values  # [B, T, kmax]
        kth = vals.gather(-1, kth_idx[:, None, None].expand(B, T, 1))
        active = torch.tensor([k > 0 for k in ks], dtype=torch.bool, device=dev)[:, None, None]
        lg = lg.masked_fill(active & (lg < kth), float("-inf"))
    tps = [sp.top_p if sp.top_p < 1.0 and not sp.greedy else 1.0 for sp in params]
    if any(t < 1.0 for t in tps):
        sorted_lg, order = lg.sort(dim=-1, descending=True)
        sm = sorted_lg.softmax(-1)
        top_p = torch.tensor(tps, dtype=torch.float32, device=dev)[:, None, None]
        # keep the smallest prefix whose mass reaches top_p (the first token always stays); rows without
        # top-p are left alone (rounding could otherwise drop their far tail)
        drop_sorted = ((sm.cumsum(-1) - sm) >= top_p) & (top_p < 1.0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        lg = lg.masked_fill(drop, float("-inf"))
    return torch.where(greedy[:, None, None], onehot, lg.softmax(-1))


# -- position-keyed randomness ------------------------------------------------------------------------------
#
# A row's random numbers are a pure function of (its seed, the generated position they decide, a stream tag,
# a slot index): a counter-based hash, computed for the whole batch in a few integer tensor ops. Which other
# rows share the batch, when the row joined and how many rounds came before can therefore not change them.

_M32 = 0xFFFFFFFF
STREAM_FINAL = 1  # the token a round ends with: correction, bonus, or the plain step's sample
STREAM_ACCEPT = 2  # accept/reject tests of drafted slots
STREAM_DRAFT = 3  # seeds the draft's generator for the proposals of a round


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, "lowbias32" constants) on int64 tensors holding u32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def keyed_hash(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """u32 hashes [B, n] of (seed [B], position [B], stream, slot 0..n-1); int64 tensors."""
    seeds = seeds.long() & ((1 << 63) - 1)
    h = _mix32((seeds & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    h = _mix32(h ^ (positions.long() & _M32) ^ 0x85EBCA6B)
    h = _mix32(h ^ (stream * 0xC2B2AE35 & _M32))
    slots = torch.arange(n, dtype=torch.long, device=h.device)
    return _mix32(h[:, None] ^ _mix32(slots * 0x27D4EB2F + 0x165667B1 & _M32)[None, :])


def keyed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniforms in [0, 1) [B, n] (24-bit, float32) keyed by (seed, position, stream, slot)."""
    return (keyed_hash(seeds, positions, stream, n) >> 8).float() * (1.0 / (1 << 24))


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs [..., V], u [...] uniforms in [0, 1) -> token ids [...]."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, (u[..., None] * total).contiguous(), right=True).squeeze(-1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # never return a zero-probability token because of rounding at the top end
    bad = probs.gather(-1, idx[..., None]).squeeze(-1) <= 0
    return torch.where(bad, probs.argmax(-1), idx)  # unconditional: no host read of ``bad``
