"""The reference targets' precision settings: a dtype name and a weight-only quantization mode.

Why a module: the setting changes outputs, so the engine must parse it, validate it with a clear message and
record it in the run's manifest; ``auto`` picks bfloat16 only where the CPU computes it natively (AVX512-BF16
or AMX), since elsewhere bf16 is emulated and slower than fp32. The reference engine resolves ``auto`` per
model first (``dspine.models.registry.auto_dtype``: bf16 only where our bf16 kernels run that target).

``quant=q8`` / ``q16`` are the integer policies of our kernels (``dspine.cpu.kernels.INT_FORMATS``): the GGUF blocks
times input rows quantised per block of 32 to int8 (q16: two int8 parts, ~16 bits), integer dot products; the rest as
under bfloat16 (bf16 KV cache), so they imply ``dtype=bfloat16`` like the weight-only modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspine.cpu.quant import MODES

DTYPES = ("float32", "bfloat16", "auto")
QUANTS = (*MODES, "q8", "q16")  # MODES: torch's weight-only int8/int4 (quant.py); q8, q16: our integer dot products
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    """True where the CPU has bf16 arithmetic instructions (x86 AVX512-BF16/AMX; read from /proc/cpuinfo)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_FLAGS)


@dataclass(frozen=True)
class Precision:
    dtype: str = "float32"  # resolved: float32 or bfloat16
    quant: str = "none"  # none, int8, int4, q8, q16

    @property
    def torch_dtype(self):
        import torch

        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    def describe(self) -> dict[str, str]:
        return {"dtype": self.dtype, "quant": self.quant}


def resolve(dtype: str = "float32", quant: str = "none", flags: set[str] | None = None) -> Precision:
    """Validate the names and resolve ``auto``; weight-only quantization computes in bf16, so it implies bf16.

    Raises ValueError with a one-line message naming the bad value and the choices.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: choose from {', '.join(QUANTS)}")
    if dtype == "auto":
        dtype = "bfloat16" if quant != "none" or native_bf16(flags) else "float32"
    if quant != "none" and dtype != "bfloat16":
        raise ValueError(f"quant {quant}: quantized linears compute in bfloat16; use dtype=bfloat16 or auto")
    return Precision(dtype, quant)
