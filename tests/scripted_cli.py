"""``dspine-batch`` with the scripted test engine behind ``auto``/``reference``: the subprocess tests' entry point
(kill -9, signals), so the production CLI needs no switch for tests. ``python tests/scripted_cli.py generate ...``

Lean on purpose: a child imports only what the production CLI imports for a job on the scripted engine (no torch, no
tests/helpers.py), ~1 s a start instead of ~2.5 s, and the kill -9 and one-path tests start hundreds of children."""

from __future__ import annotations

from dspine_batch.cli import main
from dspine_batch.engines.registry import engines_replaced
from dspine_batch.engines.scripted import ScriptedEngine


def scripted_engine(model: str, draft: str, engine_args: dict[str, str]) -> ScriptedEngine:
    """Engine loader: the deterministic scripted engine, whatever model was asked for."""
    return ScriptedEngine.from_args(engine_args)


if __name__ == "__main__":
    with engines_replaced(scripted_engine):
        main()
