"""``finalize``: recovery, every part checked against its commit record, the exactly-once audit over all shards
(``audit``: in memory, or by hash partition past ``DSPINE_BATCH_AUDIT_ROWS``), then ``_SUCCESS``.

Expected ids are recomputed by re-reading the inputs with the run's own identity rules (id column, duplicate
handling, limit).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pyarrow as pa

from dspine_batch.errors import EXIT_FATAL, EXIT_OK, UsageError
from dspine_batch.inputs.sources import iter_inputs, resolve_inputs
from dspine_batch.log import log
from dspine_batch.ops.audit import Expected, audit_coverage
from dspine_batch.outdir.layout import shard_tag
from dspine_batch.outdir.output import Output, open_output
from dspine_batch.outdir.recovery import recover
from dspine_batch.requests.mapping import RowIds


def expected_ids(manifest: dict) -> Iterator[pa.Array]:
    """The row ids the job's inputs hold, in chunks, by the run's own identity rules (id column, duplicate
    handling, limit)."""
    cfg = manifest["config"]
    cols = manifest["fingerprint_fields"]["columns"]
    files = resolve_inputs(cfg["inputs"], cfg.get("split"))
    ids = RowIds(cols["id"])
    read = [c for c in (cols["id"],) if c]
    for batch in iter_inputs(files, read, cfg.get("limit")):
        yield pa.array(list(ids.assign_ids(batch)[0]), pa.string())


def shard_report(outdir: str | Output, manifest: dict) -> tuple[list[str], list[str]]:
    """(shards that never started, shards whose last run did not finish) from the per-shard state files."""
    out = open_output(outdir) if isinstance(outdir, str) else outdir
    shards = int(manifest.get("num_shards", 1))
    never, unfinished = [], []
    for i in range(shards):
        st = out.read_state(shard_tag(i, shards))
        if not st:
            never.append(f"{i}/{shards}")
        elif st.get("state") != "done":
            unfinished.append(f"{i}/{shards} ({st.get('state')}, {st.get('rows_done', 0):,} rows)")
    return never, unfinished


def finalize(outdir: str, compact: bool, target_rows: int, on_damaged: str = "repair",
             expected: Expected = expected_ids) -> int:
    out = open_output(outdir)
    manifest = out.read_manifest()
    if manifest is None:
        raise UsageError(f"{out.display}: no _manifest.json (not a dspine-batch output)")
    shards = int(manifest.get("num_shards", 1))
    locks = []
    try:
        for i in range(shards):
            locks.append(out.lock(shard_tag(i, shards)).acquire())  # no shard may run meanwhile
        recover(out, [shard_tag(i, shards) for i in range(shards)], log)  # journals, publishes, orphans: one order
        good = out.verify_parts(None, on_damaged, log)  # a damaged part is moved aside: its rows show as missing
        log(f"checked {len(good)} part(s) against their commit records")
        if compact:
            merged = out.compact(target_rows)
            log(f"compacted {merged} parts into {len(out.part_urls())}")
        outputs = sum(int((c.info or {}).get("outputs", 0)) for c in good)  # compaction merges, never drops, rows
        problems = audit_coverage(outdir, manifest, expected, outputs)
        never, unfinished = shard_report(out, manifest)
        if problems:
            if never:
                problems.append(f"shards never started: {', '.join(never)}")
            if unfinished:
                problems.append(f"shards not finished: {', '.join(unfinished)}")
            for p in problems:
                print(f"dspine-batch: {p}", file=sys.stderr)
            return EXIT_FATAL
        for what, items in (("never started (they own no rows)", never), ("ended without a final 'done'", unfinished)):
            if items:
                log(f"note: shards {what}: {', '.join(items)}; every row is present, so this is harmless")
        out.write_success()
        log(f"complete: every input row x {manifest['config']['num_samples']} sample(s) (or its own n) present "
            "exactly once; _SUCCESS written")
        return EXIT_OK
    finally:
        for lock in locks:
            lock.release()
