"""A shard's run as ``status`` and ``report`` see it: its advisory state file (``ShardState``: progress, pid, starts,
the engine's decisions, an engine death's suspects), when its first token came (``first_token_s``), and what each
part's schema metadata says of its run (``manifest_meta``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspine_batch import IMPORTED_AT
from dspine_batch.engines.base import Engine
from dspine_batch.log import log
from dspine_batch.outdir.done import DoneSet
from dspine_batch.outdir.output import OutDir, Output, committed_parts
from dspine_batch.run import deaths
from dspine_batch.run.shard import attempt_from_env
from dspine_batch.run.sink import TALLIES, SinkStats, committed_tallies

# counts a shard keeps across its starts (each start adds its own): engine deaths, watchdog firings, rows retried
CARRIED_COUNTS = ("engine_deaths", "watchdog_firings", "retried_rows")


@dataclass
class ShardState:
    """The advisory ``_dspine/state-<shard>.json`` that ``status`` reads (the truth is in the parts)."""

    outdir: str
    tag: str
    fields: dict[str, Any] = field(default_factory=dict)
    before: DoneSet | None = None
    decisions: Callable[[], dict[str, Any] | None] | None = None  # the engine's record (``decisions.DecisionLog``)
    out: Output | None = None  # where the state file lives (None: the local directory ``outdir``)
    carried: SinkStats = field(default_factory=SinkStats)  # the earlier starts' tallies (``start``)
    _cpu0: float = 0.0  # this process's CPU time at ``start``

    def _out(self) -> Output:
        return self.out if self.out is not None else OutDir(self.outdir)

    def start(self, shard: tuple[int, int], fingerprint: str, done: DoneSet,
              facts: dict[str, Any] | None = None) -> None:
        prev = self._out().read_state(self.tag)
        attempt = attempt_from_env()
        self.before = done
        self.fields = {"shard": f"{shard[0]}/{shard[1]}", "fingerprint": fingerprint, "state": "running",
                       "pid": os.getpid(), "attempt": attempt, "starts": int(prev.get("starts", 0)) + 1,
                       "started_at": time.time(), "elapsed_before_s": float(prev.get("elapsed_s", 0.0)),
                       "rows_before": done.rows, "error_rows_before": done.error_rows,
                       "cpu_before_s": float(prev.get("cpu_s", 0.0)),
                       **{k: int(prev.get(k, 0)) for k in CARRIED_COUNTS}}
        # the tallies of the starts before (tokens, filtered rows, by source: what the done-set does not count), at
        # their last commit: this start's are added to them, so a resumed job's totals are the job's
        kept = (*TALLIES, "by_source")
        same = prev.get("totals") is not None and prev.get("rows_done") == done.rows
        parts = [p for p in committed_parts(self.outdir) if p.shard == self.tag] if done.rows and not same else []
        if same:
            self.carried = SinkStats(**{k: v for k, v in prev["totals"].items() if k in kept})
        elif (lag := _lagging(prev, parts, done.rows)) is not None:  # killed between commits and the state's save
            self.carried = SinkStats(**{k: v for k, v in prev["totals"].items() if k in kept})
            self.carried.absorb(lag)
        else:  # the state says nothing of the parts (or something else): the parts' own figures
            self.carried = committed_tallies([p.path for p in parts]) if done.rows else SinkStats()
        self._cpu0 = time.process_time()
        for k, v in (facts or {}).items():  # a count of this start's adds to the starts' before
            self.fields[k] = self.fields[k] + v if k in CARRIED_COUNTS else v
        if prev.get("decisions"):  # kept until this start's engine says more (a no-op rerun never does)
            self.fields["decisions"] = prev["decisions"]
        if prev.get(deaths.STATE_KEY):  # the rows the last engine death left to run alone (``deaths``)
            self.fields[deaths.STATE_KEY] = prev[deaths.STATE_KEY]
        if os.environ.get("SLURM_JOB_ID"):  # batch logs are appended across requeues: say which start this is
            job = os.environ.get("SLURM_ARRAY_JOB_ID")
            job = f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if job else os.environ["SLURM_JOB_ID"]
            self.fields["slurm_job"] = job
            log(f"shard {shard[0]}/{shard[1]}: Slurm job {job}, restart {attempt}, start {self.fields['starts']} "
                "of this shard")
        self.save(SinkStats())

    def count(self, key: str) -> None:
        """One more of a carried count (``CARRIED_COUNTS``: engine deaths, watchdog firings), kept across starts."""
        self.fields[key] = int(self.fields.get(key, 0)) + 1

    def save(self, committed: SinkStats, state: str | None = None, **extra: Any) -> None:
        f, before = self.fields, self.before
        assert before is not None
        totals = SinkStats()
        totals.absorb(self.carried)
        totals.absorb(committed)
        f.update(rows_done=before.rows + committed.rows, error_rows=before.error_rows + committed.error_rows,
                 next_seq=before.next_seq + committed.parts,
                 parts=committed.parts, last_commit_at=committed.last_commit, commit_s=round(committed.commit_s, 4),
                 completion_tokens_this_run=committed.completion_tokens, totals=totals.totals(),
                 elapsed_s=f["elapsed_before_s"] + time.time() - f["started_at"],
                 cpu_s=round(f["cpu_before_s"] + time.process_time() - self._cpu0, 3), **extra)
        if state:
            f["state"] = state
        record = self.decisions() if self.decisions else None
        if record is not None:
            f["decisions"] = record
        self._out().write_state(self.tag, f)


def _lagging(prev: dict[str, Any], parts: list[Any], rows: int) -> SinkStats | None:
    """The tallies of the parts committed after the state was last saved (a kill between a commit and the save
    that follows it; a store's state writes trail its commits), when the state's ``next_seq`` says which they are
    and they bring its rows to the done-set's: then only those parts are read, not every committed one (a resume
    over 10M rows would read them all). None when that does not add up."""
    if prev.get("totals") is None or not isinstance(prev.get("next_seq"), int):
        return None
    at = prev["next_seq"]
    if {p.seq for p in parts if p.seq < at} != set(range(at)):
        return None
    lag = committed_tallies([p.path for p in parts if p.seq >= at])
    return lag if int(prev.get("rows_done", -1)) + lag.rows == rows else None


START_SLACK_S = 1.0  # Python's own start-up before ``dspine_batch`` is imported: tens of milliseconds, rarely more


def since_start() -> float:
    """Seconds since this process started: the kernel's record on Linux (so Python's own start-up counts) when it
    is within ``START_SLACK_S`` of this package's import, else the time since that import. Why the check: the
    kernel records when the process was forked, not when it began running Python, and a shell hands its own start
    on: ``bash -c 'setup && dspine-batch ...'`` runs setup, then execs dspine-batch in its own process (bash does
    so with a list's last command), whose recorded start is then the shell's, minutes early."""
    imported = time.monotonic() - IMPORTED_AT
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        kernel = float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return imported
    return kernel if kernel - imported <= START_SLACK_S else imported


def first_token_s(engine: Engine) -> float | None:
    """Seconds from the command's start to the first token the engine sampled, where the engine records it
    (``first_token_at``, a ``time.monotonic()``); None where it does not, or before any row got a token."""
    at = getattr(engine, "first_token_at", None)
    return None if at is None else max(0.0, since_start() - (time.monotonic() - at))


def manifest_meta(manifest: dict) -> str:
    """What each part's schema metadata says of its run (a one-stage job's parts)."""
    return json.dumps({k: manifest[k] for k in ("fingerprint", "config", "versions", "num_shards")} |
                      {"engine": manifest["fingerprint_fields"]["engine"]}, default=str)
