"""Engines by name: what ``--engine`` accepts and how each is loaded.

Its own module so the protocol (``base.py``) knows no implementation: each engine imports ``base``, this module
imports the engines (lazily, so ``--engine reference`` never imports SGLang), and the pipeline imports this.
Tests put the scripted engine behind the default names with ``engines_replaced``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from dspine_batch.engines.base import Engine
from dspine_batch.errors import UsageError

EngineLoader = Callable[[str, str, dict[str, str]], Engine]
"""``(model, draft, engine_args) -> Engine``."""


def _load_reference(model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    from dspine_batch.engines.reference import ReferenceEngine

    return ReferenceEngine.load(model, draft, engine_args)


def _load_sglang(model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    from dspine_batch.engines.sglang.engine import SGLangEngine, sglang_available

    ok, why = sglang_available(need_gpu=False)  # no GPU: SGLang's CPU test path
    if not ok:
        raise UsageError(
            f"--engine sglang is not available here: {why}; install the sglang extra in its own virtualenv "
            "(bash scripts/setup_sglang_venv.sh) and run dspine-batch from it, "
            "or use --engine reference"
        )
    return SGLangEngine.load(model, draft, engine_args)


def _load_scripted(model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    from dspine_batch.engines.scripted import ScriptedEngine

    return ScriptedEngine.from_args(engine_args)


def _pick_auto() -> tuple[str, dict[str, str]]:
    """``--engine auto``: SGLang where everything a GPU run needs is here (``sglang.readiness``), else the reference
    engine; one line on stderr either way, with why. Returns the name and the engine args the checks decided."""
    from dspine_batch.engines.sglang.readiness import check

    ready = check()
    name = "sglang" if ready.ok else "reference"
    print(f"dspine-batch: --engine auto picked {name} ({ready.why})", file=sys.stderr)
    return name, dict(ready.engine_args) if ready.ok else {}


ENGINE_NAMES = ("auto", "reference", "sglang")  # what --help offers
ENGINES: dict[str, EngineLoader] = {"reference": _load_reference, "sglang": _load_sglang,
                                    "scripted": _load_scripted}  # scripted: the hidden deterministic test engine


@contextmanager
def engines_replaced(loader: EngineLoader, names: Iterable[str] = ("auto", "reference")) -> Iterator[None]:
    """Load every engine in ``names`` with ``loader`` for the duration (``auto`` included): how tests and the
    benchmark put the scripted engine behind the default command line without touching the production path."""
    saved = dict(ENGINES)
    try:
        ENGINES.update(dict.fromkeys(names, loader))
        yield
    finally:
        ENGINES.clear()
        ENGINES.update(saved)


def _resolve(name: str) -> tuple[str, dict[str, str]]:
    args: dict[str, str] = {}
    if name == "auto" and "auto" not in ENGINES:
        name, args = _pick_auto()
    if name not in ENGINES:
        raise UsageError(f"unknown engine {name!r} (choose from {', '.join(ENGINE_NAMES)})")
    return name, args


def resolve_name(name: str) -> str:
    """The engine ``--engine NAME`` means here: ``auto`` is SGLang when everything a GPU run needs is present, else
    the reference engine (said on stderr, with why)."""
    return _resolve(name)[0]


def open_engine(name: str, model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    """Build the engine the user asked for (``resolve_name``); under ``auto`` the user's engine args over what the
    checks decided (an attention backend that imports)."""
    name, decided = _resolve(name)
    return ENGINES[name](model, draft, {**decided, **engine_args})
