"""``generate``: source -> rows -> scheduler -> engine -> sink, with resume and signals around it.

Each step is a small function or object that takes an iterator and yields (datatrove's ``run(data, ...)``
habit), so ``_stream`` reads as the data flow: input batches -> ``RowSelector`` (this shard's rows not yet
committed, as work items) -> ``schedule`` (bounded in-flight engine work) -> ``stop_on_row_error`` -> the sink.
The sink owns the statistics it writes; progress, the state file and the final summary read them there.

Start-up order is chosen so mistakes fail fast and cheaply: check the inputs and their columns, take the
lock, end here when OUTDIR already holds every row of this run's shard (``rerun``: no engine is loaded for a
no-op rerun), load the engine, check the fingerprint, build the done-set, then stream. The engine's decisions
about its proposal sources (``decisions``) go into the shard's state file at every commit. Exit codes follow ``errors``:
75 only for a stop signal or ``EngineDied``; a bug exits 1 (``cli.main``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dspine_batch import IMPORTED_AT
from dspine_batch.engines.base import STRUCTURE_KINDS, Engine, Result, SamplingParams
from dspine_batch.errors import (
    EXIT_ERROR_BUDGET,
    EXIT_INTERRUPTED,
    EXIT_OK,
    DiskFull,
    EngineDied,
    FatalError,
    Interrupted,
    UsageError,
)
from dspine_batch.pipeline import deaths, retry
from dspine_batch.pipeline.answers import Answers
from dspine_batch.pipeline.config import GenerateConfig
from dspine_batch.pipeline.decisions import DecisionLog
from dspine_batch.pipeline.errorlog import ErrorLog, committed_kinds, part_paths, top_kinds
from dspine_batch.pipeline.heap import setup_frozen
from dspine_batch.pipeline.keyset import KeySet
from dspine_batch.pipeline.manifest import build_manifest
from dspine_batch.pipeline.mapping import MapSettings, RowMapper, WorkItem, resolve_columns
from dspine_batch.pipeline.outputs import LocalOutput, Output, open_output
from dspine_batch.pipeline.preflight import (
    Job,
    check_free_space,
    check_job_structure,
    check_previous_run,
    check_row_structures,
    job_defaults,
    load_engine,
    log,
    total_rows,
    wants_chat,
)
from dspine_batch.pipeline.progress import Progress
from dspine_batch.pipeline.requests import job_request
from dspine_batch.pipeline.rerun import Precheck, precheck, run_fields
from dspine_batch.pipeline.resume import DoneSet
from dspine_batch.pipeline.rowrecord import RowRecorder
from dspine_batch.pipeline.scheduler import schedule
from dspine_batch.pipeline.schema import output_schema
from dspine_batch.pipeline.shard import attempt_from_env, parse_shard, shard_tag
from dspine_batch.pipeline.shutdown import Shutdown
from dspine_batch.pipeline.sink import PartSink, SinkStats
from dspine_batch.pipeline.sources import RowBatch, iter_inputs, resolve_inputs
from dspine_batch.pipeline.templates import job_templates
from dspine_batch.pipeline.totals import ReadPosition
from dspine_batch.pipeline.watchdog import InFlight, Watchdog
from dspine_batch.storage.fs import size as input_size
from dspine_batch.storage.urls import is_url

Finished = tuple[WorkItem, list[Result] | None]


# -- steps ------------------------------------------------------------------------------------------------------
@dataclass
class RowSelector:
    """Input batches -> work items for the rows of this shard that are not committed yet, in input order.
    Counts what it read, so the end of a run knows whether every input row was seen."""

    mapper: RowMapper
    shard: tuple[int, int]
    done: KeySet
    rows: int = 0  # rows of this shard read from the inputs
    skipped: int = 0  # of which already committed
    finished: bool = False
    position: ReadPosition = field(default_factory=ReadPosition)  # how far into the inputs' bytes (progress)
    recorder: RowRecorder | None = None  # each JSON Lines row's line and id, for --retry-errors (``rowrecord``)

    def run(self, batches: Iterator[RowBatch]) -> Iterator[WorkItem]:
        index, count = self.shard
        check_done = len(self.done) > 0
        for batch in batches:
            self.position.see(batch)
            ids, problems, hashes = self.mapper.assign_ids(batch)
            if self.recorder is not None:
                self.recorder.see(batch, hashes)
            mask = (hashes % np.uint64(count)) == np.uint64(index) if count > 1 else None
            mine = len(ids) if mask is None else int(mask.sum())
            if check_done:
                todo = ~self.done.contains_many(hashes)
                mask = todo if mask is None else mask & todo
            picks = range(len(ids)) if mask is None else np.flatnonzero(mask).tolist()
            self.rows += mine
            self.skipped += mine - len(picks)
            if not picks:
                continue
            rows = batch.rows_at(list(picks))
            for k, row in zip(picks, rows, strict=True):
                yield self.mapper.build(ids[k], batch.file, batch.indices[k], row, problems[k], int(hashes[k]))
        self.finished = True
        if self.recorder is not None:
            self.recorder.finish(complete=True)


@dataclass
class StopOnRowError:
    """``--on-error fail``: the first bad row stops admission; rows already in flight still finish."""

    shutdown: Shutdown
    failure: str | None = None

    def run(self, finished: Iterator[Finished]) -> Iterator[Finished]:
        for item, results in finished:
            error = item.error or next((r.error for r in results or () if r.error), None)
            if error:
                self.failure = self.failure or error
                self.shutdown.request("--on-error fail")
                continue
            yield item, results


def write_rows(finished: Iterator[Finished], sink: PartSink, progress: Progress, shutdown: Shutdown) -> None:
    """The last step: every finished row into the sink, commits when due, a progress tick per row."""
    for item, results in finished:
        sink.add(item, results)
        progress.tick()
        if sink.due():
            sink.commit()
        if shutdown.expired:
            break


# -- the run ----------------------------------------------------------------------------------------------------
@dataclass
class ShardState:
    """The advisory ``_dspine/state-<shard>.json`` that ``status`` reads (the truth is in the parts)."""

    outdir: str
    tag: str
    fields: dict[str, Any] = field(default_factory=dict)
    before: DoneSet | None = None
    decisions: Callable[[], dict[str, Any] | None] | None = None  # the engine's record (``decisions.DecisionLog``)
    out: Output | None = None  # where the state file lives (None: the local directory ``outdir``)

    def _out(self) -> Output:
        return self.out if self.out is not None else LocalOutput(self.outdir)

    def start(self, shard: tuple[int, int], fingerprint: str, done: DoneSet) -> None:
        prev = self._out().read_state(self.tag)
        attempt = attempt_from_env()
        self.before = done
        self.fields = {"shard": f"{shard[0]}/{shard[1]}", "fingerprint": fingerprint, "state": "running",
                       "pid": os.getpid(), "attempt": attempt, "starts": int(prev.get("starts", 0)) + 1,
                       "started_at": time.time(), "elapsed_before_s": float(prev.get("elapsed_s", 0.0)),
                       "rows_before": done.rows, "error_rows_before": done.error_rows}
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

    def save(self, committed: SinkStats, state: str | None = None, **extra: Any) -> None:
        f, before = self.fields, self.before
        assert before is not None
        f.update(rows_done=before.rows + committed.rows, error_rows=before.error_rows + committed.error_rows,
                 parts=committed.parts, last_commit_at=committed.last_commit,
                 completion_tokens_this_run=committed.completion_tokens,
                 elapsed_s=f["elapsed_before_s"] + time.time() - f["started_at"], **extra)
        if state:
            f["state"] = state
        record = self.decisions() if self.decisions else None
        if record is not None:
            f["decisions"] = record
        self._out().write_state(self.tag, f)


def generate(cfg: GenerateConfig) -> int:
    shard = parse_shard(cfg.shard)
    cfg.inputs = [p if is_url(p) else os.path.abspath(p) for p in cfg.inputs]  # finalize re-reads them
    out = open_output(cfg.output)  # an output URL we cannot commit to is refused before inputs are read
    files = resolve_inputs(cfg.inputs, cfg.split)
    for inp in files:
        if inp.kind in ("jsonl", "openai") and input_size(inp.path) == 0:
            log(f"warning: {inp.name}: empty file (0 rows)")
    templates = job_templates(cfg.prompt_template, cfg.system_template)
    if templates is not None and templates.system is not None and cfg.system_prompt:
        raise UsageError("--system-prompt and --system-template are exclusive: pick one")
    columns = resolve_columns(files, cfg.prompt_column, cfg.messages_column, cfg.id_column, cfg.keep_columns,
                              cfg.row_params, templates)  # before the model loads: a typo costs a second, not a minute
    job = Job(cfg, files, columns, out.display, shard, shard_tag(*shard), job_request(cfg.as_dict()), out=out)
    base = check_job_structure(job)  # a bad --json-schema costs a second, not a model load
    out.prepare()
    shutdown, lock = Shutdown(cfg.grace_seconds), out.lock(job.tag)
    try:
        lock.acquire()
        if getattr(lock, "took_over", None):
            log(f"shard {job.tag}: took over the expired lease of {lock.took_over.get('holder', 'a dead worker')}")
        shutdown.install()
        check_previous_run(job)
        out.recover()  # a crashed `finalize --compact` must not leave duplicates behind
        total = total_rows(files, cfg.limit, shard[1])
        found = f"{len(files)} input file(s)" if total is None else \
            f"{'~' if shard[1] > 1 else ''}{total:,} input rows{' in this shard' if shard[1] > 1 else ''}"
        log(f"{found}; output -> {job.outdir}")
        if (said := out.recover_retry(job.tag)) is not None:  # a crashed retry
            log(f"--retry-errors interrupted: {said}")
        if cfg.retry_errors or cfg.retry_length:
            retry.prepare(cfg, files, columns, out, job.tag, job.request, log)
        pre = precheck(cfg, files, columns, out, shard, job.tag, log, job.request)
        if pre is not None and pre.missing == 0:
            return _nothing_left(job, pre)
        check_row_structures(job, base)  # every distinct grammar compiled once, before the model loads
        check_free_space(job, total)
        engine = load_engine(cfg)
        try:
            return _run(job, engine, shutdown, total, pre)
        finally:
            engine.close()
    except Interrupted:
        log("interrupted before work started; run the same command again")
        return EXIT_INTERRUPTED
    finally:
        lock.release()
        shutdown.restore()


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


def _open_output(job: Job, engine: Engine, use_chat: bool,
                 pre: Precheck | None) -> tuple[Any, dict[str, Any], DoneSet]:
    """Create or check the manifest (refusing a different run), drop staging leftovers, load the done-set (or
    take the one ``precheck`` loaded before the engine)."""
    cfg, columns, out = job.cfg, job.columns, job.output
    schema = output_schema(columns.keep_schema(), cfg.save_token_ids)
    fields = run_fields(cfg, job.files, columns, use_chat, job.request) | {"engine": engine.identity()}
    manifest = out.create_or_check(build_manifest(fields, cfg.as_dict(), job.shard[1], schema.names))
    schema = schema.with_metadata({"dspine_batch.pipeline.manifest": _manifest_meta(manifest)})
    if pre is not None:
        removed, done, seconds = pre.removed, pre.done, pre.seconds
    else:
        removed = out.remove_staging(job.tag)
        t0 = time.monotonic()
        done = out.load_done(job.tag, id_column=columns.id is not None, on_damaged=cfg.on_damaged_part,
                             report=log)
        seconds = time.monotonic() - t0
    if done.rows or removed or done.damaged:
        damaged = f"; {done.damaged} damaged part(s) moved aside, their rows are generated again" \
            if done.damaged else ""
        log(f"resuming: {done.rows:,} rows already committed in {done.next_seq} parts, checked "
            f"({seconds:.2f}s); {removed} unfinished staging file(s) discarded{damaged}")
    return schema, manifest, done


def _run(job: Job, engine: Engine, shutdown: Shutdown, total: int | None, pre: Precheck | None) -> int:
    cfg, outdir, tokenizer = job.cfg, job.outdir, engine.tokenizer
    use_chat = wants_chat(cfg, job.columns, tokenizer)
    schema, manifest, done = _open_output(job, engine, use_chat, pre)
    defaults = job_defaults(job, SamplingParams(cfg.max_new_tokens, float(cfg.temperature), float(cfg.top_p),
                                                max(cfg.top_k, 0), cfg.seed, tokenizer.stop_token_ids(cfg.stop),
                                                tuple(cfg.stop)))
    features = frozenset(getattr(engine, "features", ()))
    for feature in defaults.params.features():
        if feature not in features:
            what = "structure" if feature in STRUCTURE_KINDS else feature
            raise UsageError(f"{defaults.labels.get(what, what)}: not supported by the {engine.name} engine yet")
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab and defaults.params.logit_bias and defaults.params.logit_bias[-1][0] >= vocab:
        raise UsageError(f"--logit-bias: token id {defaults.params.logit_bias[-1][0]} is not in the model's "
                         f"vocabulary ({vocab} tokens)")
    if not use_chat and (defaults.options.tools is not None or defaults.options.template_kwargs):
        raise UsageError("--tools / --chat-template-kwargs need a chat template (not --raw)")
    settings = MapSettings(job.columns, defaults, cfg.system_prompt, use_chat, engine.name, features)
    mapper = RowMapper(settings, tokenizer, engine.max_context, job.structures, warn=log)
    state = ShardState(outdir, job.tag, out=job.output)
    state.start(job.shard, manifest["fingerprint"], done)
    decisions = DecisionLog(engine, state.fields.get("decisions"), log)
    state.decisions = decisions.record
    decisions.note()  # what the settings already decide (e.g. proposers=suffix: the draft never runs)
    sink = PartSink(outdir, schema, job.tag, done.next_seq, cfg.num_samples,
                    cfg.commit_rows or job.output.commit_rows, cfg.commit_seconds, attempt_from_env(), state.save,
                    commit=job.output.commit_part)
    selector = RowSelector(mapper, job.shard, done.keys, position=ReadPosition.of(job.files),
                           recorder=None if job.output.remote else RowRecorder(outdir, job.files, job.tag))
    progress = Progress(cfg.progress, total, done.rows, cfg.log_interval, taken=lambda: sink.taken,
                        read=lambda: selector.rows, share=selector.position.share, approx=job.shard[1] > 1)
    fail_fast = StopOnRowError(shutdown)
    errors = ErrorLog(log)
    inflight = InFlight(cfg.request_timeout or None)
    if cfg.request_timeout and hasattr(engine, "request_timeout"):  # engines that can end a request themselves
        engine.request_timeout = cfg.request_timeout
    watchdog = Watchdog(inflight, cfg.stall_seconds, shutdown, engine, log).start()
    interrupted = False
    death = deaths.Death.of(state.fields.get(deaths.STATE_KEY))
    try:
        with setup_frozen():
            if death is not None:
                _isolate(job, engine, death, mapper, done.keys, state, sink, progress, shutdown, decisions,
                         fail_fast, errors, inflight)
            _stream(job, engine, selector.run(iter_inputs(job.files, job.columns.read_columns(), job.cfg.limit)),
                    fail_fast, sink, progress, shutdown, decisions, job.cfg.max_in_flight, errors, inflight)
    except Interrupted:
        interrupted = True
    except DiskFull:
        _stop_on_full_disk(state, sink, progress)
        raise
    except deaths.RepeatedDeath:
        _stop_with(sink, state, progress, "interrupted")  # the row it died on is committed as an error row
        return EXIT_INTERRUPTED
    except EngineDied as e:
        died = deaths.after_death(death, e)
        state.fields[deaths.STATE_KEY] = died.as_dict()
        _stop_with(sink, state, progress, "interrupted")
        log(deaths.died_line(died))
        return EXIT_INTERRUPTED
    except Exception:
        _stop_with(sink, state, progress, "failed")
        raise
    finally:
        watchdog.stop()
        if not selector.finished and selector.recorder is not None:
            selector.recorder.finish(complete=False)
    if watchdog.fired:  # rows past --request-timeout are error rows now, not the next start's stall
        for item, results in inflight.expire():
            errors.note(item.row_id, next(r.error for r in results if r.error))
            sink.add(item, results)
    try:
        sink.commit()
    except DiskFull:
        _stop_on_full_disk(state, sink, progress)
        raise
    progress.close()
    for line in decisions.summary():  # the final record, in the words of `dspine-batch report`
        log(line)
    if (first := first_token_s(engine)) is not None:  # start-up as the user waits for it: published, in the
        state.fields["first_token_s"] = round(first, 3)  # state (``report``) and here
        log(f"first token {first:.1f}s after this process started (Python's start-up, imports, checks and the model "
            "load included; not what ran before it, e.g. a set-up in the same shell command)")
    if fail_fast.failure:
        state.save(sink.stats, "failed")
        raise FatalError(f"{fail_fast.failure} (--on-error fail; rows before it are committed)")
    if interrupted or (shutdown.requested and not selector.finished):
        state.save(sink.stats, "interrupted", **({"stalled": watchdog.fired} if watchdog.fired else {}))
        for line in errors.summary():
            log(line)
        log(f"stopped ({shutdown.reason or 'grace period over'}): {sink.stats.rows:,} rows committed this run; "
            "run the same command again to resume")
        return EXIT_INTERRUPTED
    return _finish(job, done, sink.stats, selector.rows, selector.skipped, state, errors)


def _stream(job: Job, engine: Engine, items: Iterator[WorkItem], fail_fast: StopOnRowError, sink: PartSink,
            progress: Progress, shutdown: Shutdown, decisions: DecisionLog, max_in_flight: int,
            errors: ErrorLog | None = None, inflight: InFlight | None = None) -> None:
    finished = decisions.watch(schedule(items, engine, max_in_flight, shutdown, inflight))
    finished = Answers(engine.tokenizer, job.cfg.reasoning_parser, job.cfg.tool_call_parser, log).run(finished)
    if job.cfg.on_error == "fail":
        finished = fail_fast.run(finished)
    write_rows(errors.run(finished) if errors is not None else finished, sink, progress, shutdown)


def _isolate(job: Job, engine: Engine, death: deaths.Death, mapper: RowMapper, done: KeySet, state: ShardState,
             sink: PartSink, progress: Progress, shutdown: Shutdown, decisions: DecisionLog,
             fail_fast: StopOnRowError, errors: ErrorLog, inflight: InFlight) -> None:
    """The rows the last engine death left, each run alone and committed before any other row (``deaths``); each
    one committed joins ``done`` so the run's own pass skips it. The inputs are read with a mapper of its own
    (a mapper remembers the ids it has seen: a second reading would find every id a duplicate). A row run alone
    is under the same --request-timeout, watchdog record and error log as the run's own rows."""
    def run_alone(item: WorkItem) -> None:
        _stream(job, engine, iter([item]), fail_fast, sink, progress, shutdown, decisions, 1, errors, inflight)
        sink.commit()
        done.add(item.row_hash)

    def mark_error(item: WorkItem, message: str) -> None:
        sink.add(replace(item, requests=[], error=message, options=None), None)
        progress.tick()
        sink.commit()
        done.add(item.row_hash)

    def save(rest: deaths.Death | None) -> None:
        if rest is None:
            state.fields.pop(deaths.STATE_KEY, None)
        else:
            state.fields[deaths.STATE_KEY] = rest.as_dict()
        state.save(sink.stats)

    own = RowMapper(mapper.settings, mapper.tokenizer, mapper.max_context, mapper.structures, warn=lambda m: None)
    rows = RowSelector(own, job.shard, done).run(iter_inputs(job.files, job.columns.read_columns(), job.cfg.limit))
    deaths.isolate(death, rows, run_alone, mark_error, save, log)


def _stop_with(sink: PartSink, state: ShardState, progress: Progress, outcome: str) -> None:
    """Commit what is finished and record why the run ended (an exception is on its way out)."""
    sink.commit()
    state.save(sink.stats, outcome)
    progress.close()


def _stop_on_full_disk(state: ShardState, sink: PartSink, progress: Progress) -> None:
    """Record the failure if the disk lets us; no second commit, which would hit the same full disk (what was
    being written was removed; its rows are generated again on resume)."""
    progress.close()
    try:
        state.save(sink.stats, "failed")
    except (DiskFull, OSError):
        pass  # advisory, and the disk is full


def _nothing_left(job: Job, pre: Precheck) -> int:
    """Every input row of the shard is committed: finish as a run would, without an engine."""
    shard = f" of shard {job.shard[0]}/{job.shard[1]}" if job.shard[1] > 1 else ""
    log(f"nothing left to do: all {pre.rows:,} input rows{shard} are committed (checked in {pre.seconds:.2f}s); "
        "the model was not loaded")
    state = ShardState(job.outdir, job.tag, out=job.output)
    state.start(job.shard, pre.manifest["fingerprint"], pre.done)
    return _finish(job, pre.done, SinkStats(), pre.rows, pre.rows, state)


def _finish(job: Job, done: DoneSet, committed: SinkStats, read: int, skipped: int, state: ShardState,
            errlog: ErrorLog | None = None) -> int:
    rows, errors = done.rows + committed.rows, done.error_rows + committed.error_rows
    state.save(committed, "done", total_rows=read)
    tau = f", tau {committed.tau:.2f}" if committed.tau is not None else ""
    log(f"done: {rows:,} rows ({committed.rows:,} this run, {skipped:,} were already committed), "
        f"{errors:,} with errors, {committed.completion_tokens:,} tokens this run{tau} -> {job.outdir}")
    for line in errlog.summary() if errlog else ():
        log(line)
    rate = errors / rows if rows else 0.0
    if rate > job.cfg.max_error_rate:
        counts = errlog.counts if errlog and sum(errlog.counts.values()) == errors else \
            committed_kinds([] if job.output.remote else part_paths(job.outdir, job.tag))  # earlier starts' too
        log(f"error rate {rate:.1%} ({errors:,} of {rows:,} rows) is over --max-error-rate "
            f"{job.cfg.max_error_rate:.1%}; top kinds: {top_kinds(counts)}; see `dspine-batch report`, and to "
            "generate them again (after fixing their lines), the same command with --retry-errors")
        return EXIT_ERROR_BUDGET
    if job.shard[1] == 1:
        job.output.write_success()
    return EXIT_OK


def _manifest_meta(manifest: dict) -> str:
    return json.dumps({k: manifest[k] for k in ("fingerprint", "config", "versions", "num_shards")} |
                      {"engine": manifest["fingerprint_fields"]["engine"]}, default=str)
