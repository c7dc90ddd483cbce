"""DSpine: block draft model, lossless speculative decoding and reference targets, in pure PyTorch.

Public API::

    from dspine import load_target, load_draft, init_draft, generate
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["load_target", "load_draft", "init_draft", "generate", "ModelLoadError", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from dspine.decoding.decode import generate
    from dspine.draft.io import init_draft, load_draft
    from dspine.models.checkpoint import ModelLoadError
    from dspine.models.registry import load_target

_LAZY = {
    "load_target": ".models.registry",
    "load_draft": ".draft.io",
    "init_draft": ".draft.io",
    "generate": ".decoding.decode",
    "ModelLoadError": ".models.checkpoint",
}


def __getattr__(name: str):
    # Lazy imports keep `import dspine` cheap (the CLI imports it before it knows whether torch work is needed).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'dspine' has no attribute {name!r}")
