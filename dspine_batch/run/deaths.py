"""Engine deaths told apart: a transient one (a worker OOM-killed, a lost device) from a crash that repeats on the
same rows (a request that crashes the SGLang scheduler every time).

Every death ends the run with exit 75 after committing what finished, so a requeue resumes. Without more, a
deterministic crash would be requeued forever: each start admits the same rows, dies the same way, and a Slurm
array burns its requeues on them. So a death leaves the ids of the rows in flight in the shard's state
(``engine_death``); the next start runs those rows first, **one at a time, alone**, before any other row:

- a suspect that finishes alone is committed as usual and cleared;
- the engine dying again while a suspect runs alone is the repeat: that row becomes an error row naming the
  engine's message (committed at once), and the run exits 75 again so the rest resumes;
- once every suspect ran alone, the earlier death was transient, and the log says so.

A row is therefore given two chances, the second with nothing else in flight (a crash caused by a neighbour, or by
the batch's size, does not condemn it), and a poisonous row costs two restarts, not all of them. The record lives in
the advisory state file: lost, it costs one more restart, never a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dspine_batch.errors import EngineDied
from dspine_batch.requests.mapping import WorkItem

STATE_KEY = "engine_death"
MAX_MESSAGE = 300


@dataclass
class Death:
    """What the last engine death left for the next start: the engine's message, the rows in flight that are not
    committed yet (``rows``), and how many deaths this shard has seen in a row."""

    message: str
    rows: list[str] = field(default_factory=list)
    deaths: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {"message": self.message, "rows": list(self.rows), "deaths": self.deaths}

    @staticmethod
    def of(value: Any) -> Death | None:
        """The record from a state file (None when absent or unreadable: advisory)."""
        if not isinstance(value, dict) or not isinstance(value.get("rows"), list):
            return None
        return Death(str(value.get("message", "")), [str(r) for r in value["rows"]], int(value.get("deaths", 1)))


def after_death(previous: Death | None, error: BaseException) -> Death:
    """The record a death leaves: the rows it died with (the scheduler's ``in_flight``) and its message."""
    message = " ".join(str(error).split())[:MAX_MESSAGE] or type(error).__name__
    rows = list(dict.fromkeys(getattr(error, "in_flight", None) or []))
    return Death(message, rows, (previous.deaths + 1) if previous else 1)


def died_line(death: Death) -> str:
    """The log line of a death in the normal course of a run."""
    n = len(death.rows)
    which = f"{n} row{'s' if n != 1 else ''} in flight" if n else "no row in flight"
    return (f"the engine died with {which} ({death.message}); finished rows are committed. Run the same command "
            "again to resume: the rows in flight then run alone first, and a row the engine dies on again becomes "
            "an error row (a crash that repeats is not requeued forever)")


def repeat_error(death: Death, message: str) -> str:
    """The error of a row the engine died on twice, the second time alone."""
    return (f"the engine died twice with this row in flight, the second time with no other row: {message} "
            f"(first death: {death.message})")


class RepeatedDeath(EngineDied):
    """The engine died again with one suspect alone in flight: that row is an error row now; the run exits 75
    (the engine is gone) and the next start goes on with the other suspects."""


def isolate(death: Death, items: Iterator[WorkItem], run_alone: Callable[[WorkItem], None],
            mark_error: Callable[[WorkItem, str], None], save: Callable[[Death | None], None],
            log: Callable[[str], None]) -> None:
    """Run each suspect of ``death`` alone (``run_alone`` schedules one row with nothing else in flight and commits
    it), in input order; ``items`` yields the rows still uncommitted. On a repeat death ``mark_error`` commits the
    row as an error row with the given message and ``RepeatedDeath`` is raised; ``save`` records what is left to
    isolate (None: nothing)."""
    suspects = set(death.rows)
    log(f"the last run's engine died with {len(suspects)} row(s) in flight ({death.message}); running them alone "
        "first, to tell a crash that repeats on a row from a transient one")
    ran = 0
    for item in items:
        if item.row_id not in suspects:
            continue
        suspects.discard(item.row_id)
        try:
            run_alone(item)
        except EngineDied as e:
            message = " ".join(str(e).split())[:MAX_MESSAGE]
            mark_error(item, repeat_error(death, message))
            save(Death(death.message, sorted(suspects), death.deaths + 1) if suspects else None)
            log(f"the engine died again with row {item.row_id} alone in flight ({message}): a crash that repeats "
                f"on this row, not a transient death; the row is an error row, committed. Run the same command "
                f"again to resume the rest ({len(suspects)} other row(s) still to run alone first)")
            raise RepeatedDeath(message) from e
        ran += 1
        save(Death(death.message, sorted(suspects), death.deaths) if suspects else None)
        if not suspects:
            break
    save(None)
    log(f"the last engine death was transient: the {ran} uncommitted row(s) in flight then all finished alone")
