"""``finalize``: the exactly-once audit over all shards, then ``_SUCCESS``.

Coverage is checked on exact row-id strings (not the 64-bit hashes the run used), with Arrow group-bys:
every expected row present with samples 0..k-1 once each (k = --num-samples, or the row's own ``n``), nothing
unexpected. Expected ids are recomputed by re-reading the
inputs with the run's own identity rules (id column, duplicate handling, limit).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.errors import EXIT_FATAL, EXIT_OK, UsageError
from dspine_batch.inputs.sources import iter_inputs, resolve_inputs
from dspine_batch.log import log
from dspine_batch.outdir.keyset import fallback_id_hashes, key_hashes
from dspine_batch.outdir.layout import shard_tag
from dspine_batch.outdir.output import Output, arrow_path, committed_parts, open_output
from dspine_batch.outdir.recovery import recover
from dspine_batch.requests.mapping import RowIds


def expected_ids(manifest: dict) -> pa.Array:
    cfg = manifest["config"]
    cols = manifest["fingerprint_fields"]["columns"]
    files = resolve_inputs(cfg["inputs"], cfg.get("split"))
    ids = RowIds(cols["id"])
    chunks = []
    read = [c for c in (cols["id"],) if c]
    for batch in iter_inputs(files, read, cfg.get("limit")):
        chunks.append(pa.array(list(ids.assign_ids(batch)[0]), pa.string()))
    return pa.chunked_array(chunks, pa.string()).combine_chunks() if chunks else pa.array([], pa.string())


def missing_by_shard(row_ids: list[str], shards: int, id_column: bool) -> dict[int, int]:
    """How many of ``row_ids`` each shard owns (the same hash the run used to split rows)."""
    hashes = (key_hashes if id_column else fallback_id_hashes)(row_ids)
    counts = np.bincount((hashes % np.uint64(shards)).astype(np.int64), minlength=shards)
    return {i: int(c) for i, c in enumerate(counts) if c}


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


def audit(outdir: str, manifest: dict, expected: Callable[[dict], pa.Array] = expected_ids) -> list[str]:
    """Problems with coverage; empty when every input row x sample is present exactly once (``expected``: the
    row ids there must be, from the manifest; a later stage of a staged job knows its own)."""
    parts = committed_parts(outdir)
    got = pa.concat_tables([pq.read_table(**arrow_path(p.path), columns=["row_id", "sample_index"]) for p in parts]) \
        if parts \
        else pa.table({"row_id": pa.array([], pa.string()), "sample_index": pa.array([], pa.int32())})
    problems = []
    counts = got.group_by(["row_id", "sample_index"]).aggregate([([], "count_all")])
    dup = counts.filter(pc.greater(counts["count_all"], 1))
    if dup.num_rows:
        problems.append(f"{dup.num_rows:,} (row, sample) pairs appear more than once, e.g. {dup['row_id'][0]}")
    # a row's own `n` may differ from --num-samples, so each row's samples must be exactly 0..k-1 for some k
    # (the sink commits a row's samples together, so a row short of samples can only be a bug)
    per_row = counts.group_by("row_id").aggregate([([], "count_all"), ("sample_index", "min"),
                                                    ("sample_index", "max")])
    gaps = per_row.filter(pc.or_(pc.not_equal(per_row["sample_index_min"], 0),
                                 pc.not_equal(pc.add(per_row["sample_index_max"], 1), per_row["count_all"])))
    if gaps.num_rows:
        problems.append(f"{gaps.num_rows:,} rows do not have samples 0..k-1 exactly once each, e.g. "
                        f"{gaps['row_id'][0]}")
    want = pa.table({"row_id": expected(manifest)})
    have = pa.table({"row_id": per_row["row_id"]})
    missing = want.join(have, "row_id", join_type="left anti")
    extra = have.join(want, "row_id", join_type="left anti")
    if missing.num_rows:
        problems.append(f"{missing.num_rows:,} of {want.num_rows:,} input rows are missing, e.g. "
                        f"{missing['row_id'][0]} (run generate again)")
        shards = int(manifest.get("num_shards", 1))
        if shards > 1:
            id_col = manifest["fingerprint_fields"]["columns"]["id"] is not None
            by_shard = missing_by_shard(missing["row_id"].to_pylist(), shards, id_col)
            problems.append("missing rows by shard: " + ", ".join(f"{i}/{shards}: {c:,}" for i, c in by_shard.items())
                            + f" (rerun those shards: generate --shard I/{shards}, or array indices "
                            + ",".join(str(i) for i in by_shard) + ")")
    if extra.num_rows:
        problems.append(f"{extra.num_rows:,} output rows match no input row, e.g. {extra['row_id'][0]}")
    return problems


def finalize(outdir: str, compact: bool, target_rows: int, on_damaged: str = "repair",
             expected: Callable[[dict], pa.Array] = expected_ids) -> int:
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
        problems = audit(outdir, manifest, expected)
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
