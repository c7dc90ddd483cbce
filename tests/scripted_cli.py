"""``dspine-batch`` with the scripted test engine behind ``auto``/``reference``: the subprocess tests' entry point
(kill -9, signals), so the production CLI needs no switch for tests. ``python tests/scripted_cli.py generate ...``

Lean on purpose: a child imports only what the production CLI imports for a job on the scripted engine (no torch, no
tests/helpers.py), ~1 s a start instead of ~2.5 s, and the kill -9 and one-path tests start hundreds of children.
A job with a JSON schema is checked with xgrammar before it starts (``requests/structures.py``), and xgrammar
imports torch and transformers: ~2.6 s of every such child. So the children of one test session share xgrammar's
verdicts (``remember_verdicts``): the first child to meet a structure compiles it, the others read its verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dspine_batch.cli import main
from dspine_batch.engines.base import Structure
from dspine_batch.engines.registry import engines_replaced
from dspine_batch.engines.scripted import ScriptedEngine


def scripted_engine(model: str, draft: str, engine_args: dict[str, str]) -> ScriptedEngine:
    """Engine loader: the deterministic scripted engine, whatever model was asked for."""
    return ScriptedEngine.from_args(engine_args)


def remember_verdicts() -> None:
    """xgrammar's verdict on each structure (None: it compiles; else its reason) kept in ``$DSPINE_TEST_VERDICTS``
    (a directory of the test session, ``tests/conftest.py``), one file per structure digest, written whole
    (os.replace) so two children meeting the same structure both read a complete verdict. The up-front check runs
    as in production (same ``StructureCheck``, same messages); only the compile is shared. Unset: no sharing."""
    where = os.environ.get("DSPINE_TEST_VERDICTS")
    if not where:
        return
    from dspine_batch.requests import structures

    compile_grammar = structures.grammar_of

    def grammar_of(structure: Structure) -> None:
        path = Path(where) / f"{structure.digest}.json"
        try:
            verdict = json.loads(path.read_text())
        except (OSError, ValueError):
            try:
                compile_grammar(structure)
                verdict = None
            except ValueError as e:
                verdict = str(e)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(verdict))
            os.replace(tmp, path)
        if verdict is not None:
            raise ValueError(verdict)

    structures.grammar_of = grammar_of


if __name__ == "__main__":
    remember_verdicts()
    with engines_replaced(scripted_engine):
        main()
