"""Stand-in for the ``sgl_kernel`` package on a CPU-only machine (test/dev path, see ``dspine.sglang.cpu``).

Only put on ``sys.path`` when the real package cannot be imported and SGLang runs on the CPU; it provides
the torch versions of the CPU ops SGLang imports from ``sgl_kernel`` (``dspine.sglang.cpu_kernels``), the
``sgl_kernel.mamba`` functions of the Gated DeltaNet CPU path, and registers the ops SGLang reaches through
``torch.ops.sgl_kernel`` (``cpu_kernels.register_torch_ops``) when it is imported.
"""

from dspine.sglang.cpu_kernels import OPS, register_torch_ops

globals().update(OPS)
__all__ = sorted(OPS)
STAND_IN = True
register_torch_ops()


def __getattr__(name: str):
    """Any other op: importable (SGLang imports many at module level) but fails clearly if ever called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (dspine's SGLang CPU path runs tiny "
                                  "dense/GDN models through torch_native only)")

    missing.__name__ = name
    return missing
