"""Run a callback right after a module is imported (now, if it already is).

The plugin's ``register()`` runs in every SGLang process, including the front end and the detokenizer,
which never load a model; importing SGLang's model modules there just to patch or register something costs
tens of seconds on a small CPU. A one-shot import hook defers that work to the processes that import them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from types import ModuleType

logger = logging.getLogger(__name__)


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` once ``name`` is imported: at once when it is, else right after its import (several
    callbacks for one module run in the order they were registered)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    pending = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
    if pending is not None:
        pending.callbacks.append(callback)
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs its callbacks on the module once, right after ``name`` has been imported."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self.name, self.callbacks = name, [callback]

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, callbacks = spec.loader.exec_module, self.callbacks

        def exec_module(module):
            run(module)
            for callback in callbacks:
                try:
                    callback(module)
                except Exception:  # never break SGLang's import; the failure shows in the log and the self-check
                    logger.exception("dspine: post-import step for %s failed", fullname)

        spec.loader.exec_module = exec_module
        return spec
