"""A hang that ends: the stall watchdog and the per-request timeout.

An engine that stops producing while requests are in flight (an SGLang scheduler deadlock, a stuck collective on a
GPU node) would otherwise hold its allocation until the time limit, saying nothing. Two guards:

* ``--request-timeout`` (per request): a request in the engine longer than this ends its row as an error row
  ("request timed out after 600s (--request-timeout)"), so one pathological row cannot stall the job. Engines that
  know the setting (``engine.request_timeout``) end the request themselves; for the others the scheduler ends the
  row when it next hears from the engine (``InFlight.expire``), and drops the engine's answer if one comes later.
* ``--stall-seconds`` (the job): when neither a result nor the engine's own progress counter (an optional
  ``engine.progress() -> int``, e.g. tokens generated) has moved for that long while requests are in flight, the
  ``Watchdog`` thread says what it saw (requests in flight, the oldest rows, when the last result came, the
  engine's own ``describe_state()`` where it has one) and stops the run as a stop signal's grace timeout does:
  ``Interrupted`` raised in the main thread, which is inside the engine (nowhere else may it land,
  ``shutdown``). The job commits the finished rows, commits the rows past --request-timeout as error rows (so a
  requeue does not stall on them again) and exits 75; the same command resumes. If the main thread does not come
  back within ``HARD_EXIT_S`` (stuck in native code) the process exits 75 at once: committed parts are safe at
  any instant (``sink``), rows not committed are generated again.

The default stall time (30 minutes) is far above any result gap a slow CPU or a long prefill produces with the
result counter alone; nothing here is timed in a test, which use a short --stall-seconds and look at the exit
code and the committed rows.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspine_batch.engines.base import Request, Result
from dspine_batch.errors import EXIT_INTERRUPTED, request_timed_out

HARD_EXIT_S = 60.0


@dataclass
class InFlight:
    """The scheduler's rows in the engine: admission time of each request, the rows waiting for samples, and when
    the engine last produced. Written by the main thread; the watchdog thread only reads it."""

    timeout: float | None = None  # --request-timeout; None or 0: off
    # (row_id, sample) -> monotonic time, oldest first (``admit`` re-inserts): ``expire`` reads the head only
    admitted: dict[tuple[str, int], float] = field(default_factory=dict)
    pending: dict[str, list] = field(default_factory=dict)  # row_id -> [item, results, samples left]
    last_progress: float = field(default_factory=time.monotonic)
    results: int = 0

    def admit(self, req: Request) -> None:
        key = (req.row_id, req.sample_index)
        self.admitted.pop(key, None)  # to the end: the dict stays in admission order
        self.admitted[key] = time.monotonic()

    def finish(self, res: Result) -> list | None:
        """The pending entry the result belongs to (None: its row already ended, e.g. timed out: drop it)."""
        self.last_progress = time.monotonic()
        self.results += 1
        self.admitted.pop((res.row_id, res.sample_index), None)
        return self.pending.get(res.row_id)

    def expire(self, now: float | None = None) -> list[tuple[Any, list[Result]]]:
        """Rows with a request in the engine longer than the timeout, ended now as error rows (their other samples'
        results kept as they came, the missing ones errors)."""
        if not self.timeout or not self.admitted:
            return []
        now = time.monotonic() if now is None else now
        # called once per scheduler turn: the oldest request decides in O(1) whether any is late (a scan of every
        # request in flight here was a third of the zero-cost pipeline's CPU at --max-in-flight 1024)
        late: set[str] = set()
        for (rid, _), t in self.admitted.items():
            if now - t <= self.timeout:
                break
            late.add(rid)
        out = []
        for rid in late:
            entry = self.pending.pop(rid, None)
            for key in [k for k in self.admitted if k[0] == rid]:
                del self.admitted[key]
            if entry is None:
                continue
            item, results, _ = entry
            message = request_timed_out(self.timeout)
            out.append((item, [r if r is not None else Result(rid, s, error=message)
                               for s, r in enumerate(results)]))
        return out

    def oldest(self, n: int = 3) -> list[tuple[str, float]]:
        now = time.monotonic()
        ages = sorted(((now - t, rid) for (rid, _), t in list(self.admitted.items())), reverse=True)
        return [(rid, age) for age, rid in ages[:n]]


class Watchdog:
    """The thread that ends a stalled run (see the module docstring)."""

    def __init__(self, inflight: InFlight, stall_seconds: float, shutdown: Any, engine: Any,
                 log: Callable[[str], None]):
        self.inflight, self.stall, self.shutdown, self.engine, self.log = inflight, stall_seconds, shutdown, engine, log
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: Any = None

    def start(self) -> Watchdog:
        if self.stall and self.stall > 0:
            self._thread = threading.Thread(target=self._watch, name="dspine-batch-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _engine_progress(self) -> None:
        fn = getattr(self.engine, "progress", None)
        if fn is None:
            return
        try:
            now = fn()
        except Exception:  # advisory
            return
        if now != self._progress:
            self._progress = now
            self.inflight.last_progress = time.monotonic()

    def _watch(self) -> None:
        tick = min(1.0, self.stall / 4)
        while not self._stop.wait(tick):
            self._engine_progress()
            idle = time.monotonic() - self.inflight.last_progress
            if self.inflight.admitted and self.shutdown.in_engine and idle > self.stall and not self.shutdown.requested:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        inflight = self.inflight
        rows = ", ".join(f"{rid!r} ({age:.0f}s)" for rid, age in inflight.oldest())
        state = ""
        describe = getattr(self.engine, "describe_state", None)
        if describe is not None:
            try:
                state = f"; engine: {describe()}"
            except Exception as e:  # advisory
                state = f"; engine: describe_state failed ({type(e).__name__})"
        self.fired = (f"stalled: nothing produced for {idle:.0f}s (--stall-seconds {self.stall:g}) with "
                      f"{len(inflight.admitted)} request(s) in flight (oldest: {rows}); {inflight.results:,} results "
                      f"before it{state}")
        self.log(f"{self.fired}; committing the finished rows and exiting {EXIT_INTERRUPTED} (run the same command "
                 "again to resume)")
        self.shutdown.request("stalled")
        if self._stop.is_set():  # the run ended meanwhile (its signal handlers may be gone): nothing to stop
            return
        os.kill(os.getpid(), signal.SIGALRM)  # Shutdown's handler: Interrupted if in the engine, else a flag
        if not self._stop.wait(HARD_EXIT_S):
            print(f"dspine-batch: the engine did not return within {HARD_EXIT_S:g}s of the stall; exiting "
                  f"{EXIT_INTERRUPTED} now (committed parts are safe; the rest is generated again on resume)",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
