"""A rerun of a staged job with nothing left, told without loading any model.

A cron job or an array task that runs again after its job finished should cost seconds, not one model load per
model of the job. Every stage is checked as far as can be told without an engine, as a one-stage rerun is
(``pipeline.rerun``): its manifest holds the same settings, template and stage rules (and, for a stage after the
first, its parent stage's fingerprint), and every row it should hold is committed: the first stage's input rows
of this shard, a later stage's children of every kept row its parent stage committed in this shard. Anything
else, or any doubt, and the normal start runs; a stage whose settings, template, rules or inputs changed is refused
here, before any model loads, naming the stage and what changed (as the normal start would refuse it after).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dspine_batch.errors import EXIT_ERROR_BUDGET, EXIT_OK
from dspine_batch.pipeline.job import ShardState
from dspine_batch.pipeline.keyset import key_hash
from dspine_batch.pipeline.mapping import Columns
from dspine_batch.pipeline.outputs import committed_parts
from dspine_batch.pipeline.rerun import count_missing, refuse_other_run, run_changes, same_engine_asked
from dspine_batch.pipeline.sink import SinkStats
from dspine_batch.pipeline.sources import InputFile
from dspine_batch.stages.rows import child_ids, committed_parents


def _same_stage(st: Any, manifest: dict[str, Any], parent: tuple[str, str] | None) -> bool:
    """The stage's manifest records this stage's run (settings, request, template, rules, engine as asked for); a
    change is refused as the normal start would refuse it, but before any model loads."""
    job = st.job
    extra: dict[str, Any] = {"stage": st.spec.identity()}
    if parent is not None:  # a later stage's input is its parent stage's output (``run._open``)
        extra["inputs"] = {"stage": parent[0], "fingerprint": parent[1]}
    changes = run_changes(job.cfg, job.files, job.columns, manifest, job.request, extra)
    if changes:
        refuse_other_run(f"stage {st.spec.name!r}: {job.outdir}", changes, manifest)
    return same_engine_asked(job.cfg, manifest)


def nothing_left(stages: list[Any], files: list[InputFile], columns: Columns,
                 log: Callable[[str], None]) -> int | None:
    """Every stage complete: their state files and markers written as a finished run writes them, and the exit
    code; None when any stage has work (or may have: then the normal start decides). Call with the locks held."""
    t0 = time.monotonic()
    parent: tuple[str, str] | None = None
    checked = []
    for st in stages:
        job = st.job
        manifest = job.output.read_manifest()
        if manifest is None or manifest.get("num_shards") != job.shard[1] \
                or not _same_stage(st, manifest, parent):
            return None
        done = job.output.load_done(job.tag, id_column=True, on_damaged=job.cfg.on_damaged_part, report=log)
        if st.spec.index == 0:
            if count_missing(job.cfg, files, columns, job.shard, done.keys)[1]:
                return None
        else:
            before = stages[st.spec.index - 1]
            paths = [p.path for p in committed_parts(before.job.outdir) if p.shard == job.tag]
            for p in committed_parents(paths, before.job.cfg.num_samples):
                if any(key_hash(cid) not in done.keys for cid in child_ids(p, st.spec.explode)):
                    return None
        checked.append((st, manifest, done))
        parent = (st.spec.name, manifest["fingerprint"])
    log(f"nothing left to do: every stage's rows are committed (checked in {time.monotonic() - t0:.2f}s); no model "
        "was loaded")
    worst = 0.0
    for st, manifest, done in checked:
        state = ShardState(st.job.outdir, st.job.tag, out=st.job.output)
        state.start(st.job.shard, manifest["fingerprint"], done)
        state.save(SinkStats(), "done", total_rows=done.rows)
        log(f"stage {st.spec.name}: {done.rows:,} rows, {done.error_rows:,} with errors -> {st.job.outdir}")
        worst = max(worst, done.error_rows / done.rows if done.rows else 0.0)
    return ended(stages, worst, log)


def ended(stages: list[Any], worst: float, log: Callable[[str], None]) -> int:
    """A staged job's end, after every stage is complete: each stage's ``_SUCCESS`` (one shard), and the exit code
    of the worst stage's error rate against --max-error-rate."""
    for st in stages:
        if st.job.shard[1] == 1:
            st.job.output.write_success()
    limit = stages[0].job.cfg.max_error_rate
    if worst > limit:
        log(f"a stage's error rate {worst:.1%} is over --max-error-rate {limit:.1%}; see `dspine-batch report "
            "OUTDIR/<stage>`")
        return EXIT_ERROR_BUDGET
    return EXIT_OK
