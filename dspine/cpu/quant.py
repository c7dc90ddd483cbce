"""Weight-only quantized linears for the CPU reference targets: int8 per output channel, int4 in groups.

Why: a small model's CPU decode step streams every weight once per token; fp32 moves 4 bytes per weight where
llama.cpp's 4-bit GGUF moves ~0.6. Activations stay in bfloat16 (torch's CPU int8/int4 weight-only kernels
take bf16 inputs; with fp32 inputs the int8 kernel is slower than a plain fp32 GEMM) and results are cast back
to the model's dtype. Quantization changes the target's distribution, so it is a setting of the run (recorded
in the manifest): speculative decoding stays lossless *relative to the quantized target*, because the draft
is only ever checked against the same quantized logits that plain decoding samples from.

- ``int8``: symmetric per output channel, ``w ≈ q * s`` (q in [-127, 127]).
- ``int4``: asymmetric per group of ``GROUP`` input columns, ``w ≈ q * d + m`` (q in [0, 15]) — the same form
  as GGUF Q4_1, so the embedded target (a Q4_1 GGUF dequantized to fp32) round-trips to nearly its original
  4-bit weights: each Q4_1 block's min and max are exact grid points, so min/max recovers its ``d`` and ``m``.
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("none", "int8", "int4")
GROUP = 32
COMPUTE_DTYPE = torch.bfloat16


class Int8Linear(nn.Module):
    """y = x @ (q * s).T (+ bias), q int8 [N, K], s [N] (bf16)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Linear(q, scales.to(COMPUTE_DTYPE), None if bias is None else bias.detach().to(COMPUTE_DTYPE))

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()
        y = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W in 4-bit groups of ``GROUP`` columns, packed for torch's CPU int4 kernel."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # [K/GROUP, N, 2]: scale, value at q = 8
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W [N, K] -> (q int32 [N, K] in 0..15, d [N, K/G], m [N, K/G]) with W ≈ q * d + m per group."""
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // GROUP, GROUP)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        d = ((hi - lo) / 15.0).clamp_min(1e-12)
        q = torch.round((w - lo[..., None]) / d[..., None]).clamp_(0, 15).to(torch.int32)
        return q.reshape(n, k), d, lo

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0  # the CPU packer needs N % 16 == 0

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        n, k = weight.shape
        q, d, m = Int4Linear.quantize(weight)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = m + 8.0 * d  # the kernel computes (q - 8) * scale + zero
        scales_zeros = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)
        b = None if bias is None else bias.detach().to(COMPUTE_DTYPE)
        return Int4Linear(packed, scales_zeros, b, k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def quantized_linear(linear: nn.Linear | torch.Tensor, mode: str) -> nn.Module:
    """An ``Int8Linear``/``Int4Linear`` for a Linear (or a bare [N, K] weight, e.g. a tied head)."""
    weight, bias = (linear, None) if isinstance(linear, torch.Tensor) else (linear.weight, linear.bias)
    if mode == "int4" and Int4Linear.supports(weight):
        return Int4Linear.from_weight(weight, bias)
    if mode in ("int4", "int8"):  # int4 falls back to int8 for shapes its kernel cannot pack
        return Int8Linear.from_weight(weight, bias)
    raise ValueError(f"unknown quantization {mode!r} (choose from {', '.join(MODES)})")


def quantize_linears(module: nn.Module, mode: str) -> int:
    """Replace every ``nn.Linear`` under ``module`` by its quantized form, in place; returns how many."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r} (choose from {', '.join(MODES)})")
    if mode == "none":
        return 0
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, quantized_linear(child, mode))
                count += 1
    return count
