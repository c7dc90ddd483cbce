"""What every step of the exactly-once protocol shares: the OUTDIR's store, the owner's authority, the records.

``Outdir`` is the state the modules of this package work on (``commit``, ``check``, ``done``, ``compact``,
``supersede``, ``recovery``), whatever the store: a local directory or an object-store prefix
(``storage.objects.ObjectStore`` and its primitives). ``output.OutDir`` adds the run's surface (``Output``) on top.

The few places where a local disk and a store differ are properties of the store, not branches of the protocol:
``inline`` (a disk commits on the pipeline's thread: a rename is cheap and a full disk must stop the commit that
met it; a store's requests run on the committer's threads), ``verify_on_start`` (a start reads a local part's
bytes for their crc32: cheap up to ``done.crc_budget``, past it only the parts above the watermarks; on a store that
is a GET of every part, left to ``finalize`` and ``status --verify``), and the store's own ``renames``/``local_path``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.outdir.layout import KEYS, PART_RE, record_part, record_rel
from dspine_batch.outdir.records import parse_record, record_keys
from dspine_batch.storage.fs import retry_deadline
from dspine_batch.storage.objects import ObjectStore, check_outdir_url

# records fetched at a time: a start holds one batch's bytes, never every record's (~1 GB of them at 100M rows)
RECORD_BATCH = 256


class Outdir:
    """One OUTDIR's store, its lease (on an object store, while this process owns a shard) and the commit records
    this start has read."""

    def __init__(self, where: str):
        check_outdir_url(where)
        self.store = ObjectStore(where)
        self.display = self.store.display
        self.path = self.store.root  # a local OUTDIR's directory (``stages.keylog`` writes under it)
        self.remote = not self.store.local
        self.inline = self.store.local
        self.verify_on_start = self.store.local
        self.lease: Any = None  # ``storage.lease.Lease`` of the shard this process writes (object stores)
        self._records: dict[str | None, dict[str, dict[str, Any] | None]] = {}

    # -- the owner's authority -------------------------------------------------------------------------------------
    @contextmanager
    def owning(self) -> Iterator[None]:
        """A write as the shard's owner (a commit record, a record swap): refused once the lease is lost, and never
        sent or retried past the lease's validity (``storage.lease``). Without a lease (a local shard's ``flock``
        is held by the kernel until the process dies), a plain block."""
        if self.lease is None:
            yield
            return
        self.lease.check()
        with retry_deadline(self.lease.deadline):
            yield

    # -- records --------------------------------------------------------------------------------------------------
    def record_of(self, name: str) -> dict[str, Any] | None:
        """A part's commit record as the store holds it now (None when absent or unreadable)."""
        return parse_record(self.store.get(record_rel(name)))

    def records(self, tag: str | None = None) -> dict[str, dict[str, Any] | None]:
        """Every commit record (of one shard), by part name, None for one that does not read as a record: fetched
        concurrently on a store (one GET each, ``RECORD_BATCH`` at a time), once per start (a start sweeps, checks
        and loads the same records; only this worker adds or moves them meanwhile, and it forgets them when it
        does). Each is held **without its key list** (``keys_b64``: ~11 bytes a row, the bulk of a record; its
        ``keys_crc32`` stays): a start over 100M committed rows would otherwise hold ~1 GB of lists it mostly does
        not need (parts below the watermarks). ``keys_of`` reads the lists of the parts that need them."""
        if tag not in self._records:
            names = []
            for n in self.store.list(KEYS):
                part = record_part(n)
                m = PART_RE.match(part) if part else None
                if m and (tag is None or m.group(1) == tag):
                    names.append(m.group(0))
            lean: dict[str, dict[str, Any] | None] = {}
            for i in range(0, len(names), RECORD_BATCH):
                for n, rec in self._fetch(names[i:i + RECORD_BATCH]):
                    if rec is not None:
                        rec.pop("keys_b64", None)
                    lean[n] = rec
            self._records[tag] = dict(sorted(lean.items()))
        return dict(self._records[tag])

    def keys_of(self, names: list[str]) -> dict[str, np.ndarray | None]:
        """The row-key lists of these parts' records (``records.record_keys``: checked against the record's row
        count and crc32), read again because ``records`` holds records without them; None for a part whose list
        is missing or doubtful, or whose record is no longer the one this start checked (its token changed)."""
        known: dict[str, dict[str, Any] | None] = {}
        for recs in self._records.values():
            known.update(recs)
        got: dict[str, np.ndarray | None] = {}
        for i in range(0, len(names), RECORD_BATCH):
            for n, rec in self._fetch(names[i:i + RECORD_BATCH]):
                seen = known.get(n)
                same = rec is not None and (seen is None or seen.get("token") == rec.get("token"))
                got[n] = record_keys(rec) if same else None  # type: ignore[arg-type]
        return got

    def _fetch(self, names: list[str]) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """(name, parsed record) for each part name, one batch fetched concurrently; each record's bytes dropped
        as it is parsed."""
        paths = [self.store.path(record_rel(n)) for n in names]
        got = self.store.cat_many(paths)
        for n, p in zip(names, paths, strict=True):
            yield n, parse_record(got.pop(p, None))

    def forget_records(self) -> None:
        """The records this start read are stale (it committed, moved or swapped some): read them again next time."""
        self._records.clear()

    # -- parts ----------------------------------------------------------------------------------------------------
    def publish(self, record: dict[str, Any], delete: bool = True) -> None:
        """Make a committed part visible under its final name, from its staged bytes; idempotent on a store (the
        record says what and from where). ``delete=False``: a store's staged copy is left for a batched delete (or
        the next start's sweep); a disk's rename leaves none."""
        self.store.publish(record["staged"], record["part"], int(record["bytes"]))
        if delete and not self.store.renames:
            self.store.delete(record["staged"])

    def read_table(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        """A part (published or staged) read back, all of it or some columns."""
        local = self.store.local_path(rel)
        if local is not None:
            return pq.read_table(local, columns=columns)
        with self.store.open(rel) as f:
            return pq.read_table(f, columns=columns)

    def read_footer(self, rel: str) -> pq.FileMetaData:
        local = self.store.local_path(rel)
        if local is not None:
            return pq.read_metadata(local)
        with self.store.open(rel) as f:
            return pq.read_metadata(f)
