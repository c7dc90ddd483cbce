"""Whether ``--engine auto`` may take SGLang here: every piece a GPU run needs, checked before the choice, so a
missing piece means the reference engine and one line saying why, never a fatal error after SGLang was chosen.

What a GPU run needs beyond ``import sglang``: a CUDA GPU with bfloat16 (the dtype both engines resolve ``auto`` to
where their hardware runs it natively: ``gpu_dtype``); SGLang's CUDA kernels (``sgl_kernel``, the CUDA build: dspine's
CPU stand-in does not count); an attention backend that imports (flashinfer, SGLang's default; else fa3 on Hopper
or newer, else triton, passed to SGLang explicitly so it never picks the missing one); the DSPINE plugin's entry
point installed and importable in this environment, at SGLang's exact version, and not excluded by
``SGLANG_PLUGINS`` (SGLang's spawned processes load DSPINE only through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Readiness:
    ok: bool
    why: str  # one line, said whichever engine is picked
    engine_args: dict[str, str] = field(default_factory=dict)  # what the checks decided (under the user's args)


def gpu_dtype(cuda: Any = None) -> str:
    """``dtype=auto`` on a GPU: bfloat16 where the GPU has it (what the reference engine resolves where its CPU runs
    bf16 natively), float32 elsewhere (the reference engine's other answer); never the checkpoint's own dtype."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    return "bfloat16" if cuda.is_available() and cuda.is_bf16_supported() else "float32"


def _imports(name: str, import_module: Callable[[str], Any]) -> str | None:
    """None if ``name`` imports, else why not (one line)."""
    try:
        import_module(name)
    except Exception as e:  # ImportError, OSError (libcuda), RuntimeError from a CUDA build without a driver
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def attention_backends(import_module: Callable[[str], Any], capability: tuple[int, int]) -> list[str]:
    """The attention backends that import here, in SGLang's order of preference."""
    out = []
    if _imports("flashinfer", import_module) is None:
        out.append("flashinfer")
    if capability >= (9, 0) and _imports("sgl_kernel.flash_attn", import_module) is None:
        out.append("fa3")
    if _imports("triton", import_module) is None:
        out.append("triton")
    return out


def check(import_module: Callable[[str], Any] = importlib.import_module, cuda: Any = None,
          plugin_problems: Callable[[], list[str]] | None = None) -> Readiness:
    """Everything ``--engine auto`` needs to run SGLang with DSPINE on this machine (see the module docstring)."""
    from importlib.util import find_spec

    if find_spec("sglang") is None:
        return Readiness(False, "sglang is not installed in this interpreter")
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available():
        return Readiness(False, "no CUDA GPU is visible")
    gpu = cuda.get_device_name(0)
    if not cuda.is_bf16_supported():
        return Readiness(False, f"the GPU ({gpu}) has no bfloat16")
    why = _imports("sgl_kernel", import_module)
    if why is None and getattr(import_module("sgl_kernel"), "STAND_IN", False):
        why = "only dspine's CPU stand-in is on the path"
    if why is not None:
        return Readiness(False, f"sgl_kernel (SGLang's CUDA kernels) does not import: {why}")
    backends = attention_backends(import_module, tuple(cuda.get_device_capability(0)))
    if not backends:
        return Readiness(False, "no attention backend imports (flashinfer, fa3, triton)")
    if plugin_problems is None:
        from dspine.sglang.plugin import problems as plugin_problems
    found = plugin_problems()
    why = _imports("dspine.sglang.plugin", import_module)
    if found or why:
        return Readiness(False, "; ".join(found or [f"the DSPINE plugin does not import: {why}"]))
    args = {} if backends[0] == "flashinfer" else {"attention_backend": backends[0]}
    note = "" if not args else f", attention {backends[0]} (flashinfer does not import)"
    return Readiness(True, f"sglang with DSPINE on {gpu}, bfloat16{note}", args)
