"""Taking committed rows out of a part, atomically: how ``--retry-errors`` supersedes failed rows, on every store.

A retried row must never be seen twice (its old error row and its new attempt) by a reader globbing OUTDIR, and a
row that was not retried must never be lost. So the failed rows are taken out of their parts *before* they are
generated again; from then on they are simply rows not yet committed, and the ordinary commit (``commit``) commits
their new attempt exactly once, across any kill. Taking rows out of part ``X`` (the shard's lock or lease held,
so this process is the only writer of ``X`` and of its record):

  1. stage the part without those rows under a fresh staging name (``_dspine/staging/X.<token>``);
  2. put the journal ``_dspine/supersede-<shard>.json``: the part and its new record;
  3. swap ``X``'s commit record for the new one (compare-and-swap on the old record's ETag: ``If-Match`` on a
     store, ``flock`` on a disk) - the linearisation point: from here ``X`` is committed with the new content, and
     the taken rows are simply not committed. A swap whose answer was lost (its retry meets a changed ETag) is
     read back by token: the record holding ours is our swap;
  4. publish the staged bytes over ``X`` (a rename on a disk, a server-side copy on a store: readers switch from
     the old part to the new one in one step); delete what is left of the staged bytes and the journal.
A part left with no rows goes instead: journal, then its record (from then it is not committed), then the part.

A crash anywhere is settled by ``recover`` at the shard's next start, before anything reads the records: with a
journal whose record is the one the store holds, step 4 (or the removal) is finished; with any other, the staged
bytes are deleted and the part is as it was. Between 3 and 4 a reader still sees the old part: its rows are not
generated again until every part is settled, so no reader ever sees a row twice.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import pyarrow as pa

from dspine_batch.errors import FatalError
from dspine_batch.outdir import legacy
from dspine_batch.outdir.commit import stage
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.layout import STATE, record_rel
from dspine_batch.outdir.records import encode, record_keys


def journal_rel(tag: str) -> str:
    return f"{STATE}/supersede-{tag}.json"


def rows_kept(table: pa.Table, drop: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """(whether each output row stays, whether each input row stays, input rows in part order: the record's key
    order) for taking the rows in ``drop`` out of a part's ``table``."""
    ids = table.column("row_id").to_pylist()
    order = dict.fromkeys(ids)
    return (np.array([rid not in drop for rid in ids], dtype=bool),
            np.array([rid not in drop for rid in order], dtype=bool))


def without_rows(table: pa.Table, keep: np.ndarray, rows: int) -> pa.Table:
    """The part's table with only the ``keep`` output rows, its part metadata saying so (``rows`` input rows)."""
    kept = table.filter(pa.array(keep))
    meta = dict(kept.schema.metadata or {})
    info = json.loads(meta.get(b"dspine_batch.part", b"{}"))
    status = kept.column("status").to_pylist()
    kept_ids = kept.column("row_id").to_pylist()
    info.update(rows=rows, error_rows=len({r for r, s in zip(kept_ids, status, strict=True) if s != "ok"}),
                superseded_at=time.time())
    meta[b"dspine_batch.part"] = json.dumps(info).encode()
    return kept.replace_schema_metadata(meta)


def drop_rows(out: Outdir, tag: str, name: str, drop: set[str]) -> int:
    """Take the rows whose ``row_id`` is in ``drop`` (all their samples) out of the committed part ``name``;
    returns how many input rows went. Call with the shard's lock or lease held."""
    store = out.store
    table = out.read_table(name)
    keep, kept_rows = rows_kept(table, drop)
    if keep.all():
        return 0
    rows = int(kept_rows.sum())
    gone = len(kept_rows) - rows
    got = store.get_with_etag(record_rel(name))  # None: an old part without a record (created below instead)
    old = json.loads(got[0]) if got is not None else {}
    journal = journal_rel(tag)
    out.forget_records()
    if not keep.any():
        store.put(journal, json.dumps({"part": name, "remove": True}).encode())
        _remove(out, name)
        store.delete(journal)
        return gone
    keys = record_keys(old) if old else None
    if keys is None:  # a doubtful list is not carried over (row ids are read instead); an old key file is
        keys = legacy.load_keys(out, name, len(kept_rows), old or None)
    record, tmp = stage(out, name, without_rows(table, keep, rows), None if keys is None else keys[kept_rows], rows)
    if tmp is not None:
        try:
            store.upload(tmp, record["staged"])
        finally:
            os.unlink(tmp)
    record.update(committed_at=old.get("committed_at", record["committed_at"]), superseded_at=time.time())
    store.put(journal, json.dumps({"part": name, "record": record}).encode())
    if not _swap(out, name, record, got[1] if got is not None else None):
        store.delete_many([record["staged"], journal])
        raise FatalError(f"{store.url_of(record_rel(name))}: changed while its failed rows were taken out (another "
                         "worker on this shard?); nothing was changed by this one")
    out.publish(record)
    if store.local:
        store.delete(legacy.keys_rel(name))  # an old key file lists rows the part no longer has
    store.delete(journal)
    out.forget_records()
    return gone


def _swap(out: Outdir, name: str, record: dict[str, Any], etag: str | None) -> bool:
    """Step 3: whether ``name``'s record is now ``record`` (swapped by this call, or by an earlier attempt of it
    whose answer was lost: read back by token). Under a lease, sent only while the lease is valid. A part without a
    record (an old one) gets its first by a create-only write."""
    with out.owning():
        body = encode(record)
        done = out.store.replace(record_rel(name), body, etag) is not None if etag is not None \
            else out.store.create(record_rel(name), body)
    return done or (out.record_of(name) or {}).get("token") == record["token"]


def _remove(out: Outdir, name: str) -> None:
    out.store.delete(record_rel(name))  # from here the part is not committed
    out.store.delete_many([name] + ([legacy.keys_rel(name)] if out.store.local else []))


def recover(out: Outdir, tag: str) -> str | None:
    """Finish or undo a supersede a crash interrupted (see the module docstring); returns what was done."""
    store = out.store
    journal = journal_rel(tag)
    data = store.get(journal)
    if data is None:
        return None
    out.forget_records()
    try:
        entry = json.loads(data)
    except ValueError:  # torn before its rename (a disk): the part was never touched
        entry = {}
    name, record = entry.get("part"), entry.get("record")
    done = None
    if legacy.is_old_journal(entry):
        done = legacy.recover_retry(out, entry)
    elif name and entry.get("remove"):
        _remove(out, name)
        done = f"{name}: finished removing its superseded rows"
    elif name and record:
        if (out.record_of(name) or {}).get("token") == record["token"]:
            # the record was swapped: the new part is the committed one; publish it (idempotent on a store; on a disk
            # a staged file that is gone was renamed in already)
            if store.head(record["staged"]) is not None:
                out.publish(record)
            if store.local:
                store.delete(legacy.keys_rel(name))
            done = f"{name}: finished replacing it without its superseded rows"
        else:
            store.delete(record["staged"])
            done = f"{name}: left as it was (its superseded rows stay until the next --retry-errors)"
    store.delete(journal)
    return done
