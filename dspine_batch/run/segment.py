"""The loop of one segment (consecutive stages on one engine): one scheduler stream feeds the engine (``Feed``:
the deepest stage's ready rows first, then the next input row), every finished row goes through its stage's answer
parsing, rules, error log, --on-error and sink, and around it, for every stage alike, the in-flight record, the
watchdog and --request-timeout, engine-death isolation (``deaths``) and SIGTERM grace (``Segment``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from dspine_batch.engines.base import Engine, Result
from dspine_batch.engines.decisions import DecisionLog
from dspine_batch.errors import (
    EXIT_INTERRUPTED,
    DiskFull,
    EngineDied,
    FatalError,
    Interrupted,
)
from dspine_batch.inputs.rowrecord import RowRecorder
from dspine_batch.inputs.sources import iter_inputs
from dspine_batch.inputs.totals import ReadPosition
from dspine_batch.log import log
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.run import deaths
from dspine_batch.run.heap import setup_frozen
from dspine_batch.run.progress import Progress
from dspine_batch.run.scheduler import schedule
from dspine_batch.run.selector import RowSelector, seek_starts
from dspine_batch.run.stage import (
    Run,
    Stage,
    committed_parents_of,
    offer,
    open_stage,
    parents_of,
    select_rows,
    stage_log,
)
from dspine_batch.run.state import first_token_s
from dspine_batch.run.watchdog import InFlight, Watchdog
from dspine_batch.stages.score import fill


# -- the loop ---------------------------------------------------------------------------------------------------
class Feed:
    """The one stream of rows the engine sees: ready rows of the deepest stage first, then the next input row.
    With several stages on one engine, stage k's rows travel under an internal id (``k:id``: ids repeat across
    stages) restored before the sink; a segment of one stage sends its rows as they are."""

    def __init__(self, stages: list[Stage], first: Iterator[WorkItem], tagged: bool):
        self.stages, self.first, self.exhausted, self.tagged = stages, first, False, tagged

    def items(self) -> Iterator[WorkItem]:
        while True:
            st = next((s for s in reversed(self.stages) if s.ready), None)
            if st is not None:
                item = st.ready.popleft()
                yield _tagged(st.spec.index, item) if self.tagged else item
                continue
            if self.exhausted:
                return
            try:
                item = next(self.first)
            except StopIteration:
                self.exhausted = True
                return
            yield _tagged(self.stages[0].spec.index, item) if self.tagged else item

    @property
    def idle(self) -> bool:
        return self.exhausted and not any(s.ready for s in self.stages)


def _tagged(k: int, item: WorkItem) -> WorkItem:
    rid = f"{k}:{item.row_id}"
    return replace(item, row_id=rid, requests=[replace(r, row_id=rid) for r in item.requests])


def _untagged(item: WorkItem, results: list[Result] | None) -> tuple[int, WorkItem, list[Result] | None]:
    k, rid = item.row_id.split(":", 1)
    item = replace(item, row_id=rid, requests=[replace(r, row_id=rid) for r in item.requests])
    if results is not None:
        for r in results:
            r.row_id = rid
    return int(k), item, results


class Segment:
    """The stages of one segment (``_segments``) on their engine, until every row they can make is committed
    (``run`` returns None) or the run stops (its exit code). A segment after the first starts from every kept row
    its parent stage committed: that stage, on the model before, is done."""

    def __init__(self, run: Run, seg: list[Stage], engine: Engine):
        self.run_, self.seg, self.engine = run, seg, engine
        self.tagged = len(seg) > 1
        self.failure: str | None = None  # --on-error fail: the first bad row
        first = seg[0].job.cfg
        self.inflight = InFlight(first.request_timeout or None)
        self.decisions: DecisionLog | None = None

    # -- a finished row, whichever stage: parsed, judged, logged, committed --------------------------------------
    def take(self, item: WorkItem, results: list[Result] | None) -> None:
        if self.tagged:
            k, item, results = _untagged(item, results)
            st = self.run_.stages[k]
        else:
            st = self.seg[0]
        assert st.answers is not None and st.sink is not None
        if st.spec.score is not None:
            fill(st.spec.score, results)  # the scores as the row's output (a JSON object)
        st.answers.answer(item, results)
        if st.judge is not None:
            item = st.judge.decide(item, results, st.sink.keep_names)
        error = item.error or next((r.error for r in results or () if r.error), None)
        if error:
            if st.job.cfg.on_error == "fail":
                self.failure = self.failure or error
                self.run_.shutdown.request("--on-error fail")
                return
            st.errors.note(item.row_id, error)
        st.sink.add(item, results)
        if st.spec.index == 0 and self.run_.progress is not None:
            self.run_.progress.tick()
        if st.sink.due():
            st.sink.commit()

    def select_groups(self) -> bool:
        """The first select step of the segment not decided yet in this start: its groups decided and its rows
        committed (their children then ready); False when none is left. Called when nothing else is left to run:
        every stage before it is finished in this shard, so its groups are whole (``stages.select``)."""
        st = next((s for s in self.seg if s.spec.select is not None and not s.select_done), None)
        if st is None:
            return False
        assert st.sink is not None and st.done is not None
        st.select_done = True
        for item, results in select_rows(st, self.run_.stages[st.spec.index - 1]):
            self.take(_tagged(st.spec.index, item) if self.tagged else item, results)
            st.done.keys.add(item.row_hash)
        st.sink.commit()
        return True

    def stream(self, items: Iterator[WorkItem], max_in_flight: int) -> None:
        assert self.decisions is not None
        shutdown = self.run_.shutdown
        for item, results in self.decisions.watch(schedule(items, self.engine, max_in_flight, shutdown,
                                                           self.inflight)):
            self.take(item, results)
            if shutdown.expired:
                break

    def commit_all(self) -> None:
        for st in self.seg:
            assert st.sink is not None
            st.sink.commit()

    # -- the segment ------------------------------------------------------------------------------------------
    def run(self) -> int | None:
        run, seg, engine = self.run_, self.seg, self.engine
        stages, shutdown = run.stages, run.shutdown
        for st in seg:
            open_stage(run, st, engine, stages[st.spec.index - 1] if st.spec.index else None)
        for st in seg:  # the engine's record with each stage's state: its reasons every stage's (one engine), its
            assert st.state is not None  # counts the engine's; ``report`` shows each stage's own counts from its parts
            st.decisions = DecisionLog(engine, st.state.fields.get("decisions"), log)
            st.state.decisions = st.decisions.record
        self.decisions = seg[0].decisions  # says each source's reason once
        self.decisions.note()  # what the settings already decide (e.g. proposers=suffix: the draft never runs)
        for st in seg[:-1]:  # committed parts feed the next stage; a resume rebuilds its queue
            nxt = stages[st.spec.index + 1]
            st.on_part = lambda owners, results, st=st, nxt=nxt: offer(nxt, st, parents_of(st, owners, results))
            offer(nxt, st, committed_parents_of(st))
        first = seg[0]
        if first.spec.index == 0:
            rows = self._first_rows(first)
        else:
            offer(first, stages[first.spec.index - 1], committed_parents_of(stages[first.spec.index - 1]))
            rows = iter(())
        feed = Feed(seg, rows, self.tagged)
        if first.job.cfg.request_timeout and hasattr(engine, "request_timeout"):  # engines that end a request
            engine.request_timeout = first.job.cfg.request_timeout
        watchdog = Watchdog(self.inflight, first.job.cfg.stall_seconds, shutdown, engine, log).start()
        max_in_flight = first.job.cfg.max_in_flight
        interrupted = False
        try:
            with setup_frozen():
                self.isolate()
                while True:
                    self.stream(feed.items(), max_in_flight)
                    if shutdown.requested or shutdown.expired:
                        break
                    self.commit_all()  # the parents' children become ready
                    if feed.idle and not self.select_groups():
                        break
        except Interrupted:
            interrupted = True
        except DiskFull:
            self._stop_on_full_disk()
            raise
        except deaths.RepeatedDeath:
            self.seg[0].state.count("engine_deaths")
            self._stop_with("interrupted")  # the row it died on is committed as an error row
            return EXIT_INTERRUPTED
        except EngineDied as e:
            self._record_death(e)
            self._stop_with("interrupted")
            return EXIT_INTERRUPTED
        except Exception:
            self._stop_with("failed")
            raise
        finally:
            watchdog.stop()
            if run.selector is not None and not run.selector.finished and run.selector.recorder is not None:
                run.selector.recorder.finish(complete=False)
        if watchdog.fired:  # rows past --request-timeout are error rows now, not the next start's stall
            assert first.state is not None
            first.state.count("watchdog_firings")
            for item, results in self.inflight.expire():
                self.take(item, results)
        try:
            self.commit_all()
        except DiskFull:
            self._stop_on_full_disk()
            raise
        if run.progress is not None and first.spec.index == 0:
            run.progress.close()
        for st in seg:  # the engine closes after this segment: its word as it stands is kept for the stages' end
            st.decisions.freeze()
        for line in self.decisions.summary():  # the final record, in the words of `dspine-batch report`
            log(line)
        if (at := first_token_s(engine)) is not None:  # start-up as the user waits for it
            assert first.state is not None
            first.state.fields["first_token_s"] = round(at, 3)
            log(f"first token {at:.1f}s after this process started (Python's start-up, imports, checks and the model "
                "load included; not what ran before it, e.g. a set-up in the same shell command)")
        if self.failure:
            for st in seg:
                st.state.save(st.sink.stats, "failed")
            raise FatalError(f"{self.failure} (--on-error fail; rows before it are committed)")
        if interrupted or (shutdown.requested and not feed.idle):
            for st in stages:
                if st.sink is not None:
                    st.state.save(st.sink.stats, "interrupted",
                                  **({"stalled": watchdog.fired} if watchdog.fired else {}))
                    for line in st.errors.summary():
                        log(line)
            committed = sum(st.sink.stats.rows for st in stages if st.sink is not None)
            log(f"stopped ({shutdown.reason or 'grace period over'}): {committed:,} rows committed this run"
                f"{' (every stage)' if len(stages) > 1 else ''}; run the same command again to resume")
            return EXIT_INTERRUPTED
        return None

    def _first_rows(self, first: Stage) -> Iterator[WorkItem]:
        """The first stage's rows: this shard's input rows not committed yet, in input order."""
        run = self.run_
        assert first.mapper is not None and first.done is not None
        recorder = RowRecorder(first.job.output, run.files, first.job.tag)
        run.selector = RowSelector(first.mapper, run.shard, first.done.keys, position=ReadPosition.of(run.files),
                                   recorder=recorder, marks=first.done.marks)
        sink, selector = first.sink, run.selector
        assert sink is not None
        run.progress = Progress(first.job.cfg.progress, run.total, first.done.rows, first.job.cfg.log_interval,
                                taken=lambda: sink.taken, read=lambda: selector.rows,
                                share=selector.position.share, approx=run.shard[1] > 1)
        starts = seek_starts(first.done.marks, run.files, first.job.cfg.limit, recorder)
        return selector.run(iter_inputs(run.files, run.columns.read_columns(), first.job.cfg.limit, starts=starts))

    # -- engine deaths ---------------------------------------------------------------------------------------
    def isolate(self) -> None:
        """The rows the last engine death left, each run alone and committed before any other row (``deaths``):
        a first stage's from the inputs (read with a mapper of its own: a mapper remembers the ids it has seen),
        a later stage's from its queue."""
        run = self.run_
        for st in self.seg:
            assert st.state is not None and st.done is not None and st.mapper is not None
            death = deaths.Death.of(st.state.fields.get(deaths.STATE_KEY))
            if death is None:
                continue
            if st.spec.index == 0:
                m = st.mapper
                own = type(m)(m.settings, m.tokenizer, m.max_context, m.structures, warn=lambda _: None)
                starts = seek_starts(st.done.marks, run.files, st.job.cfg.limit)
                items: Iterator[WorkItem] = RowSelector(own, run.shard, st.done.keys, marks=st.done.marks).run(
                    iter_inputs(run.files, run.columns.read_columns(), st.job.cfg.limit, starts=starts))
            else:
                suspects = set(death.rows)
                picked = [i for i in st.ready if i.row_id in suspects]
                for i in picked:
                    st.ready.remove(i)
                items = iter(picked)
            deaths.isolate(death, items, lambda item, st=st: self._run_alone(st, item),
                           lambda item, msg, st=st: self._mark_error(st, item, msg),
                           lambda rest, st=st: self._save_death(st, rest), stage_log(st))

    def _run_alone(self, st: Stage, item: WorkItem) -> None:
        assert st.sink is not None and st.done is not None
        self.stream(iter([_tagged(st.spec.index, item) if self.tagged else item]), 1)
        st.sink.commit()
        st.done.keys.add(item.row_hash)

    def _mark_error(self, st: Stage, item: WorkItem, message: str) -> None:
        assert st.sink is not None and st.done is not None
        errored = replace(item, requests=[], error=message, options=None)
        self.take(_tagged(st.spec.index, errored) if self.tagged else errored, None)
        st.sink.commit()
        st.done.keys.add(item.row_hash)

    def _save_death(self, st: Stage, rest: deaths.Death | None) -> None:
        assert st.state is not None and st.sink is not None
        if rest is None:
            st.state.fields.pop(deaths.STATE_KEY, None)
        else:
            st.state.fields[deaths.STATE_KEY] = rest.as_dict()
        st.state.save(st.sink.stats)

    def _record_death(self, e: EngineDied) -> None:
        """Each stage's rows in flight when the engine died, in its own state (the next start runs them alone)."""
        by_stage: dict[int, list[str]] = {st.spec.index: [] for st in self.seg}
        for rid in getattr(e, "in_flight", None) or []:
            k, own = rid.split(":", 1) if self.tagged else (self.seg[0].spec.index, rid)
            by_stage[int(k)].append(own)
        first = self.seg[0].state
        assert first is not None
        first.count("engine_deaths")  # the metrics' count, all starts
        for st in self.seg:
            assert st.state is not None
            if by_stage[st.spec.index] or st is self.seg[0]:  # the first stage counts deaths even with none
                died = deaths.after_death(deaths.Death.of(st.state.fields.get(deaths.STATE_KEY)), e)
                died.rows = by_stage[st.spec.index]
                st.state.fields[deaths.STATE_KEY] = died.as_dict()
        said = deaths.after_death(None, e)
        said.rows = [r for rows in by_stage.values() for r in rows]
        log(deaths.died_line(said))

    # -- stops ------------------------------------------------------------------------------------------------
    def _stop_with(self, outcome: str) -> None:
        """Commit what is finished and record why the run ended (an exception is on its way out)."""
        for st in self.seg:
            assert st.sink is not None and st.state is not None
            st.sink.commit()
            st.state.save(st.sink.stats, outcome)
        if self.run_.progress is not None:
            self.run_.progress.close()

    def _stop_on_full_disk(self) -> None:
        """Record the failure if the disk lets us; no second commit, which would hit the same full disk (what was
        being written was removed; its rows are generated again on resume)."""
        if self.run_.progress is not None:
            self.run_.progress.close()
        for st in self.seg:
            try:
                st.state.save(st.sink.stats, "failed")
            except (DiskFull, OSError):
                pass  # advisory, and the disk is full

