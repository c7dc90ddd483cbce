"""Bounded in-flight scheduling between the row stream and the engine.

The engine pulls requests lazily from ``feed``; at most ``max_in_flight`` are open at once, so memory is
bounded by in-flight work, never by input size. Samples of a row are gathered until the row is complete
(a row commits whole). Rows that need no engine work (input errors) bypass the engine; if many pile up, the
current ``engine.run`` is drained and restarted so they can flow out without unbounded buffering. Scoring rows
(``stages.score``) take the same way out: gathered, scored together by ``engine.score`` (one prefill each, no
decoding), then yielded as bypassed rows are.
Setting ``stop.requested`` stops admission: in-flight requests finish, then the schedule ends. An engine death
(``EngineDied``) leaves with the ids of the rows in flight (``in_flight``): ``deaths.py`` tells a crash that
repeats on them from a transient one. ``inflight`` (``watchdog.InFlight``) holds the rows in the engine, so the
watchdog can see them and rows past --request-timeout end as error rows when the engine next yields.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from dspine_batch.engines.base import Engine, Request, Result
from dspine_batch.errors import EngineDied
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.run.watchdog import InFlight

MAX_BYPASS = 4096
SCORE_BATCH = 16  # scoring rows scored together (``engines.scoring`` batches their sequences)
SCORE_BACKLOG = 64  # scored rows waiting to flow out before the engine's stream is drained for them


class StopFlag(Protocol):
    requested: bool
    in_engine: bool  # set while the engine runs: only there may a grace timeout abort work


def schedule(items: Iterable[WorkItem], engine: Engine, max_in_flight: int, stop: StopFlag,
             inflight: InFlight | None = None) -> Iterator[tuple[WorkItem, list[Result] | None]]:
    """Yield ``(item, results)`` for every admitted row as it completes; ``results`` is None for error rows."""
    source = iter(items)
    bypass: deque[tuple[WorkItem, list[Result] | None]] = deque()
    inflight = inflight if inflight is not None else InFlight()
    pending = inflight.pending  # row_id -> [item, results, remaining]
    state = {"exhausted": False}
    scoring: list[WorkItem] = []
    ahead: deque[WorkItem] = deque()  # a row pulled to decide how to run it, not admitted yet

    def pull() -> WorkItem | None:
        if ahead:
            return ahead.popleft()
        try:
            return next(source)
        except StopIteration:
            state["exhausted"] = True
            return None

    def score() -> None:
        """The scoring rows gathered so far, scored at once (no decoding: they bypass the engine's stream)."""
        if scoring:
            results = iter(engine.score([r for it in scoring for r in it.requests]))  # type: ignore[attr-defined]
            bypass.extend((it, [next(results) for _ in it.requests]) for it in scoring)
            scoring.clear()

    def take(item: WorkItem) -> bool:
        """A row that needs no decoding bypassed or gathered for scoring (True), else False."""
        if not item.requests:
            bypass.append((item, None))
        elif item.requests[0].continuations is not None:  # a scoring row (``stages.score``)
            scoring.append(item)
            if len(scoring) >= SCORE_BATCH:
                score()
        else:
            return False
        return True

    def without_engine() -> None:
        """Rows that need no decoding, while they are all there is, run without starting the engine's stream (a
        stream can cost a start-up: the reference engine's cost model is calibrated when none is cached)."""
        while not stop.requested and len(bypass) < SCORE_BACKLOG:
            item = pull()
            if item is None:
                break
            if not take(item):
                ahead.append(item)
                break
        score()

    def feed() -> Iterator[Request]:
        while (ahead or not stop.requested) and len(bypass) < MAX_BYPASS:
            item = pull()
            if item is None:
                score()
                return
            if take(item):
                if item.requests and len(bypass) >= SCORE_BACKLOG:  # scored rows waiting: let them out
                    return
                continue
            score()
            pending[item.row_id] = [item, [None] * len(item.requests), len(item.requests)]
            for req in item.requests:
                inflight.admit(req)
                yield req

    while True:
        stop.in_engine = True  # off only while our consumer (sink, progress) runs, i.e. around each yield
        try:
            without_engine()
            if ahead:  # a row to decode: the engine's stream, until the rows run out or pile up beside it
                for res in engine.run(feed(), max_in_flight):
                    entry = inflight.finish(res)
                    if entry is not None:
                        entry[1][res.sample_index] = res
                        entry[2] -= 1
                    late = inflight.expire()
                    if (entry is not None and entry[2] == 0) or late:
                        if entry is not None and entry[2] == 0:
                            del pending[res.row_id]
                            late.insert(0, (entry[0], entry[1]))
                        stop.in_engine = False
                        yield from late
                        stop.in_engine = True
                    if bypass:
                        stop.in_engine = False
                        while bypass:
                            yield bypass.popleft()
                        stop.in_engine = True
                score()  # an engine that ended its stream without pulling to the end
        except EngineDied as e:  # the rows it died with: a rerun runs them alone first (``deaths``)
            e.in_flight = list(pending) + [it.row_id for it in scoring]  # scoring rows it died scoring too
            raise
        finally:
            stop.in_engine = False
        while bypass:
            yield bypass.popleft()
        if state["exhausted"] and not ahead or stop.requested:
            return
