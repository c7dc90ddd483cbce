"""One stage of a run as the runner holds it: its checked settings, output and lock (``Stage``), the job around it
(``Run``), its output opened once its engine is loaded (``open_stage``: fingerprint, done-set, mapper, rules, sink),
and its rows made from the committed rows of the stage before it (``offer``: a committed part's kept rows become
the next stage's rows at once, so a child never exists without its committed parent)."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspine_batch.config import GenerateConfig
from dspine_batch.engines.base import STRUCTURE_KINDS, Engine, Result, SamplingParams, can_score
from dspine_batch.engines.decisions import DecisionLog
from dspine_batch.errors import (
    UsageError,
)
from dspine_batch.inputs.sources import InputFile
from dspine_batch.log import log
from dspine_batch.outdir.done import DoneSet
from dspine_batch.outdir.keyset import key_hash, key_hashes
from dspine_batch.outdir.output import committed_parts, read_part
from dspine_batch.outdir.schema import output_schema
from dspine_batch.requests.answers import Answers
from dspine_batch.requests.mapping import Columns, MapSettings, RowMapper, WorkItem
from dspine_batch.run.errorlog import ErrorLog
from dspine_batch.run.fingerprint import build_manifest
from dspine_batch.run.precheck import Precheck
from dspine_batch.run.preflight import (
    Job,
    job_defaults,
    wants_chat,
)
from dspine_batch.run.progress import Progress
from dspine_batch.run.rerun import run_fields
from dspine_batch.run.selector import RowSelector
from dspine_batch.run.shard import attempt_from_env
from dspine_batch.run.shutdown import Shutdown
from dspine_batch.run.sink import PartSink
from dspine_batch.run.state import ShardState, manifest_meta
from dspine_batch.stages.keylog import NEAR_SPACE, KeyLog
from dspine_batch.stages.rows import (
    Judge,
    Parent,
    carried,
    children,
    committed_parents,
    key64s,
    pair_hashes,
    parent_fields,
)
from dspine_batch.stages.score import Continuations
from dspine_batch.stages.select import decide, group_of
from dspine_batch.stages.spec import StageSpec


class FirstStageMapper(RowMapper):
    """The first stage's mapper in a job of stages: each input row starts its lineage (its own id as the root, its
    columns as the context the later stages see)."""

    def build(self, row_id: str, file: InputFile, index: int, row: Any, id_problem: str | None,
              row_hash: int = 0) -> WorkItem:
        if isinstance(row, dict):
            row = carried(row, row_id, {}, row)
        return super().build(row_id, file, index, row, id_problem, row_hash)


@dataclass
class Stage:
    """One stage's run: its checked settings, output, lock, and once its engine is loaded its mapper, sink, state,
    rules, and the rows ready for the engine."""

    spec: StageSpec
    job: Job
    lock: Any  # the output's: a local ``resume.Lock`` or an object store's lease
    mapper: RowMapper | None = None
    sink: PartSink | None = None
    state: ShardState | None = None
    judge: Judge | None = None
    answers: Answers | None = None
    errors: ErrorLog = field(default_factory=lambda: ErrorLog(log))
    decisions: DecisionLog | None = None  # the engine's record of its proposal sources, with this stage's state
    file: InputFile | None = None
    done: DoneSet | None = None
    fingerprint: str = ""
    ready: deque[WorkItem] = field(default_factory=deque)
    made: int = 0  # rows made from parents (stages after the first)
    discarded: int = 0  # uncommitted uploads the recovery removed at this start
    retried: int = 0  # committed rows --retry-errors took out at this start (to be generated again)
    on_part: Callable[[list[WorkItem], list[Result]], None] | None = None  # a committed part: its rows' children
    scorer: Continuations | None = None  # a scoring stage's continuations (``stages.score``)
    select_done: bool = False  # a select step: its groups decided in this start (``select_rows``)

    @property
    def lineage(self) -> bool:
        return self.spec.lineage

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class Run:
    """The job as a whole: its stages, inputs, shard and the stop signal shared by every segment."""

    cfg: GenerateConfig
    stages: list[Stage]
    files: list[InputFile]
    columns: Columns  # the first stage's
    shard: tuple[int, int]
    shutdown: Shutdown
    outdir: str
    total: int | None = None  # this shard's input rows when the formats know (progress, free space)
    selector: RowSelector | None = None  # the first stage's reader of the inputs
    progress: Progress | None = None
    pre: Precheck | None = None  # what the "nothing left" check loaded (done-sets), handed on
    owned: bool = False  # every stage's lock or lease is this process's: what it says of the shard is the shard's



def run_facts(cfg: GenerateConfig) -> dict[str, Any]:
    """What the state file records of this start for its cost (``ops.cost``): the price of a machine-hour, and the
    GPUs the process sees (only where torch is loaded already: a CPU job never imports CUDA for this)."""
    facts: dict[str, Any] = {}
    if cfg.price_per_hour is not None:
        facts["price_per_hour"] = cfg.price_per_hour
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        facts["gpus"] = torch.cuda.device_count()
    return facts


def stage_log(st: Stage) -> Callable[[str], None]:
    return (lambda m: log(f"stage {st.name}: {m}")) if st.lineage else log


def stage_fields(st: Stage, parent: Stage | None, parent_fp: str | None) -> dict[str, Any]:
    """A stage's fingerprint fields beyond ``run_fields``: its rules, and for a later stage the stage it reads."""
    fields: dict[str, Any] = {"stage": st.spec.identity()}
    if parent is not None:
        fields["inputs"] = {"stage": parent.name, "fingerprint": parent_fp}
    return fields



class StageSink(PartSink):
    """The pipeline's sink, telling the runner which rows each committed part holds (a stage whose committed rows
    feed the next one)."""

    stage: Stage | None = None

    def commit(self) -> bool:
        if self.stage is not None and self.stage.judge is not None and self.items:
            self._settle(self.stage.judge)
        owners, results = self.owners, self.results
        wrote = super().commit()
        st = self.stage
        if wrote and st is not None and st.on_part is not None:
            if st.job.output.remote:  # a child is never made from a parent row whose record is not created yet
                st.job.output.flush()
            st.on_part(owners, results)
        return wrote

    def _settle(self, judge: Judge) -> None:
        """The part's dedup decided (``Judge.settle``: against every shard's kept keys) before its rows are built."""
        before = judge.duplicates
        settled = judge.settle(self.items, self.keep_names)
        if judge.duplicates != before:
            now = {id(old): new for old, new in zip(self.items, settled, strict=True)}
            self.items, self.owners = settled, [now[id(o)] for o in self.owners]
            self.pending.duplicates += judge.duplicates - before


def open_stage(run: Run, st: Stage, engine: Engine, parent: Stage | None) -> None:
    """The stage's output checked or created (its fingerprint: settings, template and stage rules, and for a later
    stage the fingerprint of the stage it reads), done-set loaded, mapper, rules and sink made."""
    job, cfg, tokenizer = st.job, st.job.cfg, engine.tokenizer
    use_chat = wants_chat(cfg, job.columns, tokenizer)
    fields = run_fields(cfg, job.files, job.columns, use_chat, job.request) | {"engine": engine.identity()}
    if st.lineage:
        fields |= stage_fields(st, parent, parent.fingerprint if parent is not None else None)
    schema = output_schema(job.columns.keep_schema(), cfg.save_token_ids)
    manifest = job.output.create_or_check(build_manifest(fields, cfg.as_dict(), job.shard[1], schema.names))
    st.fingerprint = manifest["fingerprint"]
    meta = json.dumps({"fingerprint": st.fingerprint, "stage": st.name}) if st.lineage else manifest_meta(manifest)
    schema = schema.with_metadata({"dspine_batch.run.fingerprint": meta})
    loaded = run.pre.done.get(st.spec.index) if run.pre is not None else None
    t0 = time.monotonic()
    st.done = done = loaded if loaded is not None else \
        job.output.load_done(job.tag, id_column=st.lineage or job.columns.id is not None,
                             on_damaged=cfg.on_damaged_part, report=log)
    seconds = run.pre.seconds if loaded is not None and run.pre is not None else time.monotonic() - t0
    if done.rows or st.discarded or done.damaged:
        damaged = f"; {done.damaged} damaged part(s) moved aside, their rows are generated again" \
            if done.damaged else ""
        where = f"stage {st.name}: " if st.lineage else ""
        marks = f", {done.below_parts} of them below the inputs' watermarks, not read again" if done.marks else ""
        log(f"{where}resuming: {done.rows:,} rows already committed in {done.next_seq} parts, checked "
            f"({seconds:.2f}s){marks}; {st.discarded} unfinished staging file(s) discarded{damaged}")
    defaults = job_defaults(job, SamplingParams(cfg.max_new_tokens, float(cfg.temperature), float(cfg.top_p),
                                                max(cfg.top_k, 0), cfg.seed, tokenizer.stop_token_ids(cfg.stop),
                                                tuple(cfg.stop)))
    features = frozenset(getattr(engine, "features", ()))
    label = f"stage {st.name!r}: " if st.lineage else ""
    if st.spec.score is not None:
        if not can_score(engine):
            raise UsageError(f"{label}score: the {engine.name} engine cannot score yet (use the reference engine)")
        st.scorer = Continuations(st.spec.score, tokenizer)
    for feature in defaults.params.features():
        if feature not in features:
            what = "structure" if feature in STRUCTURE_KINDS else feature
            raise UsageError(f"{label}{defaults.labels.get(what, what)}: not supported by the {engine.name} engine "
                             "yet")
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab and defaults.params.logit_bias and defaults.params.logit_bias[-1][0] >= vocab:
        raise UsageError(f"{label}--logit-bias: token id {defaults.params.logit_bias[-1][0]} is not in the model's "
                         f"vocabulary ({vocab} tokens)")
    if not use_chat and (defaults.options.tools is not None or defaults.options.template_kwargs):
        raise UsageError(f"{label}--tools / --chat-template-kwargs need a chat template (not --raw)")
    settings = MapSettings(job.columns, defaults, cfg.system_prompt, use_chat, engine.name, features)
    kind = FirstStageMapper if st.lineage and parent is None else RowMapper
    st.mapper = kind(settings, tokenizer, engine.max_context, job.structures, warn=log)
    st.state = ShardState(job.outdir, job.tag, out=job.output)
    st.state.start(job.shard, st.fingerprint, done, run_facts(cfg) | {"retried_rows": st.retried})
    sink = StageSink(job.outdir, schema, job.tag, done.next_seq, cfg.num_samples,
                      cfg.commit_rows or job.output.commit_rows, cfg.commit_seconds, attempt_from_env(),
                      st.state.save, commit=job.output.commit_part)
    sink.stage = st
    st.sink = sink
    if st.lineage:
        st.judge = Judge(st.spec, shard=job.tag)
        if st.spec.dedup is not None:
            rows, keys = committed_kept(st)
            st.judge.own.add_many(pair_hashes(rows, keys))
            if st.spec.dedup == "exact":
                st.judge.seen.add_many(key64s(keys))
        if st.spec.dedup == "minhash":  # the signatures of every shard's kept rows (its own committed: from the log)
            st.judge.log = KeyLog(job.output, NEAR_SPACE)
        elif st.spec.dedup is not None and job.shard[1] > 1:  # other shards keep rows this one cannot see
            st.judge.log = KeyLog(job.output)
    st.answers = Answers(tokenizer, cfg.reasoning_parser, cfg.tool_call_parser, log)
    st.file = InputFile(job.outdir if parent is None else parent.job.outdir,
                        f"stage {parent.name}" if parent else "input", "jsonl")


def part_paths_of(st: Stage) -> list[str]:
    """This shard's committed parts of a stage in commit order: paths, or URLs on an object store."""
    return [p.path for p in committed_parts(st.job.outdir) if p.shard == st.job.tag]


def committed_kept(st: Stage) -> tuple[np.ndarray, list[str]]:
    """Row-id hashes and dedup keys of a stage's committed kept rows in this shard: what a resume starts dedup
    from."""
    ids: list[str] = []
    keys: list[str] = []
    for path in part_paths_of(st):
        t = read_part(path, ["row_id", "kept", "dedup_key"])
        for r, k, key in zip(*(t.column(c).to_pylist() for c in ("row_id", "kept", "dedup_key")), strict=True):
            if k and key:
                ids.append(r)
                keys.append(key)
    return key_hashes(ids), keys


def parents_of(st: Stage, owners: list[WorkItem], results: list[Result]) -> Iterator[Parent]:
    """The kept rows of a committed part of ``st``, as parents of the next stage."""
    assert st.sink is not None
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


def committed_parents_of(st: Stage) -> Iterator[Parent]:
    """Every kept row ``st`` has committed in this shard (a resume's parents), part by part in commit order."""
    return committed_parents(part_paths_of(st), st.job.cfg.num_samples)


def offer(child: Stage, parent: Stage, parents: Iterator[Parent]) -> None:
    """Make ``child``'s rows from ``parents`` (skipping those already committed) and queue them."""
    assert child.done is not None and child.mapper is not None and child.file is not None
    if child.spec.select is not None:  # its rows are made when its groups are decided (``select_rows``)
        return
    for p in parents:
        for cid, row in children(p, parent.name, child.spec):
            h = key_hash(cid)
            if h in child.done.keys:
                continue
            child.done.keys.add(h)  # queued: never made twice in this run (a part's rows are offered once)
            item = child.mapper.build(cid, child.file, child.made, row, None, h)
            if child.scorer is not None and isinstance(row, dict):
                item = child.scorer.attach(item, row, child.file.name)
            child.ready.append(item)
            child.made += 1


def select_rows(st: Stage, parent: Stage) -> Iterator[tuple[WorkItem, list[Result]]]:
    """A select step's rows, its groups decided (``stages.select``): every kept row its parent stage committed in
    this shard, read twice from the committed parts — once for each row's group and value (all a decision needs:
    memory per row is its id and verdict, not its context), once to make the rows not committed yet, each with its
    parent's output as its own. The decisions go to the stage's judge. Called once every stage before it is
    finished in this shard, so every group is whole, and a group half committed by an earlier start is decided
    again from the same rows, the same way."""
    assert st.spec.select is not None and st.judge is not None and st.sink is not None and st.done is not None
    spec, groups = st.spec.select, {}
    for p in committed_parents_of(parent):
        cid = p.base
        group = group_of(spec, p.root_id, {**p.lineage, parent.name: cid})
        groups.setdefault(group, []).append((cid, parent_fields(p, parent.name).get(spec.by)))
    for rows in groups.values():
        st.judge.selected.update(decide(spec, rows))
    del groups
    for p in committed_parents_of(parent):
        for cid, row in children(p, parent.name, st.spec):
            h = key_hash(cid)
            if h in st.done.keys or not isinstance(row, dict):
                continue
            keep = tuple(row.get(n) for n in st.sink.keep_names)
            yield WorkItem(cid, [], keep, None, h), [Result(cid, 0, [], p.output, "stop")]
