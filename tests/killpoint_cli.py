"""``dspine-batch`` on the scripted engine that kills itself (SIGKILL: no handler, no cleanup, no flush) at one exact
step of the commit protocol on a local OUTDIR, for its crash tests: ``python tests/killpoint_cli.py generate ...``
with ``DSPINE_TEST_KILL_AT=<when>:<call>:<glob>:<n>``, e.g. ``before:link:commit-*.json:2`` (the second part
staged, its record not created), ``before:rename:train-*.parquet:2`` (its record created, not published) or
``after:replace:supersede-*:1`` (a retry's journal written). ``call`` is an ``os`` function taking (src, dst); the
glob matches the destination's file name. The object-store tests kill at a request instead (``objstore/faultproxy``).
Only this child process is patched: the real protocol runs, and a real kill -9 ends it."""

from __future__ import annotations

import fnmatch
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scripted_cli import remember_verdicts, scripted_engine  # noqa: E402  (not tests/helpers.py: a child imports no torch)

from dspine_batch.cli import main  # noqa: E402
from dspine_batch.engines.registry import engines_replaced  # noqa: E402


def _arm(spec: str) -> None:
    when, call, pattern, nth = spec.split(":")
    real = getattr(os, call)
    seen = [0]

    def wrapped(src, dst, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        hit = fnmatch.fnmatch(os.path.basename(os.fsdecode(dst)), pattern)
        if hit:
            seen[0] += 1
        fire = hit and seen[0] == int(nth)
        if fire and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(src, dst, *args, **kwargs)
        if fire:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(os, call, wrapped)


if __name__ == "__main__":
    if os.environ.get("DSPINE_TEST_KILL_AT"):
        _arm(os.environ["DSPINE_TEST_KILL_AT"])
    remember_verdicts()
    with engines_replaced(scripted_engine):
        main()
