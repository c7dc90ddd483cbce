"""``finalize --compact``: a shard's small parts merged into big ones, never a row lost or left doubled.

No store swaps several parts for one in a single step, so a journal makes the swap completable: 1. the journal
``_dspine/compact.json`` names the new part, the token its commit record will carry, and the old parts (written
first: it is what a crash leaves behind); 2. the merged part is committed like any part (``commit``: staged, the
create-only record, published), its row keys the old records' keys end to end; 3. the old parts' records, then
the parts themselves, are deleted; 4. the journal goes. ``recover`` (every start of a shard, and ``finalize``,
before any record is read) completes a journal left by a crash: if the new part's record exists *with the
journal's token* the old parts go (a reader may briefly see both copies, but never after recovery or
``_SUCCESS``); if it does not, nothing was committed and only the journal goes (the staged bytes are swept as an
orphan). A record under the new name with another token is another writer's part of that number (a worker that
paused past its lease and committed its next part first): the old parts are not in it, and stay. Run with every
shard's lock or lease held (``finalize`` takes them all).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pyarrow as pa

from dspine_batch.outdir import legacy
from dspine_batch.outdir.check import footer_info
from dspine_batch.outdir.commit import Committer, commit_part
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.layout import PART_RE, STATE, part_name, record_rel
from dspine_batch.outdir.records import part_meta

JOURNAL = f"{STATE}/compact.json"


def recover(out: Outdir) -> None:
    """Finish (or drop) a compaction a crash interrupted."""
    data = out.store.get(JOURNAL)
    if data is None:
        return
    j = json.loads(data)
    if "token" in j:
        rec = out.record_of(j["new"])
        committed = rec is not None and rec.get("token") == j["token"]
        if committed and j["new"] not in out.store.list(""):
            out.publish(rec)  # type: ignore[arg-type]
    else:  # an old local journal
        committed = legacy.finish_compaction(out, j)
    if committed:  # the merged part is committed: the old ones must go, records first
        out.store.delete_many([record_rel(n) for n in j["old"]])
        out.store.delete_many(list(j["old"]) + (legacy.key_files(j["old"]) if out.store.local else []))
    out.store.delete(JOURNAL)
    out.forget_records()


def compact(out: Outdir, committer: Committer, target_rows: int) -> int:
    """Merge each shard's consecutive parts into parts of up to ``target_rows`` output rows; returns how many parts
    were merged away."""
    records = out.records(None)
    by_shard: dict[str, list[tuple[int, str]]] = {}
    for name in out.store.list(""):
        if m := PART_RE.match(name):
            by_shard.setdefault(m.group(1), []).append((int(m.group(2)), name))
    merged = 0
    for tag, parts in sorted(by_shard.items()):
        parts.sort()
        next_seq = max([parts[-1][0]] + [int(PART_RE.match(n).group(2)) for n in records  # type: ignore[union-attr]
                                         if n.startswith(f"train-{tag}-")]) + 1
        group: list[str] = []
        rows = 0
        for item in [*parts, None]:
            n = _outputs(out, item[1], records.get(item[1])) if item is not None else 0
            if item is None or (group and rows + n > target_rows):
                if len(group) > 1:
                    _merge(out, committer, group, records, part_name(tag, next_seq))
                    next_seq += 1
                    merged += len(group)
                group, rows = [], 0
            if item is not None:
                group.append(item[1])
                rows += n
    return merged


def _outputs(out: Outdir, name: str, rec: dict[str, Any] | None) -> int:
    return int(rec["outputs"]) if rec is not None else int(footer_info(out, name)["outputs"])


def _merge(out: Outdir, committer: Committer, group: list[str], records: dict[str, Any], name: str) -> None:
    tables = [out.read_table(p) for p in group]
    metas = [part_meta(t) for t in tables]
    table = pa.concat_tables(tables)
    meta = dict(tables[0].schema.metadata or {})
    info = dict(metas[0])
    info.update(rows=sum(int(m.get("rows", 0)) for m in metas), error_rows=sum(int(m.get("error_rows", 0))
                                                                              for m in metas),
                compacted_from=group)
    meta[b"dspine_batch.part"] = json.dumps(info).encode()
    table = table.replace_schema_metadata(meta)
    # the merged record's keys only from lists that check out: a doubtful one must not be blessed by a new record
    # (then none, and a resume reads the merged part's row ids)
    parts_keys = []
    listed = out.keys_of([p for p in group if records.get(p) is not None])
    for p, m in zip(group, metas, strict=True):
        rec = records.get(p)
        keys = listed.get(p)
        parts_keys.append(keys if keys is not None else legacy.load_keys(out, p, m.get("rows"), rec))
    keys = None if any(k is None for k in parts_keys) else np.concatenate(parts_keys)
    token = uuid.uuid4().hex[:16]
    out.store.put(JOURNAL, json.dumps({"new": name, "token": token, "old": group}).encode())
    try:
        commit_part(out, committer, name, table, keys, rows=info["rows"], token=token)
        committer.flush()
    except BaseException:
        if out.record_of(name) is None:  # nothing committed (a full disk): nothing to finish, nothing merged
            out.store.delete(JOURNAL)
        raise
    recover(out)
