"""Entry point of the DSPINE SGLang plugin (``[project.entry-points."sglang.srt.plugins"] dspine``).

SGLang's ``load_plugins()`` calls ``register()`` (zero arguments) in every one of its processes (engine,
schedulers, detokenizer; they are *spawned*, so only the entry point reaches them). It is idempotent and may
also be called explicitly (``dspine_batch`` does, in the parent, before building ``sglang.Engine``).

SGLang swallows plugin exceptions (``logger.exception``) and a broken plugin only shows up later as
``Unknown speculative algorithm name: DSPINE``; ``problems()`` and ``ensure_available()`` give the real
reason up front (SGLang missing or another version, the entry point not installed in this environment,
``SGLANG_PLUGINS`` set without ``dspine``).
"""

from __future__ import annotations

import logging
import os
import sys

from . import ALGORITHM_NAME, ENTRY_POINT_NAME, SGLANG_VERSION
from .after_import import after_import

logger = logging.getLogger(__name__)
MODEL_PACKAGE = "dspine.sglang.models"
_registered = False


def register() -> None:
    """Register the DSPINE algorithm and the ``DSpineDraftModel`` architecture with SGLang (idempotent)."""
    global _registered
    if _registered:
        return
    import sglang

    if getattr(sglang, "__version__", None) != SGLANG_VERSION:
        logger.warning("dspine: built against sglang==%s, found %s; DSPINE may not work",
                       SGLANG_VERSION, getattr(sglang, "__version__", "?"))
    from . import cpu, name_checks, sampling
    from .algo import register_algorithm

    cpu.apply()  # only when SGLang runs on the CPU here (test/dev path)
    sampling.apply()  # only in engines dspine-batch starts (DSPINE_SGLANG_SAMPLING=reference)
    register_algorithm()
    name_checks.include()
    register_model()
    _registered = True


REGISTRY_MODULE = "sglang.srt.models.registry"


def register_model() -> None:
    """Add ``DSpineDraftModel`` to SGLang's model registry.

    Importing the registry imports every SGLang model (~30 s on a small CPU), which processes that never load
    a model (engine front-end, detokenizer) should not pay for the plugin. So when the registry is not imported
    yet, the registration runs right after its import instead (a one-shot import hook).
    """
    if _registry_hook_pending():
        return
    after_import(REGISTRY_MODULE, _add_model)


def _registry_hook_pending() -> bool:
    return any(getattr(f, "name", None) == REGISTRY_MODULE for f in sys.meta_path)


def _add_model(registry_module) -> None:
    registry = registry_module.ModelRegistry
    if "DSpineDraftModel" not in registry.models:
        registry.register(MODEL_PACKAGE, strict=True)


def plugins_env_problem(env: dict[str, str] | None = None) -> str | None:
    """The reason SGLANG_PLUGINS keeps DSPINE out, or None."""
    env = os.environ if env is None else env
    allowed = env.get("SGLANG_PLUGINS", "")
    if not allowed.strip():
        return None
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if ENTRY_POINT_NAME in names:
        return None
    return (f"SGLANG_PLUGINS={allowed!r} does not include {ENTRY_POINT_NAME!r}, so SGLang never loads the DSPINE "
            f"plugin in its worker processes (--speculative-algorithm DSPINE then fails as an unknown algorithm); "
            f"add it: SGLANG_PLUGINS={allowed},{ENTRY_POINT_NAME} (or unset SGLANG_PLUGINS)")


def entry_point_problem() -> str | None:
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == ENTRY_POINT_NAME]
    if not eps:
        return ("the 'dspine' sglang.srt.plugins entry point is not installed in this environment, so SGLang's "
                "spawned processes cannot load DSPINE; install this package here (pip install -e . or "
                "scripts/setup_sglang_venv.sh)")
    if eps[0].value != "dspine.sglang.plugin:register":
        return f"the 'dspine' entry point points at {eps[0].value!r}, expected 'dspine.sglang.plugin:register'"
    return None


def problems() -> list[str]:
    """Everything that would stop DSPINE from working in SGLang processes started from here (empty if none)."""
    out = []
    try:
        import sglang
    except ImportError as e:
        return [f"sglang is not installed in this interpreter ({e}); use scripts/setup_sglang_venv.sh"]
    version = getattr(sglang, "__version__", None)
    if version != SGLANG_VERSION:
        out.append(f"sglang=={version} is installed; DSPINE is written against sglang=={SGLANG_VERSION} exactly")
    for p in (entry_point_problem(), plugins_env_problem()):
        if p:
            out.append(p)
    return out


def ensure_available() -> None:
    """Raise RuntimeError naming every problem; else register DSPINE in this process and check it resolves."""
    found = problems()
    if found:
        raise RuntimeError("DSPINE cannot run in SGLang: " + "; ".join(found))
    register()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string(ALGORITHM_NAME)
    if not algo.is_dflash_family():
        raise RuntimeError(f"SpeculativeAlgorithm.from_string('DSPINE') returned {algo!r}, not the DSPINE plugin")
