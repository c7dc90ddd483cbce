"""A rerun with nothing left to do, told without loading any model — for a job of one stage or of many.

Nightly cron pipelines and requeued array tasks rerun finished jobs by design, and loading a model (seconds on a
CPU, minutes for SGLang on a GPU) only to find every row committed is waste. So before any engine loads, every
stage is checked as far as can be told without one (``run.rerun``): its manifest holds the same settings,
template and stage rules (and, for a stage after the first, its parent stage's fingerprint), and every row it
should hold is committed: the first stage's input rows of this shard (read for their ids only), a later stage's
children of every kept row its parent stage committed in this shard. Anything else, or any doubt, and the normal
start runs — with the done-sets loaded here handed on, not loaded twice; a stage whose settings, template, rules
or inputs changed is refused here, before any model loads, naming what changed.

It runs after the one recovery (``outdir.recovery``), so a part whose publish a crash interrupted is published
before it is counted, the same for every stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspine_batch.inputs.sources import InputFile
from dspine_batch.outdir.done import DoneSet
from dspine_batch.outdir.keyset import key_hash
from dspine_batch.outdir.output import committed_parts
from dspine_batch.requests.mapping import Columns
from dspine_batch.run.rerun import count_missing, refuse_other_run, run_changes, same_engine_asked
from dspine_batch.stages.rows import child_ids, committed_parents


@dataclass
class Precheck:
    """What the check found: whether every stage is complete, and each checked stage's manifest and done-set
    (by stage index: the normal start takes them instead of loading them again)."""

    complete: bool = False
    manifests: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: dict[int, DoneSet] = field(default_factory=dict)
    rows: int = 0  # the first stage's input rows in this shard (all of them only when complete)
    seconds: float = 0.0


def _same_stage(st: Any, manifest: dict[str, Any], parent: tuple[str, str] | None) -> bool:
    """The stage's manifest records this stage's run (settings, request, template, rules, engine as asked for); a
    change is refused as the normal start would refuse it, but before any model loads."""
    job = st.job
    extra: dict[str, Any] | None = None
    if st.spec.lineage:
        extra = {"stage": st.spec.identity()}
        if parent is not None:  # a later stage's input is its parent stage's output (``run.runner._open``)
            extra["inputs"] = {"stage": parent[0], "fingerprint": parent[1]}
    changes = run_changes(job.cfg, job.files, job.columns, manifest, job.request, extra)
    if changes:
        where = f"stage {st.spec.name!r}: {job.outdir}" if st.spec.lineage else job.outdir
        refuse_other_run(where, changes, manifest)
    return same_engine_asked(job.cfg, manifest)


def precheck(stages: list[Any], files: list[InputFile], columns: Columns, log: Callable[[str], None]) -> Precheck:
    """Check every stage in order (call with their locks held, after the recovery); stops at the first stage
    that has work or may have (then the normal start decides)."""
    t0 = time.monotonic()
    out = Precheck()
    parent: tuple[str, str] | None = None
    for st in stages:
        job = st.job
        manifest = job.output.read_manifest()
        if manifest is None or manifest.get("num_shards") != job.shard[1] or not _same_stage(st, manifest, parent):
            break
        done = job.output.load_done(job.tag, id_column=st.spec.lineage or job.columns.id is not None,
                                    on_damaged=job.cfg.on_damaged_part, report=log)
        out.manifests[st.spec.index], out.done[st.spec.index] = manifest, done
        if st.spec.index == 0:
            out.rows, missing = count_missing(job.cfg, files, columns, job.shard, done.keys, done.marks, done.rows)
            if missing:
                break
        else:
            before = stages[st.spec.index - 1]
            paths = [p.path for p in committed_parts(before.job.outdir) if p.shard == job.tag]
            if any(key_hash(cid) not in done.keys for p in committed_parents(paths, before.job.cfg.num_samples)
                   for cid in child_ids(p, st.spec.explode)):
                break
        parent = (st.spec.name, manifest["fingerprint"])
    else:
        out.complete = True
    out.seconds = time.monotonic() - t0
    return out
