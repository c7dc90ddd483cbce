"""Taking committed rows out of a part, atomically: how ``--retry-errors`` supersedes failed rows.

A retried row must never be seen twice (its old error row and its new attempt) by a reader globbing OUTDIR, and a
row that was not retried must never be lost. So the failed rows are taken out of their parts *before* they are
generated again; from then on they are simply rows not yet committed, and the ordinary commit protocol (``sink``)
commits their new attempt exactly once, across any kill. Taking rows out of part ``X`` replaces ``X`` in place:

  1. write the part without those rows to ``.X.retry.inprogress`` (hidden: readers skip it) and fsync it, and its
     new key file to ``keys-X.npy.retry``;
  2. write the journal ``_dspine/supersede-<shard>.json`` (fsynced): the part, its new commit record;
  3. ``rename`` the new file over ``X`` (atomic: a reader sees the old part or the new one, never both, never
     neither); 4. put the new key file and commit record in place; 5. fsync the directory, remove the journal.
A part left with no rows is removed instead (journal first, then the part, then its key file and record).

A crash anywhere is finished on the next start (``recover``, before anything reads the parts): with a journal, a
part whose bytes match the journal's new record rolls forward (steps 4-5), any other rolls back (the staged files
are removed; the part is as it was). ``status`` run in the instant between 3 and 4 may list ``X`` as altered;
it only reads, and the next start settles it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.pipeline.sink import (
    CHECKSUM,
    ChecksumWriter,
    file_checksum,
    fsync_dir,
    keys_checksum,
    keys_path,
    load_keys,
    read_record,
    record_path,
    write_record,
)

STATE_DIR = "_dspine"


def journal_path(outdir: str, tag: str) -> str:
    return os.path.join(outdir, STATE_DIR, f"supersede-{tag}.json")


def staged_path(outdir: str, name: str) -> str:
    return os.path.join(outdir, f".{name}.retry.inprogress")


def _write_json_durably(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def rows_kept(table: pa.Table, drop: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """(whether each output row stays, whether each input row stays, input rows in part order: the key file's and
    the commit record's key order, ``sink``) for taking the rows in ``drop`` out of a part's ``table``."""
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


def drop_rows(outdir: str, tag: str, path: str, drop: set[str]) -> int:
    """Take the rows whose ``row_id`` is in ``drop`` (all their samples) out of the committed part ``path``;
    returns how many input rows went. Call with the shard's lock held."""
    name = os.path.basename(path)
    table = pq.read_table(path)
    keep, kept_rows = rows_kept(table, drop)
    if keep.all():
        return 0
    rows = int(kept_rows.sum())
    gone = len(kept_rows) - rows
    journal = journal_path(outdir, tag)
    if not keep.any():
        _write_json_durably(journal, {"part": name, "remove": True})
        _unlink(path)
        fsync_dir(outdir)
        _finish(outdir, name, None)
        _unlink(journal)
        return gone
    old = read_record(outdir, name) or {}
    kept = without_rows(table, keep, rows)
    staged = staged_path(outdir, name)
    with open(staged, "wb") as f:
        w = ChecksumWriter(f)
        pq.write_table(kept, w, compression="zstd", row_group_size=256 * 1024)
        f.flush()
        os.fsync(f.fileno())
    record = {"part": name, "rows": rows, "outputs": kept.num_rows, "bytes": w.size, CHECKSUM: w.crc,
              "committed_at": old.get("committed_at", time.time()), "superseded_at": time.time()}
    keys = load_keys(outdir, name, len(kept_rows), old or None)
    if keys is not None:
        keys = keys[kept_rows]
        record["keys_crc32"] = keys_checksum(keys)
        with open(keys_path(outdir, name) + ".retry", "wb") as f:
            np.save(f, keys.astype("<u8"), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
    _write_json_durably(journal, {"part": name, "record": record})
    os.replace(staged, path)
    fsync_dir(outdir)
    _finish(outdir, name, record)
    _unlink(journal)
    return gone


def _finish(outdir: str, name: str, record: dict[str, Any] | None) -> None:
    """Steps 4-5: the new key file and record in place (``record`` None: the part was removed: drop both)."""
    keys = keys_path(outdir, name)
    if record is None:
        _unlink(record_path(outdir, name))
        _unlink(keys)
        _unlink(keys + ".retry")
    else:
        if os.path.exists(keys + ".retry"):
            os.replace(keys + ".retry", keys)
        elif "keys_crc32" not in record:
            _unlink(keys)  # the old key file lists rows the part no longer has: resume reads row_id instead
        write_record(outdir, name, record)
    fsync_dir(os.path.dirname(keys))


def recover(outdir: str, tag: str) -> str | None:
    """Finish or undo a supersede a crash interrupted (see the module docstring); returns what was done."""
    journal = journal_path(outdir, tag)
    try:
        with open(journal) as f:
            entry = json.load(f)
    except FileNotFoundError:
        _sweep(outdir, tag)  # killed before its journal: the part was never touched
        return None
    except ValueError:  # torn before its rename: the part was never touched
        entry = {}
    name = entry.get("part")
    done = None
    if name:
        path = os.path.join(outdir, name)
        record = entry.get("record")
        if entry.get("remove"):
            _unlink(path)
            _finish(outdir, name, None)
            done = f"{name}: finished removing its superseded rows"
        elif record and os.path.exists(path) and os.path.getsize(path) == record["bytes"] \
                and file_checksum(path) == record[CHECKSUM]:
            _finish(outdir, name, record)
            done = f"{name}: finished replacing it without its superseded rows"
        else:
            done = f"{name}: left as it was (its superseded rows stay until the next --retry-errors)"
        _unlink(staged_path(outdir, name))
        _unlink(keys_path(outdir, name) + ".retry")  # rolled forward: already moved; rolled back: not wanted
    _unlink(journal)
    _sweep(outdir, tag)
    return done


def _sweep(outdir: str, tag: str) -> None:
    """Staged files of a supersede that never reached its journal (this shard's only)."""
    keys_dir = os.path.dirname(keys_path(outdir, f"train-{tag}-000000.parquet"))
    for d, suffix in ((outdir, ".retry.inprogress"), (keys_dir, ".npy.retry")):
        for name in os.listdir(d) if os.path.isdir(d) else ():
            if name.endswith(suffix) and tag in name:
                _unlink(os.path.join(d, name))
