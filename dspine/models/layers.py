"""Building blocks shared by the reference targets and the draft: norms, RoPE, masked attention, SwiGLU.

Everything here works on explicit per-row positions (``pos: LongTensor[B, T]``) so that a batch can hold
requests of different lengths without left padding: row ``b`` writes its new keys at ``lengths[b] + t``
and a query at absolute position ``p`` sees exactly the keys at positions ``<= p`` (and, with a sliding
window ``w``, ``> p - w``). Stale keys left behind by rejected draft tokens sit at positions beyond the
committed length; they are masked by position and overwritten by the next write, so "crop to a length"
is just ``lengths = n``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. ``offset=1.0`` gives the zero-centred ``x * (1 + w)`` variant (Qwen3.5)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (self.offset + self.weight.float())).to(dtype)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters read from a HF config (``rope_parameters`` or legacy keys).

    The scaling variants the supported families' configs use, with Hugging Face's arithmetic (facts from
    ``transformers.modeling_rope_utils``, our code): ``linear`` (positions / factor), ``llama3`` (per-wavelength
    blend), ``yarn`` (NTK-by-parts ramp between interpolated and extrapolated frequencies, cos/sin scaled by an
    attention factor) and ``longrope`` (per-frequency short or long factors, which ones: ``Rotary.needs_long``;
    cos/sin scaled by an attention factor) and ``proportional`` (Gemma 4's full layers: the whole head rotates
    half-by-half, only the first ``proportion`` of its frequencies non-zero).
    """

    theta: float = 10000.0
    rotary_dim: int = 64  # number of leading head dims that rotate (partial rotary when < head_dim)
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range outward
    attention_factor: float = 1.0  # yarn / longrope: cos and sin are multiplied by it
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    proportion: float = 1.0  # proportional (Gemma 4's full layers): the share of frequencies that rotate

    TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")

    @staticmethod
    def from_config(cfg: dict, head_dim: int, params: dict | None = None) -> RopeSpec:
        """``params``: one layer type's own rope parameters (Gemma 3's sliding/full layers); else the config's."""
        if params is None:
            params = dict(cfg.get("rope_parameters") or {})
            scaling = cfg.get("rope_scaling") or {}
            params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in RopeSpec.TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(RopeSpec.TYPES)})")
        rotary_dim = int(head_dim * partial) if rope_type != "proportional" else head_dim
        original = int(params.get("original_max_position_embeddings")
                       or cfg.get("original_max_position_embeddings") or 8192)
        factor = params.get("factor")
        attention = params.get("attention_factor")
        if rope_type in ("yarn", "longrope"):
            max_pos = int(cfg.get("max_position_embeddings") or original)
            if factor is None:
                factor = max_pos / original
            if attention is None:
                attention = _yarn_attention(float(factor), params) if rope_type == "yarn" else (
                    1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        if rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(params.get(key) or ()) != rotary_dim // 2:
                    raise ValueError(f"longrope {key} needs {rotary_dim // 2} entries, got {params.get(key)!r}")
        return RopeSpec(
            theta=float(theta),
            rotary_dim=rotary_dim,
            rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(1.0 if attention is None else attention),
            short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
            long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
            proportion=float(partial) if rope_type == "proportional" else 1.0,
        )

    def inv_freq(self, device=None, long: bool = False) -> torch.Tensor:
        """The inverse frequencies [rotary_dim / 2]; ``long``: longrope's long factors (other types: ignored)."""
        d = self.rotary_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        inv = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            low_wl = self.original_max_position / self.low_freq_factor
            high_wl = self.original_max_position / self.high_freq_factor
            wl = 2 * math.pi / inv
            scaled = torch.where(wl > low_wl, inv / self.factor, inv)
            smooth = (self.original_max_position / wl - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            mid = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_mid = (wl >= high_wl) & (wl <= low_wl)
            inv = torch.where(is_mid, mid, scaled)
        elif self.rope_type == "yarn":
            inv = self._yarn(device)
        elif self.rope_type == "longrope":
            ext = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32, device=device)
            inv = 1.0 / (ext * self.theta**exponents)
        elif self.rope_type == "proportional":
            # Hugging Face's: the first proportion * d / 2 frequencies of a d-dim rotation (exponents over the
            # whole head), the rest zero (cos 1, sin 0: those pairs pass through), all divided by ``factor``
            angles = int(self.proportion * d // 2)
            inv = torch.cat([inv[:angles], torch.zeros(d // 2 - angles, device=device)]) / self.factor
        return inv

    def _yarn(self, device) -> torch.Tensor:
        d, base = self.rotary_dim, self.theta

        def correction_dim(rotations: float) -> float:
            return (d * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
        pos_freqs = base ** (torch.arange(0, d, 2).to(device=device, dtype=torch.float) / d)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        keep = 1 - ramp  # 1: the extrapolated (original) frequency, 0: the interpolated one
        return interpolation * (1 - keep) + extrapolation * keep


def _yarn_attention(factor: float, params: dict) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class Rotary(nn.Module):
    """cos/sin tables for absolute positions; applies the rotate-half convention used by HF Llama/Qwen.

    ``ends``, ``prefill`` (longrope only): see ``needs_long``."""

    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.spec = spec
        if torch.empty(0).is_meta:  # built for its shapes (``Target.check_checkpoint``); ``reset`` fills the tables:
            # arithmetic on meta tensors routes through torch's reference ops, whose first call imports torch._dynamo
            inv = long = torch.empty(spec.rotary_dim // 2)
        else:
            inv, long = spec.inv_freq(), spec.inv_freq(long=True) if spec.rope_type == "longrope" else None
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("long_inv_freq", long if spec.rope_type == "longrope" else None, persistent=False)

    def reset(self, device=None) -> None:
        """Recompute the tables (after ``to_empty`` left them uninitialised)."""
        self.inv_freq = self.spec.inv_freq(device=device)
        if self.spec.rope_type == "longrope":
            self.long_inv_freq = self.spec.inv_freq(device=device, long=True)

    def needs_long(self, pos: torch.Tensor, ends: torch.Tensor | None = None,
                   prefill: torch.Tensor | None = None) -> torch.Tensor | None:
        """longrope: [B, T], the query positions rotated with the long factors; None for other RoPE types.

        Hugging Face's forward rotates every position of a forward with the long factors when the forward reaches
        past ``original_max_position`` (its length, max position + 1, is larger), else every one with the short
        ones. Plain decoding (a prompt's prefill, then one position a step) therefore rotates a prompt longer than
        the switch wholly with the long factors, and each generated position with the long ones exactly when it is
        past the switch. That is the rule here, per position, so that a forward of several positions after the
        prefill (a speculative verify) rotates each as the plain step at that position would: long where the
        position is past the switch, or where its row's forward is a prefill (``prefill`` [B]: the forward starts at
        position 0; None: every row's does, Hugging Face's whole-forward rule) reaching past it (``ends`` [B]: each
        row's last real position + 1, padding excluded; default the last of ``pos``).

        Where this differs from Hugging Face: its ``generate`` re-runs a Phi-3 prompt whole with the long factors
        at the step its sequence first passes the switch (``Phi3ForCausalLM.prepare_inputs_for_generation``);
        ours keeps the keys of the positions below it (short, as computed), so a row that crosses the switch while
        generating continues as HF's forward fed one position at a time, not as HF's ``generate``. Rows that stay
        on one side agree with both. A chunk or a prefix-cache hit cannot know that its prompt goes on past the
        switch, which is why longrope is a named gap of those features (``families._gaps``)."""
        if self.spec.rope_type != "longrope":
            return None
        ends = pos.max(dim=1).values + 1 if ends is None else ends
        whole = ends > self.spec.original_max_position  # [B]
        if prefill is not None:
            whole = whole & prefill
        return whole[:, None] | (pos >= self.spec.original_max_position)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype, ends: torch.Tensor | None = None,
                prefill: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # pos [B, T] -> cos, sin [B, 1, T, rotary_dim]
        inv = self.inv_freq.float()
        long = self.needs_long(pos, ends, prefill)
        if long is not None:
            inv = torch.where(long[..., None], self.long_inv_freq.float(), inv)  # [B, T, d/2]
        freqs = pos.float()[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.spec.attention_factor != 1.0:
            cos, sin = cos * self.spec.attention_factor, sin * self.spec.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; rotates the first ``cos.shape[-1]`` dims and passes the rest through."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    xr, xp = x[..., :d], x[..., d:]
    return torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1)


@dataclass
class Positions:
    """Position facts of one forward that every attention layer shares, computed once rather than per layer.

    ``upto`` (keys to read) is a host value: taking it once per forward instead of once per layer removes a
    host synchronisation per layer; masks are built once per distinct sliding window.
    """

    pos: torch.Tensor  # [B, T] absolute positions of the new tokens
    rows: torch.Tensor  # [B, 1] row index, for per-row cache writes
    upto: int  # max(pos) + 1
    _masks: dict = field(default_factory=dict)
    _queries: torch.Tensor | None = None  # ``queries`` of this forward's packing, computed once

    @staticmethod
    def of(pos: torch.Tensor) -> Positions:
        return Positions(pos, torch.arange(pos.shape[0], device=pos.device)[:, None], int(pos.max()) + 1)

    def mask(self, window: int | None = None) -> torch.Tensor:
        if window not in self._masks:
            self._masks[window] = position_mask(self.pos, self.upto, window)
        return self._masks[window]

    def queries(self, packed: Packing | None) -> torch.Tensor:
        """The positions the attention kernels read for each query: ``pos``, with -1 at a packed forward's padded
        slots, which the kernels then skip (their output is 0 and ``Packing.gather`` drops it). A ragged verify at
        8 rows under a JSON schema is ~40 % padding: that much of its attention was computed to be thrown away."""
        if packed is None:
            return self.pos
        if self._queries is None:
            q = torch.full((self.pos.numel(),), -1, dtype=self.pos.dtype, device=self.pos.device)
            q.index_copy_(0, packed.index, self.pos.reshape(-1).index_select(0, packed.index))
            self._queries = q.view(self.pos.shape)
        return self._queries


@dataclass
class Packing:
    """The valid tokens of a right-padded ``[B, T]`` forward, packed: row b's first ``n_valid[b]`` tokens, in
    order. A dense layer's per-token work (norms, linears, the MLP) runs on the ``[N, ...]`` packed rows only;
    attention and the cache writes see the padded ``[B, T]`` layout again (``spread``: zeros at padded slots,
    which are never committed and are overwritten before anything reads them)."""

    index: torch.Tensor  # [N] flat indices b * T + t of the valid tokens
    shape: tuple[int, int]  # (B, T)

    @staticmethod
    def of(n_valid: torch.Tensor, B: int, T: int) -> Packing | None:
        """None when nothing is padded (the plain path is then the same work)."""
        n = n_valid.to(torch.long).clamp(0, T)
        if int(n.sum()) == B * T:
            return None
        valid = torch.arange(T, device=n.device)[None, :] < n[:, None]
        return Packing(torch.nonzero(valid.flatten()).flatten(), (B, T))

    # index_select / index_copy_ rather than ``x[index]`` / ``out[index] = x``: the same bytes moved, but torch's
    # advanced indexing costs 2-5x more at these shapes (136 x 576 fp32 on a 2-core EPYC: 118 vs 23 us to spread,
    # 3 spreads and 2 gathers a layer), ~9 % of a packed verify forward at 8 rows under a JSON schema
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]."""
        return x.reshape(self.shape[0] * self.shape[1], *x.shape[2:]).index_select(0, self.index)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B * T, ...] with zeros at the padded slots."""
        return x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:]).index_copy_(0, self.index, x)


def position_mask(q_pos: torch.Tensor, k_len: int, window: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, T, k_len]: key slot j is visible to a query at position p iff j <= p (and j > p-w)."""
    j = torch.arange(k_len, device=q_pos.device)
    m = j[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        m = m & (j[None, None, :] > q_pos[:, :, None] - window)
    return m[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention. q [B, Hq, T, D], k/v [B, Hkv, S, D], mask bool [B, 1, T, S] -> [B, Hq, T, D].

    The query heads that share a KV head are folded into the query-length axis ([B, Hkv, rep*T, D]) instead
    of repeating K/V rep times: decode is dominated by reading the cache, so copying it would double that.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    if rep > 1:
        q = q.reshape(B, Hkv, rep * T, D)
        mask = mask[:, :, None].expand(B, 1, rep, T, mask.shape[-1]).reshape(B, 1, rep * T, mask.shape[-1])
    # Explicit math rather than F.scaled_dot_product_attention: with a boolean mask, torch's CPU flash kernel
    # costs milliseconds per call at decode shapes (measured ~7 ms for T=3, S=101), more than the matmuls.
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hkv, rep*T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    o = scores.float().softmax(-1).to(v.dtype) @ v
    return o.reshape(B, Hq, T, D)


@contextlib.contextmanager
def skip_init():
    """``torch.nn.init``'s fills as no-ops, for modules whose values the checkpoint replaces (``Target.empty``;
    shape-only linears on the meta device):
    initialising 135M parameters only to overwrite them costs seconds."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of ``linears``' outputs (same input).

    For inference: one GEMM reads the input once and pays one call's overhead instead of several, which is
    most of a small model's CPU decode step. The weights are copied, so the originals can be dropped.
    """
    has_bias = linears[0].bias is not None
    if any(lin.weight.is_meta for lin in linears):  # shape only (the packed cache fills it): no arithmetic on meta
        # tensors, whose first op imports torch._dynamo
        weight = torch.empty((sum(lin.out_features for lin in linears), linears[0].in_features), device="meta")
        bias = torch.empty(weight.shape[0], device="meta") if has_bias else None
    else:
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    with skip_init():
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``fuse()`` (inference only) merges gate and up into one projection.

    ``act``: "silu" (Llama and most families; our fused SiLU-gate op on the kernels) or "gelu_pytorch_tanh"
    (Gemma: torch's tanh-approximated GELU, an elementwise op). ``bias``: Granite's and Llama's ``mlp_bias``."""

    ACTS = ("silu", "gelu_pytorch_tanh")

    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        if act not in self.ACTS:
            raise ValueError(f"activation {act!r} is not supported (supported: {', '.join(self.ACTS)})")
        self.act = act
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_up: nn.Linear | None = None
        self.fast = False  # fused gate/up and our SiLU-gate op (``Target.use_kernels``; inference only)

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x) if self.act == "silu" else F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
        if self.fast:  # our fused activation-gate ops: batch invariant (``kernels.gelu_tanh_mul`` says why)
            from dspine.cpu.kernels import gelu_tanh_mul, silu_mul

            return self.down_proj((silu_mul if self.act == "silu" else gelu_tanh_mul)(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self._act(gate).mul_(up))


def fuse_norms(module: nn.Module) -> int:
    """Replace every ``RMSNorm`` under ``module`` by a ``FusedRMSNorm``, in place; how many."""
    from dspine.cpu.kernels import FusedRMSNorm

    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm) and child.weight.dtype == torch.float32:
                setattr(parent, name, FusedRMSNorm(child))
                count += 1
    return count
