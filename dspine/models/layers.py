"""Building blocks shared by the reference targets and the draft: norms, RoPE, masked attention, SwiGLU.

Everything here works on explicit per-row positions (``pos: LongTensor[B, T]``) so that a batch can hold
requests of different lengths without left padding: row ``b`` writes its new keys at ``lengths[b] + t``
and a query at absolute position ``p`` sees exactly the keys at positions ``<= p`` (and, with a sliding
window ``w``, ``> p - w``). Stale keys left behind by rejected draft tokens sit at positions beyond the
committed length; they are masked by position and overwritten by the next write, so "crop to a length"
is just ``lengths = n``.
"""

from __future__ import annotations

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
    """Rotary embedding parameters read from a HF config (``rope_parameters`` or legacy keys)."""

    theta: float = 10000.0
    rotary_dim: int = 64  # number of leading head dims that rotate (partial rotary when < head_dim)
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @staticmethod
    def from_config(cfg: dict, head_dim: int) -> RopeSpec:
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
        return RopeSpec(
            theta=float(theta),
            rotary_dim=int(head_dim * partial),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )

    def inv_freq(self, device=None) -> torch.Tensor:
        d = self.rotary_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
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
        return inv


class Rotary(nn.Module):
    """cos/sin tables for absolute positions; applies the rotate-half convention used by HF Llama/Qwen."""

    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # pos [B, T] -> cos, sin [B, 1, T, rotary_dim]
        freqs = pos.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


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

    @staticmethod
    def of(pos: torch.Tensor) -> Positions:
        return Positions(pos, torch.arange(pos.shape[0], device=pos.device)[:, None], int(pos.max()) + 1)

    def mask(self, window: int | None = None) -> torch.Tensor:
        if window not in self._masks:
            self._masks[window] = position_mask(self.pos, self.upto, window)
        return self._masks[window]


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

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]."""
        return x.reshape(self.shape[0] * self.shape[1], *x.shape[2:])[self.index]

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B * T, ...] with zeros at the padded slots."""
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:])
        out[self.index] = x
        return out


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


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of ``linears``' outputs (same input).

    For inference: one GEMM reads the input once and pays one call's overhead instead of several, which is
    most of a small model's CPU decode step. The weights are copied, so the originals can be dropped.
    """
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return fused


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``fuse()`` (inference only) merges gate and up into one projection."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up: nn.Linear | None = None
        self.fast = False  # fused gate/up and our SiLU-gate op (``Target.use_kernels``; inference only)

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.fast:
            from dspine.cpu.kernels import silu_mul

            return self.down_proj(silu_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


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
