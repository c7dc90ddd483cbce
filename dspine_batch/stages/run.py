"""Several stages in one job, on one engine: every stage's rows go through the same scheduler, so the engine's batch
stays full while earlier stages are still running.

Each stage is an ordinary exactly-once output (``OUTDIR/<stage>/``: its manifest, lock, parts, done-set, state),
written by the pipeline's own sink. A stage's rows are built from the *committed* rows of the stage before it:
when a part of stage k commits, the kept rows in it (ok, through ``where`` and ``dedup``) become stage k+1's rows
(``rows.children``) and join the stream at once — no barrier between stages. So a row of stage k+1 never exists
without its committed parent, and a kill -9 anywhere loses nothing: the same command rebuilds every stage's queue
from what is committed (parents whose children are not committed yet) and goes on. Stage 1 is sharded by row id
(``--shard``, Slurm arrays); a lineage stays in its root row's shard.

The stream (``_Feed``) offers the engine the deepest stage's ready rows first (lineages finish, queues stay short),
then the next input row. When nothing is ready while parents are still in flight, the engine drains, every sink
commits (which makes their children ready) and the loop goes again; that happens only at the tail of a job.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow.parquet as pq

from dspine_batch.engines.base import Engine, Result, SamplingParams
from dspine_batch.errors import EXIT_INTERRUPTED, EngineDied, Interrupted, UsageError
from dspine_batch.pipeline.answers import Answers
from dspine_batch.pipeline.config import GenerateConfig
from dspine_batch.pipeline.decisions import DecisionLog
from dspine_batch.pipeline.heap import setup_frozen
from dspine_batch.pipeline.job import RowSelector, ShardState
from dspine_batch.pipeline.keyset import key_hash
from dspine_batch.pipeline.manifest import STAGES_FILE, build_manifest
from dspine_batch.pipeline.mapping import Columns, MapSettings, RowMapper, WorkItem, resolve_columns
from dspine_batch.pipeline.outputs import arrow_path, committed_parts, open_output
from dspine_batch.pipeline.preflight import (
    Job,
    check_job_structure,
    check_previous_run,
    job_defaults,
    load_engine,
    log,
    wants_chat,
)
from dspine_batch.pipeline.requests import job_request
from dspine_batch.pipeline.rerun import run_fields
from dspine_batch.pipeline.scheduler import schedule
from dspine_batch.pipeline.schema import output_schema
from dspine_batch.pipeline.shard import attempt_from_env, parse_shard, shard_tag
from dspine_batch.pipeline.shutdown import Shutdown
from dspine_batch.pipeline.sink import PartSink
from dspine_batch.pipeline.sources import InputFile, arrow_schema, iter_inputs, peek_rows, resolve_inputs
from dspine_batch.stages.claims import NEAR_SPACE, Claims
from dspine_batch.stages.rerun import ended, nothing_left
from dspine_batch.stages.rows import (
    LINEAGE_FIELDS,
    LINEAGE_TYPES,
    Judge,
    Parent,
    carried,
    children,
    committed_parents,
)
from dspine_batch.stages.spec import StageSpec, parse_stages
from dspine_batch.storage.objects import ObjectStore
from dspine_batch.storage.urls import is_url


class FirstStageMapper(RowMapper):
    """The first stage's mapper: each input row starts its lineage (its own id as the root, its columns as the
    context the later stages see)."""

    def build(self, row_id: str, file: InputFile, index: int, row: Any, id_problem: str | None,
              row_hash: int = 0) -> WorkItem:
        if isinstance(row, dict):
            row = carried(row, row_id, {}, row)
        return super().build(row_id, file, index, row, id_problem, row_hash)


class StageSink(PartSink):
    """The pipeline's sink, telling the stage runner which rows each committed part holds."""

    on_part: Any = None

    flush: Any = None  # an object store's: the part's record created before its rows feed the next stage

    def commit(self) -> bool:
        owners, results = self.owners, self.results
        wrote = super().commit()
        if wrote and self.on_part is not None:
            if self.flush is not None:  # a child must never be made from a parent row that is not committed
                self.flush()
            self.on_part(owners, results)
        return wrote


@dataclass
class Stage:
    """One stage's run: its checked settings, output, mapper, sink, and the rows ready for the engine."""

    spec: StageSpec
    job: Job
    lock: Any  # the output's: a local ``resume.Lock`` or an object store's lease
    mapper: RowMapper | None = None
    sink: StageSink | None = None
    state: ShardState | None = None
    judge: Judge | None = None
    answers: Answers | None = None
    file: InputFile | None = None
    decisions: DecisionLog | None = None  # the engine's record, with the stage's state (``pipeline.decisions``)
    done: Any = None
    fingerprint: str = ""
    ready: deque[WorkItem] = field(default_factory=deque)
    made: int = 0  # rows made from parents (stages after the first)
    committed_before: int = 0


def run_stages(cfg: GenerateConfig, raw: Any) -> int:
    """``generate`` with ``[[stages]]``: the whole job, every stage resumed where it stopped."""
    outdir = cfg.output.rstrip("/") if is_url(cfg.output) else os.path.abspath(cfg.output)
    cfg.inputs = [p if is_url(p) else os.path.abspath(p) for p in cfg.inputs]
    specs = parse_stages(raw, cfg, outdir)
    shard = parse_shard(cfg.shard)
    tag = shard_tag(*shard)
    files = resolve_inputs(cfg.inputs, cfg.split)
    first = specs[0]
    names = _input_names(files)
    columns = resolve_columns(files, cfg.prompt_column if first.templates is None else None,
                              cfg.messages_column if first.templates is None else None, cfg.id_column,
                              [n for n in names if n not in LINEAGE_FIELDS], cfg.row_params, first.templates)
    stages: list[Stage] = []
    for spec in specs:
        try:
            request = job_request(spec.cfg.as_dict())
        except UsageError as e:
            raise UsageError(f"stage {spec.name!r}: {e}") from e
        if spec.index == 0:
            cols, stage_files = columns, files
        else:
            cols = Columns(None, None, None, (), (), (), spec.templates)
            stage_files = []
        cols = replace(cols, keep=cols.keep + LINEAGE_FIELDS, keep_types=cols.keep_types + LINEAGE_TYPES)
        out = open_output(spec.cfg.output)  # an object store that cannot create-if-absent: refused here
        job = Job(spec.cfg, stage_files, cols, out.display, shard, tag, request, out=out)
        try:
            check_job_structure(job)
        except UsageError as e:
            raise UsageError(f"stage {spec.name!r}: {e}") from e
        stages.append(Stage(spec, job, out.lock(tag)))
    _write_stages(outdir, specs)
    shutdown = Shutdown(cfg.grace_seconds)
    held: list[Any] = []
    try:
        for st in stages:
            st.job.output.prepare()
            st.lock.acquire()
            held.append(st.lock)
            check_previous_run(st.job)
            st.job.output.recover()
        shutdown.install()
        log(f"{len(stages)} stages ({' -> '.join(s.spec.name for s in stages)}); output -> {outdir}/<stage>")
        if (rc := nothing_left(stages, files, columns, log)) is not None:  # a finished job's rerun: no model
            return rc
        segments = _segments(stages)
        for n, seg in enumerate(segments):
            names = ", ".join(s.spec.name for s in seg)
            engine = load_engine(seg[0].job.cfg, ", once for every stage" if len(segments) == 1 else
                                 f", once for stage(s) {names}: model {n + 1} of {len(segments)}")
            try:
                rc = _run(stages, seg, engine, shutdown, columns)
            finally:
                for st in seg:  # what the engine said of its sources, kept: a closed engine's word is not its run's
                    if st.decisions is not None:
                        st.decisions.freeze()
                engine.close()  # before the next model loads: two models rarely fit one machine's memory
            if rc is not None:
                return rc
        return _finish(stages)
    except Interrupted:
        log("interrupted before work started; run the same command again")
        return EXIT_INTERRUPTED
    finally:
        for lock in held:
            lock.release()
        shutdown.restore()


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


def _write_stages(outdir: str, specs: list[StageSpec]) -> None:
    """``OUTDIR/_stages.json``: the stages in order (what `status`/`report` and readers look for)."""
    body = json.dumps({"stages": [s.name for s in specs], "final": specs[-1].name}, indent=2)
    if is_url(outdir):
        ObjectStore(outdir).put(STAGES_FILE, body.encode())  # the same on every start: a plain overwrite is safe
        return
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, STAGES_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(body)
    os.replace(tmp, path)


def _open(st: Stage, engine: Engine, parent: Stage | None) -> None:
    """The stage's output checked or created (its fingerprint: its settings, template and stage rules, and for a
    later stage the fingerprint of the stage it reads), done-set loaded, mapper and sink made."""
    job, cfg, tokenizer = st.job, st.job.cfg, engine.tokenizer
    use_chat = wants_chat(cfg, job.columns, tokenizer)
    fields = run_fields(cfg, job.files, job.columns, use_chat, job.request) | {"engine": engine.identity(),
                                                                               "stage": st.spec.identity()}
    if parent is not None:
        fields["inputs"] = {"stage": parent.spec.name, "fingerprint": parent.fingerprint}
    schema = output_schema(job.columns.keep_schema(), cfg.save_token_ids)
    manifest = job.output.create_or_check(build_manifest(fields, cfg.as_dict(), job.shard[1], schema.names))
    st.fingerprint = manifest["fingerprint"]
    schema = schema.with_metadata({"dspine_batch.pipeline.manifest": json.dumps({"fingerprint": st.fingerprint,
                                                                                "stage": st.spec.name})})
    job.output.remove_staging(job.tag)
    st.done = job.output.load_done(job.tag, id_column=True, on_damaged=cfg.on_damaged_part, report=log)
    st.committed_before = st.done.rows
    defaults = job_defaults(job, SamplingParams(cfg.max_new_tokens, float(cfg.temperature), float(cfg.top_p),
                                                max(cfg.top_k, 0), cfg.seed, tokenizer.stop_token_ids(cfg.stop),
                                                tuple(cfg.stop)))
    features = frozenset(getattr(engine, "features", ()))
    settings = MapSettings(job.columns, defaults, cfg.system_prompt, use_chat, engine.name, features)
    kind = RowMapper if parent is not None else FirstStageMapper
    st.mapper = kind(settings, tokenizer, engine.max_context, job.structures, warn=log)
    st.state = ShardState(job.outdir, job.tag, out=job.output)
    st.state.start(job.shard, st.fingerprint, st.done)
    # the engine's record of its proposal sources, with each stage's state: its reasons are every stage's (one
    # engine), its counts the engine's; ``report`` shows each stage's own counts from its parts
    st.decisions = DecisionLog(engine, st.state.fields.get("decisions"), log)
    st.state.decisions = st.decisions.record
    st.sink = StageSink(job.outdir, schema, job.tag, st.done.next_seq, cfg.num_samples,
                        cfg.commit_rows or job.output.commit_rows, cfg.commit_seconds, attempt_from_env(),
                        st.state.save, commit=job.output.commit_part)
    if job.output.remote:
        st.sink.flush = job.output.flush
    st.judge = Judge(st.spec, _committed_keys(st) if st.spec.dedup == "exact" else set())
    if st.spec.dedup == "minhash":  # the band index lives in claims (``near``): shared, and not in memory
        st.judge.claims, st.judge.shard = Claims(job.output, NEAR_SPACE), job.tag
    elif st.spec.dedup is not None and job.shard[1] > 1:  # other shards keep rows this one cannot see: claims
        st.judge.claims, st.judge.shard = Claims(job.output), job.tag
    st.answers = Answers(tokenizer, cfg.reasoning_parser, cfg.tool_call_parser, log)
    st.file = InputFile(job.outdir if parent is None else parent.job.outdir,
                        f"stage {parent.spec.name}" if parent else "input", "jsonl")
    if st.done.rows:
        log(f"stage {st.spec.name}: resuming, {st.done.rows:,} rows already committed")


def _part_paths(st: Stage) -> list[str]:
    """This shard's committed parts of a stage in commit order: paths, or URLs on an object store."""
    return [p.path for p in committed_parts(st.job.outdir) if p.shard == st.job.tag]


def _committed_keys(st: Stage) -> set[str]:
    """The dedup keys of a stage's committed kept rows (the set a resume starts from)."""
    keys: set[str] = set()
    for path in _part_paths(st):
        t = pq.read_table(**arrow_path(path), columns=["kept", "dedup_key"])
        for kept, key in zip(t.column("kept").to_pylist(), t.column("dedup_key").to_pylist(), strict=True):
            if kept and key:
                keys.add(key)
    return keys


def _parents(st: Stage, owners: list[WorkItem], results: list[Result]) -> Iterator[Parent]:
    """The kept rows of a committed part of ``st``, as parents of the next stage."""
    names = st.sink.keep_names
    samples = st.job.cfg.num_samples
    for item, r in zip(owners, results, strict=True):
        if item.keep is None:
            continue
        v = dict(zip(names, item.keep, strict=True))
        if not v.get("kept") or r.error is not None or r.text is None:
            continue
        kind = item.requests[0].params.structure.kind if item.requests and item.requests[0].params.structure \
            else None
        yield Parent(item.row_id, r.sample_index, samples, r.text, kind,
                     v["root_id"] or item.row_id, json.loads(v["lineage"] or "{}"), json.loads(v["context"] or "{}"))


def _committed_parents(st: Stage) -> Iterator[Parent]:
    """Every kept row ``st`` has committed in this shard (a resume's parents), part by part in commit order."""
    return committed_parents(_part_paths(st), st.job.cfg.num_samples)


def _offer(child: Stage, parent: Stage, parents: Iterator[Parent]) -> None:
    """Make ``child``'s rows from ``parents`` (skipping those already committed) and queue them."""
    for p in parents:
        for cid, row in children(p, parent.spec.name, child.spec):
            h = key_hash(cid)
            if h in child.done.keys:
                continue
            child.done.keys.add(h)  # queued: never made twice in this run (a part's rows are offered once)
            child.ready.append(child.mapper.build(cid, child.file, child.made, row, None, h))
            child.made += 1


class _Feed:
    """The one stream of rows the engine sees: ready rows of the deepest stage first, then the next input row.
    Stage k's rows travel under an internal id (``k:id``: ids repeat across stages) restored before the sink."""

    def __init__(self, stages: list[Stage], first: Iterator[WorkItem]):
        self.stages, self.first, self.exhausted = stages, first, False

    def items(self) -> Iterator[WorkItem]:
        while True:
            st = next((s for s in reversed(self.stages) if s.ready), None)
            if st is not None:
                yield _tagged(st.spec.index, st.ready.popleft())
                continue
            if self.exhausted:
                return
            try:
                item = next(self.first)
            except StopIteration:
                self.exhausted = True
                return
            yield _tagged(0, item)


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


def _engine_key(cfg: GenerateConfig) -> tuple[Any, ...]:
    return cfg.engine, cfg.model, cfg.draft, tuple(sorted(cfg.engine_args.items()))


def _segments(stages: list[Stage]) -> list[list[Stage]]:
    """Runs of consecutive stages on the same engine (engine, model, draft, engine arguments): one engine each."""
    out: list[list[Stage]] = []
    for st in stages:
        if out and _engine_key(out[-1][-1].job.cfg) == _engine_key(st.job.cfg):
            out[-1].append(st)
        else:
            out.append([st])
    return out


def _run(stages: list[Stage], seg: list[Stage], engine: Engine, shutdown: Shutdown, columns: Columns) -> int | None:
    """The stages of one segment (``_segments``) on their engine, until every row they can make is committed
    (None) or the run stops (its exit code). A segment after the first starts from every kept row its parent
    stage committed: that stage, on the model before, is done."""
    for st in seg:
        _open(st, engine, stages[st.spec.index - 1] if st.spec.index else None)
    for st in seg[:-1]:  # committed parts feed the next stage; a resume rebuilds its queue
        nxt = stages[st.spec.index + 1]
        st.sink.on_part = lambda owners, results, st=st, nxt=nxt: _offer(nxt, st, _parents(st, owners, results))
        _offer(nxt, st, _committed_parents(st))
    first = seg[0]
    if first.spec.index == 0:
        selector = RowSelector(first.mapper, first.job.shard, first.done.keys)
        rows: Iterator[WorkItem] = selector.run(iter_inputs(first.job.files, columns.read_columns(),
                                                            first.job.cfg.limit))
    else:
        _offer(first, stages[first.spec.index - 1], _committed_parents(stages[first.spec.index - 1]))
        rows = iter(())
    feed = _Feed(seg, rows)
    max_in_flight = first.job.cfg.max_in_flight
    try:
        with setup_frozen():
            while True:
                for item, results in schedule(feed.items(), engine, max_in_flight, shutdown):
                    k, item, results = _untagged(item, results)
                    st = stages[k]
                    for answered, rs in st.answers.run(iter([(item, results)])):
                        st.sink.add(st.judge.decide(answered, rs, st.sink.keep_names), rs)
                    if st.sink.due():
                        st.sink.commit()
                    if shutdown.expired:
                        break
                if shutdown.requested:
                    break
                for st in seg:  # commit all: the parents' children become ready
                    st.sink.commit()
                if feed.exhausted and not any(s.ready for s in seg):
                    break
    except Interrupted:
        pass
    except EngineDied as e:
        for st in seg:
            st.sink.commit()
            st.state.save(st.sink.stats, "interrupted")
        log(f"the engine died ({str(e)[:300]}); finished rows of every stage are committed; run the same command "
            "again to resume")
        return EXIT_INTERRUPTED
    for st in seg:
        st.sink.commit()
    if shutdown.requested and not (feed.exhausted and not any(s.ready for s in seg)):
        for st in stages:
            if st.sink is not None:
                st.state.save(st.sink.stats, "interrupted")
        log(f"stopped ({shutdown.reason or 'grace period over'}); every stage's finished rows are committed; run the "
            "same command again to resume")
        return EXIT_INTERRUPTED
    return None


def _finish(stages: list[Stage]) -> int:
    worst = 0.0
    for st in stages:
        done = st.committed_before + st.sink.stats.rows
        errors = st.done.error_rows + st.sink.stats.error_rows
        st.state.save(st.sink.stats, "done", total_rows=done)
        j = st.judge
        extra = "".join([f", {j.filtered:,} filtered" if st.spec.where else "",
                         f", {j.duplicates:,} duplicates" if st.spec.dedup else ""])
        log(f"stage {st.spec.name}: {done:,} rows ({st.sink.stats.rows:,} this run), {errors:,} with errors"
            f"{extra} this run -> {st.job.outdir}")
        worst = max(worst, errors / done if done else 0.0)
    return ended(stages, worst, log)
