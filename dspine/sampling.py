"""Per-request sampling parameters and the target distribution they define.

Losslessness is defined against the *processed* target distribution ``p`` (temperature, then top-k, then
top-p), so AR sampling, rejection sampling and residual sampling must all use the very same ``p`` — which is
why there is exactly one function here that makes it.

Randomness is per request: each request owns a ``torch.Generator`` seeded from its own seed and draws a
fixed number of uniforms per step, so its output never depends on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def per_request(n: int, **values) -> list[SamplingParams]:
    """Expand scalar-or-list keyword values into one ``SamplingParams`` per request."""
    out: list[dict] = [{} for _ in range(n)]
    for key, val in values.items():
        if key == "stop_token_ids":
            if val and isinstance(val[0], list | tuple):
                vals = [tuple(v) for v in val]
            else:
                vals = [tuple(val or ())] * n
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

    Greedy rows get a one-hot at the argmax (their "distribution" is deterministic).
    """
    logits = logits.float()
    B, T, V = logits.shape
    out = torch.empty_like(logits)
    for b, sp in enumerate(params):
        lg = logits[b]
        if sp.greedy:
            out[b] = torch.nn.functional.one_hot(lg.argmax(-1), V).float()
            continue
        lg = lg / sp.temperature
        if sp.top_k and sp.top_k < V:
            kth = lg.topk(sp.top_k, dim=-1).values[..., -1:]
            lg = lg.masked_fill(lg < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_lg, order = lg.sort(dim=-1, descending=True)
            cum = sorted_lg.softmax(-1).cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop_sorted = (cum - sorted_lg.softmax(-1)) >= sp.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            lg = lg.masked_fill(drop, float("-inf"))
        out[b] = lg.softmax(-1)
    return out


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs [..., V], u [...] uniforms in [0, 1) -> token ids [...]."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, (u[..., None] * total).contiguous(), right=True).squeeze(-1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # never return a zero-probability token because of rounding at the top end
    bad = probs.gather(-1, idx[..., None]).squeeze(-1) <= 0
    if bad.any():
        idx = torch.where(bad, probs.argmax(-1), idx)
    return idx
