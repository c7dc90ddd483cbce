"""The one runner: every ``generate`` — one stage or many, a local directory or an object store — runs here.

A job is a list of stages (``stages.spec``); a job without ``[[stages]]`` is a list of one whose output is OUTDIR
itself and whose rows carry no lineage columns (``Stage.lineage`` False). Every stage of every job gets the same
start-up, loop and end, so a guarantee built for one holds for all:

**Start-up**, cheapest checks first, nothing loaded: the inputs and their columns, every stage's settings and
structures (one line for anything a stage cannot do); then for every stage its output prepared (a foreign
prefix refused), its lock or lease taken, --overwrite / --resume, and the one recovery (``outdir.recovery``:
journals, interrupted publishes, orphans); only then ``_stages.json`` is written. ``--retry-errors`` takes the
failed rows out of every stage; a rerun with nothing left ends here without loading a model
(``run.precheck``); grammars and free space are checked.

**The loop** (``segment``): consecutive stages on one engine share it, and one scheduler stream feeds it (the
deepest stage's ready rows first, then the next input row: ``segment.Feed``). Each finished row goes through its
stage's answer parsing, rules (``where``, ``dedup``), error log, --on-error and sink; a committed part of stage k
makes stage k+1's rows at once (``rows.children``). Around the loop, for every stage alike: the in-flight record,
the watchdog (--stall-seconds) and --request-timeout (``watchdog``), engine-death isolation (``deaths``), SIGTERM
grace (``shutdown``) and the commit cadence.

**The end**: each stage's line, its error budget (exit 3 over --max-error-rate) and ``_SUCCESS`` for a job of
one shard. Exit codes follow ``errors``: 75 for a stop signal, a stall or an engine death; 1 for a bug.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from typing import Any

from dspine_batch.config import GenerateConfig
from dspine_batch.errors import (
    EXIT_ERROR_BUDGET,
    EXIT_FATAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BatchError,
    Interrupted,
    UsageError,
)
from dspine_batch.inputs.sources import InputFile, arrow_schema, peek_rows, resolve_inputs
from dspine_batch.log import log
from dspine_batch.ops.cost import cost_line, job_cost
from dspine_batch.outdir.manifest import STAGES_FILE
from dspine_batch.outdir.output import open_output
from dspine_batch.outdir.recovery import recover
from dspine_batch.requests.fields import job_request
from dspine_batch.requests.mapping import Columns, resolve_columns
from dspine_batch.requests.templates import job_templates
from dspine_batch.run import metrics, retry
from dspine_batch.run.errorlog import committed_kinds, part_paths, top_kinds
from dspine_batch.run.precheck import Precheck, precheck
from dspine_batch.run.preflight import (
    Job,
    check_free_space,
    check_job_structure,
    check_previous_run,
    check_row_structures,
    load_engine,
    total_rows,
)
from dspine_batch.run.segment import Segment
from dspine_batch.run.shard import parse_shard, shard_tag
from dspine_batch.run.shutdown import Shutdown
from dspine_batch.run.sink import SinkStats
from dspine_batch.run.stage import Run, Stage, run_facts, stage_fields, stage_log
from dspine_batch.run.state import ShardState
from dspine_batch.stages.rows import (
    LINEAGE_FIELDS,
    LINEAGE_TYPES,
)
from dspine_batch.stages.spec import StageSpec, parse_stages, single_stage
from dspine_batch.storage.fs import size as input_size
from dspine_batch.storage.objects import ObjectStore
from dspine_batch.storage.urls import is_url, redact


# -- start-up ---------------------------------------------------------------------------------------------------
def run_job(cfg: GenerateConfig, raw_stages: Any = None) -> int:
    """``generate``: the whole job (``[[stages]]`` in ``raw_stages``, or one stage), every stage resumed where it
    stopped."""
    shard = parse_shard(cfg.shard)
    cfg.inputs = [p if is_url(p) else os.path.abspath(p) for p in cfg.inputs]  # finalize re-reads them
    outdir = cfg.output.rstrip("/") if is_url(cfg.output) else os.path.abspath(cfg.output)
    staged = raw_stages is not None
    if staged:
        refuse_unstaged_flags(cfg)
        specs = parse_stages(raw_stages, cfg, outdir)
    else:
        specs = [single_stage(cfg, job_templates(cfg.prompt_template, cfg.system_template))]
    files = resolve_inputs(cfg.inputs, cfg.split)
    for inp in files:
        if inp.kind in ("jsonl", "openai") and input_size(inp.path) == 0:
            log(f"warning: {inp.name}: empty file (0 rows)")
    first = specs[0]
    if first.templates is not None and first.templates.system is not None and cfg.system_prompt:
        raise UsageError("--system-prompt and --system-template are exclusive: pick one")
    if staged:
        names = [n for n in _input_names(files) if n not in LINEAGE_FIELDS]
        columns = resolve_columns(files, None if first.templates else cfg.prompt_column,
                                  None if first.templates else cfg.messages_column, cfg.id_column, names,
                                  cfg.row_params, first.templates)
    else:  # before the model loads: a typo costs a second, not a minute
        columns = resolve_columns(files, cfg.prompt_column, cfg.messages_column, cfg.id_column, cfg.keep_columns,
                                  cfg.row_params, first.templates)
    tag = shard_tag(*shard)
    stages: list[Stage] = []
    for spec in specs:
        label = f"stage {spec.name!r}: " if spec.lineage else ""
        try:
            request = job_request(spec.cfg.as_dict())
        except UsageError as e:
            raise UsageError(f"{label}{e}") from e
        cols, stage_files = (columns, files) if spec.index == 0 else \
            (Columns(None, None, None, (), (), (), spec.templates), [])
        if spec.lineage:
            cols = replace(cols, keep=cols.keep + LINEAGE_FIELDS, keep_types=cols.keep_types + LINEAGE_TYPES)
        out = open_output(spec.cfg.output)  # an output URL we cannot commit to is refused before inputs are read
        job = Job(spec.cfg, stage_files, cols, out.display, shard, tag, request, out=out)
        try:
            check_job_structure(job)  # a bad --json-schema costs a second, not a model load
        except UsageError as e:
            raise UsageError(f"{label}{e}") from e
        stages.append(Stage(spec, job, out.lock(tag)))
    if staged:
        _check_root(outdir, specs)  # a mistyped -o onto a foreign folder is refused before anything is written
    run = Run(cfg, stages, files, columns, shard, Shutdown(cfg.grace_seconds), outdir)
    exporter = metrics.watch(run, log)  # reads the run's own figures; a push never blocks the loop
    rc: int | None = None
    try:
        rc = _run_stages(run, staged, specs, outdir)
        return rc
    except BatchError as e:
        rc = e.exit_code  # the metrics say how it ended (the CLI prints the line)
        raise
    except Exception:
        rc = EXIT_FATAL
        raise
    finally:
        if exporter is not None:
            exporter.close(rc)


def _run_stages(run: Run, staged: bool, specs: list[StageSpec], outdir: str) -> int:
    """Every stage taken, checked and run, segment by segment; the exit code."""
    cfg, stages, files, columns, shard = run.cfg, run.stages, run.files, run.columns, run.shard
    held: list[Any] = []
    try:
        for st in stages:
            _take_stage(st, held)
        run.owned = True
        run.shutdown.install()
        if staged:
            _write_stages(outdir, specs)  # only now: every stage's prefix checked and held
        run.total = total_rows(files, cfg.limit, shard[1])
        _say_start(run)
        if cfg.retry_errors or cfg.retry_length:
            _prepare_retry(run)
        pre = precheck(stages, files, columns, log)
        if pre.complete:  # a finished job's rerun: no model loaded
            return _nothing_left(run, pre)
        run.pre = pre
        check_row_structures(stages[0].job, check_job_structure(stages[0].job))  # every grammar compiled once
        check_free_space(stages[0].job, run.total)
        segments = _segments(stages)
        for n, seg in enumerate(segments):
            why = "" if not staged else ", once for every stage" if len(segments) == 1 else \
                f", once for stage(s) {', '.join(s.name for s in seg)}: model {n + 1} of {len(segments)}"
            engine = load_engine(seg[0].job.cfg, why)
            try:
                rc = Segment(run, seg, engine).run()
            finally:
                engine.close()  # before the next model loads: two models rarely fit one machine's memory
            if rc is not None:
                return rc
        return _finish(run)
    except Interrupted:
        log("interrupted before work started; run the same command again")
        return EXIT_INTERRUPTED
    finally:
        for lock in reversed(held):
            lock.release()
        run.shutdown.restore()


# flags a job of stages cannot honour as given: refused, never silently ignored
_UNSTAGED = {"keep_columns": "--keep-columns (a job of stages carries every input column forward as its rows' "
                             "context)"}


def refuse_unstaged_flags(cfg: GenerateConfig) -> None:
    """One line before anything loads for a flag that means nothing to a job of stages."""
    for name, what in _UNSTAGED.items():
        if getattr(cfg, name):
            raise UsageError(f"{what}: not for a job of [[stages]]; drop it")


def _take_stage(st: Stage, held: list[Any]) -> None:
    """A stage's output prepared and held, then settled: the one recovery before anything of it is read."""
    out = st.job.output
    out.prepare()
    st.lock.acquire()
    held.append(st.lock)
    check_previous_run(st.job)
    st.discarded = recover(out, [st.job.tag], log).discarded


def _say_start(run: Run) -> None:
    total, shard, files = run.total, run.shard, run.files
    found = f"{len(files)} input file(s)" if total is None else \
        f"{'~' if shard[1] > 1 else ''}{total:,} input rows{' in this shard' if shard[1] > 1 else ''}"
    if len(run.stages) == 1 and not run.stages[0].lineage:
        log(f"{found}; output -> {run.stages[0].job.outdir}")
    else:
        log(f"{found}; {len(run.stages)} stages ({' -> '.join(s.name for s in run.stages)}); output -> "
            f"{run.outdir}/<stage>")


def _prepare_retry(run: Run) -> None:
    """--retry-errors for every stage: the first stage's fixed input lines accepted (or refused, naming what
    changed), every stage's failed rows taken out of its committed parts; a later stage accepts its parent
    stage's new fingerprint (its input is that stage's output, which the retry changed)."""
    for st in run.stages:
        job = st.job
        parent = run.stages[st.spec.index - 1] if st.spec.index else None
        extra = stage_fields(st, parent, parent_fingerprint(parent)) if st.lineage else None
        st.retried = retry.prepare(job.cfg, job.files, job.columns, job.output, job.tag, job.request, stage_log(st),
                                   extra)


def parent_fingerprint(parent: Stage | None) -> str | None:
    """The fingerprint a stage's manifest records for the stage it reads (None for the first stage)."""
    if parent is None:
        return None
    manifest = parent.job.output.read_manifest()
    return manifest["fingerprint"] if manifest else None


def _input_names(files: list[InputFile]) -> list[str]:
    """Every column of the first input that has rows: the first stage carries them all forward (a later stage's
    template may read any of them)."""
    for inp in files:
        schema = arrow_schema(inp)
        names = list(schema.names) if schema is not None else list(dict.fromkeys(k for r in peek_rows(inp)
                                                                                  for k in r))
        if names:
            return names
    return []


# ``_stages.json`` on its way in: another shard of the same array writing it at this moment (a temp name of the
# store's, hidden or not), never a stranger's file
_STAGES_TEMP = re.compile(r"^\.?" + re.escape(STAGES_FILE) + r"\..*\.tmp$")


def _check_root(outdir: str, specs: list[StageSpec]) -> None:
    """A job of stages writes ``OUTDIR/<stage>/`` folders and ``OUTDIR/_stages.json``: OUTDIR must be empty or
    hold only those (a previous start of this job, another shard of it starting at the same moment, or another job
    of stages: its stages then say so)."""
    names = ObjectStore(outdir).names()  # a local directory is one more store (``storage.local``)
    ours = {s.name for s in specs} | {STAGES_FILE, "_SUCCESS", "_report.json"}
    foreign = sorted(n for n in names if n.rstrip("/") not in ours and not _STAGES_TEMP.match(n))
    if foreign and STAGES_FILE not in names:
        raise UsageError(f"{redact(outdir)}: not empty and not a dspine-batch output (found {foreign[0]!r}); "
                         "choose a new -o directory")


def _write_stages(outdir: str, specs: list[StageSpec]) -> None:
    """``OUTDIR/_stages.json``: the stages in order (what `status`/`report` and readers look for); the same on every
    start and every shard, so a plain overwrite is safe."""
    body = json.dumps({"stages": [s.name for s in specs], "final": specs[-1].name}, indent=2)
    ObjectStore(outdir).put(STAGES_FILE, body.encode())


def _engine_key(cfg: GenerateConfig) -> tuple[Any, ...]:
    return cfg.engine, cfg.model, cfg.draft, tuple(sorted(cfg.engine_args.items()))


def _segments(stages: list[Stage]) -> list[list[Stage]]:
    """Runs of consecutive stages on the same engine (engine, model, draft, engine arguments): one engine each. A
    select step runs no model: it joins the segment before it."""
    out: list[list[Stage]] = []
    for st in stages:
        if out and (st.spec.select is not None or _engine_key(out[-1][-1].job.cfg) == _engine_key(st.job.cfg)):
            out[-1].append(st)
        else:
            out.append([st])
    return out


# -- the end ----------------------------------------------------------------------------------------------------
def _finish(run: Run) -> int:
    """Every stage complete: its line, its error budget, and ``_SUCCESS`` for a job of one shard."""
    over = False
    selector = run.selector
    for st in run.stages:
        assert st.state is not None and st.done is not None
        committed, done = st.sink.stats if st.sink is not None else SinkStats(), st.done
        rows = done.rows + committed.rows
        errors = done.error_rows + committed.error_rows
        # committed rows below a watermark were never read (``outdir.watermark``): every other one was read and skipped
        unseen = max(0, done.rows - selector.skipped) if st.spec.index == 0 and selector is not None else 0
        read = selector.rows + unseen if st.spec.index == 0 and selector is not None else rows
        st.state.save(committed, "done", total_rows=read)
        tau = f", tau {committed.tau:.2f}" if committed.tau is not None else ""
        if st.lineage:
            j = st.judge
            extra = "".join([f", {j.unselected:,} not selected" if j and st.spec.select else "",
                             f", {j.filtered:,} filtered" if j and st.spec.where else "",
                             f", {j.duplicates:,} duplicates" if j and st.spec.dedup else ""])
            log(f"stage {st.name}: {rows:,} rows ({committed.rows:,} this run), {errors:,} with errors{extra} this "
                f"run{tau} -> {st.job.outdir}")
        else:
            skipped = selector.skipped + unseen if selector is not None else rows
            log(f"done: {rows:,} rows ({committed.rows:,} this run, {skipped:,} were already committed), "
                f"{errors:,} with errors, {committed.completion_tokens:,} tokens this run{tau} -> {st.job.outdir}")
        for line in st.errors.summary():
            log(line)
        over = _over_budget(st, rows, errors) or over
    if run.cfg.price_per_hour is not None:  # the job's cost: its machine time is the first stage's record
        first = run.stages[0].state
        assert first is not None
        generated = sum(int(st.state.fields["totals"]["completion_tokens"]) for st in run.stages if st.state)
        log(f"cost: {cost_line(job_cost([first.fields], generated))}")
    if over:
        return EXIT_ERROR_BUDGET
    for st in run.stages:
        if st.job.shard[1] == 1:
            st.job.output.write_success()
    return EXIT_OK


def _nothing_left(run: Run, pre: Precheck) -> int:
    """Every row of every stage is committed: finish as a run would, without an engine."""
    if len(run.stages) == 1 and not run.stages[0].lineage:
        shard = f" of shard {run.shard[0]}/{run.shard[1]}" if run.shard[1] > 1 else ""
        log(f"nothing left to do: all {pre.rows:,} input rows{shard} are committed (checked in {pre.seconds:.2f}s); "
            "the model was not loaded")
    else:
        log(f"nothing left to do: every stage's rows are committed (checked in {pre.seconds:.2f}s); no model was "
            "loaded")
    for st in run.stages:
        st.done = pre.done[st.spec.index]
        st.state = ShardState(st.job.outdir, st.job.tag, out=st.job.output)
        st.state.start(st.job.shard, pre.manifests[st.spec.index]["fingerprint"], st.done, run_facts(st.job.cfg))
    return _finish(run)


def _over_budget(st: Stage, rows: int, errors: int) -> bool:
    """A stage's error rate over --max-error-rate, said with its top kinds and what to do."""
    cfg = st.job.cfg
    rate = errors / rows if rows else 0.0
    if rate <= cfg.max_error_rate:
        return False
    counts = st.errors.counts if sum(st.errors.counts.values()) == errors else \
        committed_kinds([] if st.job.output.remote else part_paths(st.job.outdir, st.job.tag))  # earlier starts' too
    where = f"stage {st.name}: " if st.lineage else ""
    log(f"{where}error rate {rate:.1%} ({errors:,} of {rows:,} rows) is over --max-error-rate "
        f"{cfg.max_error_rate:.1%}; top kinds: {top_kinds(counts)}; see `dspine-batch report`, and to generate them "
        "again (after fixing their lines), the same command with --retry-errors")
    return True
