"""Local outputs written before the one protocol: read as they are, their leftovers settled, never written again.

Until this layout a local disk had its own protocol: a part was committed iff it existed under its final name
(staged as ``.<part>.inprogress`` in the top folder, renamed in), its row keys were a key file
``_dspine/keys/keys-<X>.npy`` (checked against the record's ``keys_crc32``), its record was written just before the
rename, and ``--retry-errors`` replaced a part through ``.<part>.retry.inprogress`` with a journal naming the new
record (no token). Such an OUTDIR still resumes and finalizes: its parts and records are checked like any (see
``check``), the key files load the done-set, and what a crash left is settled here the way that protocol did
(a staging file was never committed: swept with its sidecars; a journal is rolled forward when the part's bytes
are the new record's, else back). Object stores never held this layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.layout import KEYS, PART_PREFIX, record_rel, stem
from dspine_batch.outdir.records import CHECKSUM, crc_of, encode, keys_checksum


def keys_rel(name: str) -> str:
    """``train-X.parquet`` -> ``_dspine/keys/keys-X.npy``."""
    return f"{KEYS}/keys-{stem(name)}.npy"


def staging_name(name: str) -> str:
    return f".{name}.inprogress"


def uncommitted(name: str, top: dict[str, Any]) -> bool:
    """Whether an old commit of ``name`` was interrupted before its rename (its staging file is still there)."""
    return staging_name(name) in top


def load_keys(out: Outdir, name: str, rows: int | None, record: dict[str, Any] | None) -> np.ndarray | None:
    """The part's old key file when it can be trusted: present, ``rows`` long, and matching the crc32 in the
    commit record when there is one; None otherwise (then ``row_id`` is read)."""
    path = out.store.local_path(keys_rel(name))
    if path is None or rows is None:
        return None
    try:
        hashes = np.load(path)
    except (OSError, ValueError):
        return None
    if len(hashes) != rows:
        return None
    if record is not None and "keys_crc32" in record and keys_checksum(hashes) != record["keys_crc32"]:
        return None
    return hashes


def sweep(out: Outdir, tag: str | None, top: dict[str, Any]) -> int:
    """Old staging files of this shard (all with None), uncommitted by that protocol's rule, removed with the key
    file and record written for them (the record first); returns how many."""
    if not out.store.local:
        return 0
    n = 0
    for name in list(top):
        if not (name.startswith(f".{PART_PREFIX}") and name.endswith(".inprogress")) or (tag and tag not in name):
            continue
        if name.endswith(".retry.inprogress"):  # an old --retry-errors' staged file: its journal is gone
            out.store.delete(name)
            continue
        part = name[1:].removesuffix(".inprogress")
        if part not in top:
            out.store.delete_many([record_rel(part), keys_rel(part)])
        out.store.delete(name)
        n += 1
    if n:
        out.forget_records()
    return n


def recover_retry(out: Outdir, entry: dict[str, Any]) -> str | None:
    """An old ``--retry-errors`` journal (its record has no token): rolled forward when the part's bytes are the
    new record's (the old key file goes: the new record's rows are read from ``row_id``), else back."""
    name, record = entry.get("part"), entry.get("record")
    if not name:
        return None
    store = out.store
    if entry.get("remove"):
        store.delete_many([name, record_rel(name), keys_rel(name)])
        done = f"{name}: finished removing its superseded rows"
    else:
        head = store.head(name)
        same = False
        if record and head is not None and head["size"] == record.get("bytes"):
            with store.open(name) as f:
                same = crc_of(f) == record.get(CHECKSUM)
        if same:
            store.delete(keys_rel(name))
            store.put(record_rel(name), encode({k: v for k, v in record.items() if k != "keys_crc32"}))
            done = f"{name}: finished replacing it without its superseded rows"
        else:
            done = f"{name}: left as it was (its superseded rows stay until the next --retry-errors)"
    store.delete_many([f".{name}.retry.inprogress", keys_rel(name) + ".retry"])
    out.forget_records()
    return done


def is_old_journal(entry: dict[str, Any]) -> bool:
    return bool(entry.get("record")) and "token" not in entry["record"]


def finish_compaction(out: Outdir, journal: dict[str, Any]) -> bool:
    """An old ``finalize --compact`` journal (no token): the merged part was staged under its old staging name
    before the journal was written; whether it is committed now (renamed in, here if need be)."""
    new = journal["new"]
    top = out.store.list("")
    if staging_name(new) in top and new not in top:
        out.store.publish(staging_name(new), new)
        return True
    return new in top


def key_files(names: list[str]) -> list[str]:
    """The old key files of parts ``names`` (removed with them)."""
    return [keys_rel(n) for n in names]

