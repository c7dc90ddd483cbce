"""What the engine decided about its proposal sources, kept with the run and said once in the log.

An engine may explain itself (``dspine_batch.engines.explain``: ``explain() -> {source: {rounds, proposed,
accepted, ran, why, ...}}``). The job records it in the shard's state file (``_dspine/state-<shard>.json``,
"decisions") at every commit and at the end, so a killed run keeps what its last commit saw; a resumed run adds its
engine's counts to the record of the starts before it (``merge``), since a new engine counts from zero. Each
source's ``why`` is logged once per start, when it first appears, marked "so far" (its numbers move while the job
runs); at the end the log prints a line per source from the final record, and ``dspine-batch report`` prints the
same lines from the records of all shards (``combine``): both go through ``source_lines``, so for one shard they
are equal by construction. Advisory like the rest of the state file: the counts in the parts are the truth, this
says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

COUNTS = ("rounds", "proposed", "accepted")
LABELS = {"dspine": "dspine draft", "suffix": "suffix", "forced": "forced"}
T = TypeVar("T")


def label(source: str) -> str:
    return LABELS.get(source, source)


def explain(engine: Any) -> dict[str, dict[str, Any]] | None:
    """The engine's ``explain()`` checked and normalised, or None when it has none. A malformed answer or an
    exception in it is an engine bug, but the record is advisory: it is dropped rather than failing the run."""
    fn = getattr(engine, "explain", None)
    if fn is None:
        return None
    try:
        raw = fn()
        out = {}
        for src, d in raw.items():
            entry = dict(d)
            for k in COUNTS:
                entry[k] = int(entry.get(k) or 0)
            entry["ran"] = bool(entry.get("ran", entry["rounds"] > 0))
            entry["why"] = None if entry.get("why") is None else " ".join(str(entry["why"]).split())
            out[str(src)] = entry
        return out
    except Exception:
        return None


def merge(before: dict[str, dict[str, Any]] | None, now: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """This start's record on top of the earlier starts': counts added, ran if any start ran it, this start's
    reason where it has one, else the earlier one."""
    out = {src: dict(d) for src, d in (before or {}).items()}
    for src, d in now.items():
        old = out.get(src, {})
        out[src] = {**old, **d, **{k: int(old.get(k) or 0) + d[k] for k in COUNTS},
                    "ran": bool(old.get("ran")) or d["ran"], "why": d["why"] or old.get("why")}
    return out


def combine(records: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several shards' records as one: counts added, ran if any shard ran it, the distinct reasons joined."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        for src, d in rec.items():
            o = out.setdefault(src, {**{k: 0 for k in COUNTS}, "ran": False, "why": None})
            for k in COUNTS:
                o[k] += int(d.get(k) or 0)
            o["ran"] = o["ran"] or bool(d.get("ran"))
            if d.get("stopped"):
                o["stopped"] = True
            why = d.get("why")
            if why and why not in (o["why"] or "").split(" / "):
                o["why"] = f"{o['why']} / {why}" if o["why"] else why
            for k, v in d.items():
                o.setdefault(k, v)
    return out


def render(entry: dict[str, Any]) -> str:
    """One source's line after its label, by one rule: what it did (verify steps it led, its proposed tokens accepted,
    tau), and a reason only when it did not run (no verify step: "not run — why") or was stopped mid-job (``stopped``:
    the draft retired; its measured figures are marked as such beside the estimates its reason quotes). A source that
    ran, however little, is its counts alone: an engine's reason for running it rarely ("hardly ran", from a moment
    of the job or one stream of it) is not repeated beside counts it could contradict."""
    rounds, proposed, accepted = (int(entry.get(k) or 0) for k in COUNTS)
    why = _HARDLY.sub("", entry.get("why") or "") or None  # older records: "hardly ran (11 rounds): <why>"
    if rounds:
        rate = f"{accepted / proposed:.3f}" if proposed else "-"
        tau = f"{(accepted + rounds) / rounds:.3f}"
        if entry.get("stopped") and why:
            return (f"{rounds:,} verify steps, {accepted:,} of {proposed:,} proposed tokens accepted (measured "
                    f"{rate}; tau {tau} tokens a step), then stopped — {why}")
        return f"{rounds:,} verify steps, {accepted:,} of {proposed:,} proposed tokens accepted ({rate}); tau {tau} " \
               "tokens a step"
    if why:
        return f"not run — {why}"
    if entry.get("chooser"):
        return f"not run — never chosen by {entry['chooser']}; no reason recorded"
    return "not run (no reason recorded)"


_HARDLY = re.compile(r"hardly ran \(\d+ rounds\): ")  # each of a combined record's reasons


def source_lines(record: dict[str, dict[str, Any]]) -> list[str]:
    """A line per source, ``dspine draft  274 verify steps, ...``: the run log's closing lines and the report's."""
    return [f"{label(src):<12} {render(entry)}" for src, entry in record.items()]


class DecisionLog:
    """Records the engine's decisions for the state file and logs each source's reason once, when it first
    appears (``watch`` asks after every finished row; ``note`` whenever)."""

    def __init__(self, engine: Any, before: dict[str, dict[str, Any]] | None, log: Callable[[str], None]):
        self.engine, self.before, self.log = engine, before, log
        self.said: set[str] = set()
        self.final: dict[str, dict[str, Any]] | None = None

    def record(self) -> dict[str, dict[str, Any]] | None:
        """The merged record for the state file (None: the engine does not explain itself)."""
        if self.final is not None:
            return self.final
        now = explain(self.engine)
        return None if now is None else merge(self.before, now)

    def freeze(self) -> None:
        """Keep the record as it stands, for the saves after the engine is closed (a staged job closes a model's
        engine before its stages finish): a closed engine would explain a state that is not its run's."""
        self.final = self.record()

    def note(self) -> None:
        for src, d in (explain(self.engine) or {}).items():
            shown = d.get("why") and (not d["rounds"] or d.get("stopped"))  # what ``render`` gives a reason for
            if shown and src not in self.said:  # once: a reason may carry live numbers that change every row
                self.said.add(src)
                self.log(f"{label(src)}, so far: {render(d)}")

    def summary(self) -> list[str]:
        """The closing lines: the final record, rendered as ``report`` renders it."""
        record = self.record()
        return ["proposal sources (as `dspine-batch report` shows them):", *("  " + x for x in source_lines(record))] \
            if record else []

    def watch(self, items: Iterator[T]) -> Iterator[T]:
        for item in items:
            self.note()
            yield item
