"""Why each proposal source ran or did not: the optional ``explain()`` of an engine, and the tally engines build
it from.

The contract (an engine MAY have it; the pipeline asks with ``getattr``)::

    engine.explain() -> {source: {"rounds": int, "proposed": int, "accepted": int, "ran": bool,
                                  "why": str | None, ...}}

``source`` is a proposal source's name (``dspine`` the DSpine draft, ``suffix`` suffix matches, ``forced``
tokens from grammars); the counts are this engine's so far (verify rounds the source led, tokens it proposed and
had accepted), ``ran`` whether it led any round, and ``why`` a short reason in the user's terms, None while the
engine has none (e.g. "proposers=suffix", or from the scheduler, "its measured τ 1.5 is below the 1.7 a round
costs on this CPU"). A ``why`` is a decision, not "nothing yet": the log prints the first one it sees for each
source, so an engine gives none before it knows. Extra keys are allowed and kept. The pipeline records it with
the shard's state at every commit and logs each source's ``why`` once, when it first appears
(``dspine_batch.engines.decisions``); ``dspine-batch report`` shows a line per source, "not run — <why>" for one
that never ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dspine_batch.engines.base import Result

SOURCES = ("dspine", "suffix", "forced")


class SourceTally:
    """Rounds and tokens by source, summed over the results an engine yields (their ``dspine_*`` / ``suffix_*``
    fields), for its ``explain()``."""

    def __init__(self) -> None:
        self.counts = {s: [0, 0, 0] for s in SOURCES}

    def add(self, res: Result) -> Result:
        for src in SOURCES:
            c = self.counts[src]
            for k, name in enumerate(("verify_steps", "tokens_proposed", "tokens_accepted")):
                c[k] += getattr(res, f"{src}_{name}") or 0
        return res

    def explain(self, why: Callable[[str, bool], str | None],
                extra: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The contract's dict: ``why(source, ran)`` gives the reason (None: none known); ``extra[source]`` adds
        keys (a ``why`` there, e.g. from the decode loop, wins)."""
        out = {}
        for src, (rounds, proposed, accepted) in self.counts.items():
            more = dict((extra or {}).get(src) or {})
            reason = more.pop("why", None) or why(src, rounds > 0)
            out[src] = {"rounds": rounds, "proposed": proposed, "accepted": accepted, "ran": rounds > 0,
                        "why": reason, **more}
        return out
