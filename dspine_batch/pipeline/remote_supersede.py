"""Taking committed rows out of a part on an object store: ``--retry-errors`` on an ``s3://`` or ``az://``
OUTDIR.

The local protocol (``supersede``) replaces a part with ``rename``; an object store has none, but it has what
replaces it: overwriting an object is atomic for readers (a GET sees the old bytes or the new, never a mix), and
a commit record can be swapped with a compare-and-swap (``If-Match`` on its ETag). Taking rows out of part ``X``
(the shard's lease held, so this worker is the only writer of ``X`` and of its record):

  1. build the part without those rows locally and upload it to a fresh staging name (``_dspine/staging/X.<t>``);
  2. put the journal ``_dspine/supersede-<shard>.json``: the part and its new record;
  3. swap ``X``'s commit record for the new one (``If-Match`` the old record's ETag) - the linearisation point:
     from here ``X`` is committed with the new content, and the taken rows are simply not committed. A swap
     whose answer was lost (its retry meets 412: the ETag is the new record's now) is read back by token: the
     record holding ours is our swap;
  4. publish: a server-side copy of the staged object over ``X`` (readers switch from the old part to the new
     one in one step); delete the staged object and the journal.
A part left with no rows goes instead: journal, then its record (from then it is not committed), then the part.

A crash anywhere is settled by ``recover`` at the shard's next start, before anything reads the records: with a
journal whose record is the one the store holds, steps 4 (or the removal) are finished; with any other, the staged
upload is deleted and the part is as it was. Between 3 and 4 a reader still sees the old part: its rows are not
generated again until every part is settled, so no reader ever sees a row twice.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from typing import Any

import pyarrow.parquet as pq

from dspine_batch.errors import FatalError
from dspine_batch.pipeline.remote_layout import STAGING, STATE, keys_fields, record_keys, record_rel
from dspine_batch.pipeline.sink import CHECKSUM, ChecksumWriter
from dspine_batch.pipeline.supersede import rows_kept, without_rows
from dspine_batch.storage.objects import local_tmp_dir

# ``out`` below is a ``remote.ObjectOutput`` (not imported: it calls this module)


def journal_rel(tag: str) -> str:
    return f"{STATE}/supersede-{tag}.json"


def drop_rows(out: Any, tag: str, name: str, drop: set[str]) -> int:
    """Take the rows whose ``row_id`` is in ``drop`` (all their samples) out of the committed part ``name``;
    returns how many input rows went. Call with the shard's lease held."""
    store = out.store
    with store.open(name) as f:
        table = pq.read_table(f)
    keep, kept_rows = rows_kept(table, drop)
    if keep.all():
        return 0
    gone = len(kept_rows) - int(kept_rows.sum())
    got = store.get_with_etag(record_rel(name))
    if got is None:
        raise FatalError(f"{store.url_of(record_rel(name))}: the commit record of a part being retried is gone")
    old, etag = json.loads(got[0]), got[1]
    journal = journal_rel(tag)
    out.forget_records()
    if not keep.any():
        store.put(journal, json.dumps({"part": name, "remove": True}).encode())
        _remove(out, name)
        store.delete(journal)
        return gone
    kept = without_rows(table, keep, int(kept_rows.sum()))
    token = uuid.uuid4().hex[:16]
    staged = f"{STAGING}/{name}.{token}"
    fd, tmp = tempfile.mkstemp(prefix=".dspine-retry-", suffix=".parquet", dir=local_tmp_dir())
    try:
        with os.fdopen(fd, "wb") as f:
            w = ChecksumWriter(f)
            pq.write_table(kept, w, compression="zstd", row_group_size=256 * 1024)
        store.upload(tmp, staged)
    finally:
        os.unlink(tmp)
    record = {**old, "rows": int(kept_rows.sum()), "outputs": kept.num_rows,
              "error_rows": json.loads(kept.schema.metadata[b"dspine_batch.part"])["error_rows"], "bytes": w.size,
              CHECKSUM: w.crc, "token": token, "staged": staged, "superseded_at": time.time()}
    record.pop("keys_b64", None)
    record.pop("keys_crc32", None)
    if (keys := record_keys(old)) is not None:  # a doubtful list is not carried over: row ids are read instead
        record.update(keys_fields(keys[kept_rows]))
    store.put(journal, json.dumps({"part": name, "record": record}).encode())
    if not _swap(out, name, record, etag):
        store.delete_many([staged, journal])
        raise FatalError(f"{store.url_of(record_rel(name))}: changed while its failed rows were taken out (another "
                         "worker on this shard?); nothing was changed by this one")
    out.publish(record)
    store.delete(journal)
    return gone


def _swap(out: Any, name: str, record: dict[str, Any], etag: str) -> bool:
    """Step 3: whether ``name``'s record is now ``record`` (swapped by this call, or by an earlier attempt of it
    whose answer was lost: read back by token). Under a lease, sent only while the lease is valid."""
    with out.owning():
        swapped = out.store.replace(record_rel(name), json.dumps(record, sort_keys=True).encode(), etag) is not None
    return swapped or (out.record_of(name) or {}).get("token") == record["token"]


def _remove(out: Any, name: str) -> None:
    out.store.delete(record_rel(name))  # from here the part is not committed
    out.store.delete(name)


def recover(out: Any, tag: str) -> str | None:
    """Finish or undo a supersede a crash interrupted (see the module docstring); returns what was done."""
    store = out.store
    journal = journal_rel(tag)
    data = store.get(journal)
    if data is None:
        return None
    out.forget_records()
    try:
        entry = json.loads(data)
    except ValueError:
        entry = {}
    name, record = entry.get("part"), entry.get("record")
    done = None
    if name and entry.get("remove"):
        _remove(out, name)
        done = f"{name}: finished removing its superseded rows"
    elif name and record:
        current = store.get(record_rel(name))
        try:
            ours = current is not None and json.loads(current).get("token") == record["token"]
        except ValueError:
            ours = False
        if ours:  # the record was swapped: the new part is the committed one; publish it (idempotent)
            staged = store.head(record["staged"])
            if staged is not None:
                out.publish(record)
            done = f"{name}: finished replacing it without its superseded rows"
        else:
            store.delete(record["staged"])
            done = f"{name}: left as it was (its superseded rows stay until the next --retry-errors)"
    store.delete(journal)
    return done
