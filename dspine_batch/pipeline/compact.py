"""``finalize --compact``: merge a shard's small parts into big ones without ever losing or doubling rows.

Protocol: stage + fsync the merged part, write a journal naming new and old parts, rename the new part in,
delete the old ones, delete the journal. ``recover`` (run at every generate/finalize start) completes a
journal left by a crash, so a reader may briefly see both copies but never after recovery or _SUCCESS.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.errors import disk_full_named
from dspine_batch.pipeline.resume import STATE_DIR, list_parts, part_info
from dspine_batch.pipeline.sink import (
    fsync_dir,
    keys_path,
    load_keys,
    part_name,
    read_record,
    record_path,
    stage_part,
    staging_name,
    unstage,
)

JOURNAL = "compact.json"


def recover(outdir: str) -> None:
    path = os.path.join(outdir, STATE_DIR, JOURNAL)
    if not os.path.exists(path):
        return
    with open(path) as f:
        j = json.load(f)
    new = os.path.join(outdir, j["new"])
    staged = os.path.join(outdir, staging_name(j["new"]))
    if os.path.exists(staged) and not os.path.exists(new):
        os.rename(staged, new)
        fsync_dir(outdir)
    if os.path.exists(new):
        for old in j["old"]:  # record first (see sink.unstage): a record without its part reads as "lost"
            for p in (record_path(outdir, old), os.path.join(outdir, old), keys_path(outdir, old)):
                if os.path.exists(p):
                    os.unlink(p)
        fsync_dir(outdir)
    os.unlink(path)


def compact(outdir: str, target_rows: int) -> int:
    """Returns how many parts were merged away."""
    merged = 0
    parts = list_parts(outdir)
    for tag in sorted({p.shard for p in parts}):
        mine = [p for p in parts if p.shard == tag]
        next_seq = mine[-1].seq + 1
        group: list = []
        rows = 0
        for p in mine + [None]:
            n = pq.ParquetFile(p.path).metadata.num_rows if p is not None else 0
            if p is None or (group and rows + n > target_rows):
                if len(group) > 1:
                    _merge(outdir, group, part_name(tag, next_seq))
                    next_seq += 1
                    merged += len(group)
                group, rows = [], 0
            if p is not None:
                group.append(p)
                rows += n
    return merged


def _merge(outdir: str, group: list, name: str) -> None:
    tables = [pq.read_table(p.path) for p in group]
    infos = [part_info(p.path) for p in group]
    table = pa.concat_tables(tables)
    meta = dict(tables[0].schema.metadata or {})
    merged = json.loads(meta.get(b"dspine_batch.part", b"{}"))
    merged.update(rows=sum(i.get("rows", 0) for i in infos), error_rows=sum(i.get("error_rows", 0) for i in infos),
                  compacted_from=[os.path.basename(p.path) for p in group])
    meta[b"dspine_batch.part"] = json.dumps(merged).encode()
    table = table.replace_schema_metadata(meta)
    names = [os.path.basename(p.path) for p in group]
    parts_keys = [load_keys(outdir, n, i.get("rows"), read_record(outdir, n))
                  for n, i in zip(names, infos, strict=True)]
    # the merged key file only from key files that check out: a doubtful one must not be blessed by a new record
    keys = None if any(k is None for k in parts_keys) else np.concatenate(parts_keys)
    stage_part(outdir, name, table, keys, rows=merged["rows"])  # with a fresh commit record for the merged bytes
    journal = os.path.join(outdir, STATE_DIR, JOURNAL)
    try:
        with disk_full_named(journal, then="nothing was merged"):
            with open(journal + ".tmp", "w") as f:
                json.dump({"new": name, "old": [os.path.basename(p.path) for p in group]}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(journal + ".tmp", journal)
    except BaseException:
        for path in (journal + ".tmp", journal):
            if os.path.exists(path):
                os.unlink(path)
        unstage(outdir, name)
        raise
    recover(outdir)
