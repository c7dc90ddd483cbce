"""Our CPU kernels (``dspine/csrc/``), built on first use for this machine's instruction set and cached.

Why our own (docs/design.md, "The CPU step"): on the 2-core machines this project runs on, torch's fp32
linear (MKL) moves 5-10 GB/s on decode shapes (1-32 rows against ~200 small weight matrices per step) while
the weights could stream at 20-40 GB/s, and a 4-row verify costs ~2x a 1-row step where it could cost about
the same. ``csrc/linear.cpp`` repacks each weight once and streams it once per forward for any small number
of rows; it is also batch invariant (a row's outputs do not depend on the other rows), which torch's kernels
are not. ``csrc/ops.cpp`` fuses the chains of tiny ops around them (RMSNorm, RoPE + KV store, attention over
the cache, SiLU gate), which are most of what remains of a decode step once the linears are fast.

The build is a JIT C++ extension (``torch.utils.cpp_extension``: a C++ compiler and ninja), once per machine
kind, under ``$DSPINE_CACHE_DIR/kernels`` (default ``~/.cache/dspine/kernels``), keyed by torch version, the
instruction set and the source, and locked against concurrent builds (Slurm array tasks on a shared home).
The instruction set is chosen from ``/proc/cpuinfo`` and passed as explicit flags, never ``-march=native``,
so a build made on one node runs on every node with the same ISA. Where the build cannot run (no compiler),
or with ``DSPINE_KERNELS=0``, everything falls back to torch with a one-line warning; which one ran is part
of the engine's identity (``kernel_name``), since it changes fp32 rounding.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

from .disk_cache import cache_root
from .precision import cpu_flags

ENV = "DSPINE_KERNELS"  # "0"/"off"/"torch": never build or use them; "avx2"/"generic": that build (tests)
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("linear.cpp", "ops.cpp")]
ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
    "generic": [],
}

_state: dict[str, object] = {}


def cpu_isa(flags: set[str] | None = None) -> str:
    """The kernel build for this CPU: ``avx512``, ``avx2`` or ``generic``."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


def wanted_isa(env: dict[str, str] | None = None, flags: set[str] | None = None) -> str:
    """``cpu_isa()``, or a lower build named by ``DSPINE_KERNELS`` (to test the AVX2/portable code on any CPU)."""
    env = os.environ if env is None else env
    best = cpu_isa(flags)
    order = list(ISA_CFLAGS)  # best first
    asked = env.get(ENV, "").strip().lower()
    if asked in ISA_CFLAGS and order.index(asked) >= order.index(best):
        return asked
    return best


def disabled(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV, "").strip().lower() in ("0", "off", "torch", "false", "no")


def build_name(isa: str) -> str:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:10]
    torch_tag = torch.__version__.split("+")[0].replace(".", "_")
    return f"dspine_cpu_{isa}_t{torch_tag}_py{sys.version_info[0]}{sys.version_info[1]}_{digest}"


def load() -> str | None:
    """Build (first time) and load the kernels; the ISA name when they are usable here, else None.

    Never raises: a failed build is reported once on stderr and torch is used from then on.
    """
    if "isa" in _state:
        return _state["isa"]  # type: ignore[return-value]
    isa: str | None = None
    if disabled():
        _state["why"] = f"{ENV}={os.environ.get(ENV)}"
    else:
        isa = _build(wanted_isa())
    _state["isa"] = isa
    return isa


def _build(isa: str) -> str | None:
    try:
        from torch.utils import cpp_extension

        name = build_name(isa)
        where = cache_root() / "kernels" / name
        so = where / f"{name}.so"
        if not so.exists():
            print(f"dspine: building the CPU kernels for {isa} (once per machine kind, ~20 s) in {where}",
                  file=sys.stderr, flush=True)
        where.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], build_directory=str(where),
                           is_python_module=False,
                           extra_cflags=["-O3", "-fopenmp", *ISA_CFLAGS[isa]], verbose=False)
        return str(torch.ops.dspine_cpu.isa())
    except Exception as e:  # no compiler / ninja, a read-only cache, a broken toolchain: torch still works
        why = " ".join(str(e).split())[:300]
        _state["why"] = why
        print(f"dspine: warning: CPU kernels unavailable, using torch's ({why})", file=sys.stderr, flush=True)
        return None


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (after it ran), else None."""
    return _state.get("why")  # type: ignore[return-value]


def kernel_name() -> str:
    """What computes the fp32 linears: ``dspine-avx512`` / ``dspine-avx2`` / ``dspine-generic`` or ``torch``."""
    isa = load()
    return f"dspine-{isa}" if isa else "torch"


class PackedLinear(nn.Module):
    """Inference-only ``nn.Linear`` replacement whose weight is repacked for ``csrc/linear.cpp``.

    The packed weight is the only copy (no float ``weight`` attribute): it is a permutation of the original,
    zero padded to whole tiles. fp32 only.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("PackedLinear needs a float32 CPU weight")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.dspine_cpu.pack_linear(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        y = torch.ops.dspine_cpu.linear(flat, self.packed, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` under ``module`` by a ``PackedLinear``, in place; how many.

    Call ``load()`` first (this does not fall back by itself).
    """
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if isinstance(child, nn.Linear) and w.dtype == torch.float32 and w.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count


class FusedRMSNorm(nn.Module):
    """Inference-only ``layers.RMSNorm`` in one call (fp32); shares the original's weight."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps, self.offset = float(norm.eps), float(norm.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return _rms_norm_torch(x, self.weight, self.eps, self.offset)
        return torch.ops.dspine_cpu.rms_norm(x, self.weight, self.eps, self.offset)


def _rms_norm_torch(x, weight, eps, offset):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (offset + weight.float())).to(dtype)


def fuse_norms(module: nn.Module) -> int:
    """Replace every ``layers.RMSNorm`` under ``module`` by a ``FusedRMSNorm``, in place; how many."""
    from .layers import RMSNorm

    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm) and child.weight.dtype == torch.float32:
                setattr(parent, name, FusedRMSNorm(child))
                count += 1
    return count


def rope_store(q, k, v, cos, sin, kc, vc, pos):
    """RoPE on q [B, T, Hq, D] (in place) and k; k and v stored into the caches [B, Hkv, cap, D] at pos [B, T];
    cos/sin [B, T, rotary_dim]. Returns q."""
    return torch.ops.dspine_cpu.rope_store(q, k, v, cos, sin, kc, vc, pos)


def attend_cache(q, kc, vc, pos, window: int | None, scale: float) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] at positions pos [B, T] over the caches (slots <= pos, within ``window``)
    -> [B, T, Hq * D]."""
    return torch.ops.dspine_cpu.attend_cache(q, kc, vc, pos, int(window or 0), float(scale))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    return torch.ops.dspine_cpu.silu_mul(gate_up)
