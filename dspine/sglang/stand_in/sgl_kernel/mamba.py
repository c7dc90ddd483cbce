"""Stand-in for ``sgl_kernel.mamba`` (the Gated DeltaNet CPU functions; see ``dspine.sglang.cpu_kernels``)."""

from dspine.sglang.cpu_kernels import MAMBA_OPS

globals().update(MAMBA_OPS)
__all__ = sorted(MAMBA_OPS)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.mamba.{name} has no CPU stand-in")

    missing.__name__ = name
    return missing
