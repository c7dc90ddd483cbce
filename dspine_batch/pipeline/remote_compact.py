"""``finalize --compact`` on an object-store OUTDIR: a shard's small parts merged into big ones, never a row lost
or left doubled — the local protocol (``compact``) in the store's own primitives.

An object store cannot swap several parts for one in a single step, so, as on a disk, a journal makes the swap
completable: 1. the journal ``_dspine/compact.json`` names the new part, the token its commit record will carry,
and the old parts (written first: it is what a crash leaves behind); 2. the merged part is committed like any part
(staged upload, create-only commit record — the linearisation point — server-side publish), its row keys the old
records' keys end to end; 3. the old parts' records, then their published copies, are deleted; 4. the journal
goes. ``recover`` (every start of a shard, and ``finalize``, before any record is read) completes a journal left
by a crash: if the new part's record exists *with the journal's token* the old parts go (a reader may briefly see
both copies, as on a disk, but never after recovery or ``_SUCCESS``); if it does not, nothing was committed and
only the journal goes (the staged upload is swept as an orphan). A record under the new name with another token is
another writer's part of that number (a worker that paused past its lease and committed its next part first):
the old parts are not in it, and stay. Run with every shard's lease held (``finalize`` takes them all).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.pipeline.remote_layout import STATE, record_keys, record_rel
from dspine_batch.pipeline.resume import PART_RE
from dspine_batch.pipeline.sink import part_name

JOURNAL = f"{STATE}/compact.json"


def recover(out: Any) -> None:
    """Finish (or drop) a compaction a crash interrupted (``out``: a ``remote.ObjectOutput``)."""
    data = out.store.get(JOURNAL)
    if data is None:
        return
    j = json.loads(data)
    rec = out.record_of(j["new"])
    if rec is not None and rec.get("token") == j.get("token", rec.get("token")):  # (a journal without one: older)
        # the merged part is committed: the old ones must go, records first
        if j["new"] not in out.store.list(""):
            out.publish(rec)
        out.store.delete_many([record_rel(n) for n in j["old"]])
        out.store.delete_many(list(j["old"]))
    out.store.delete(JOURNAL)
    out.forget_records()


def compact(out: Any, target_rows: int) -> int:
    """Merge each shard's consecutive parts into parts of up to ``target_rows`` rows; returns how many parts were
    merged away."""
    records = {n: r for n, r in out.records(None).items() if not r.get("unreadable")}
    by_shard: dict[str, list[tuple[int, str]]] = {}
    for name in records:
        m = PART_RE.match(name)
        if m:
            by_shard.setdefault(m.group(1), []).append((int(m.group(2)), name))
    merged = 0
    for tag, parts in sorted(by_shard.items()):
        parts.sort()
        next_seq = parts[-1][0] + 1
        group: list[str] = []
        rows = 0
        for item in [*parts, None]:
            n = int(records[item[1]]["outputs"]) if item is not None else 0
            if item is None or (group and rows + n > target_rows):
                if len(group) > 1:
                    _merge(out, [(g, records[g]) for g in group], part_name(tag, next_seq))
                    next_seq += 1
                    merged += len(group)
                group, rows = [], 0
            if item is not None:
                group.append(item[1])
                rows += n
    return merged


def _merge(out: Any, group: list[tuple[str, dict[str, Any]]], name: str) -> None:
    tables = []
    for part, _ in group:
        with out.store.open(part) as f:
            tables.append(pq.read_table(f))
    table = pa.concat_tables(tables)
    meta = dict(tables[0].schema.metadata or {})
    info = json.loads(meta.get(b"dspine_batch.part", b"{}"))
    info.update(rows=sum(int(r["rows"]) for _, r in group), error_rows=sum(int(r.get("error_rows", 0))
                                                                          for _, r in group),
                compacted_from=[p for p, _ in group])
    meta[b"dspine_batch.part"] = json.dumps(info).encode()
    table = table.replace_schema_metadata(meta)
    # the merged record's keys only from records whose keys check out (``record_keys``): otherwise none, and a
    # resume reads the merged part's row ids
    parts_keys = [record_keys(r) for _, r in group]
    keys = None if any(k is None for k in parts_keys) else np.concatenate(parts_keys)
    token = uuid.uuid4().hex[:16]
    out.store.put(JOURNAL, json.dumps({"new": name, "token": token, "old": [p for p, _ in group]}).encode())
    out.commit_part(name, table, keys, rows=info["rows"], token=token)
    out.flush()
    recover(out)
