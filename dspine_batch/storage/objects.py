"""An OUTDIR's store (an object-store prefix, or a local directory) and the few primitives an exactly-once commit
needs there.

An object store has no rename, no fsync and no ``flock``. What it has, and what this module exposes:
create-only writes (``If-None-Match: *``: the first writer wins, every other is refused), compare-and-swap
overwrites (``If-Match: <ETag>``), server-side copies, and strongly consistent listings. Every call is retried
with backoff on transient failures (``fs.retrying``); a create-only write retried after a lost answer may find
its own object already there, so ``create`` returns the existing body's ETag-less verdict and callers compare
contents (a commit record carries a unique token for exactly that).

``ObjectStore`` is the one interface the commit protocol (``dspine_batch.outdir``) and the lease (``storage.lease``)
use; they never learn which store is behind it. It names objects relative to the prefix and hands each request
to one ``primitives.Primitives`` implementation, picked by the -o value: ``storage.s3.S3Primitives`` (s3fs: AWS,
MinIO, R2, Ceph, moto), ``storage.azure.AzurePrimitives`` (azure-storage-blob: Azure, Azurite), or, for a local
path, ``storage.local.LocalPrimitives`` (the disk as one more store: ``link``, ``flock``, ``rename``); only
``open`` (reading a part back) is fsspec's for every object store. A store without such a class cannot be an
OUTDIR (``check_outdir_url``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from dspine_batch.errors import UsageError
from dspine_batch.storage.fs import filesystem, need_library, retrying
from dspine_batch.storage.primitives import Listed, Primitives
from dspine_batch.storage.urls import (
    AZURE_SCHEMES,
    NO_CREATE_ONLY,
    OUTDIR_SCHEMES,
    is_url,
    local_path,
    redact,
    scheme,
    strip_url,
)


def check_outdir_url(url: str) -> None:
    """Refuse, in one line that says why, a URL whose store cannot hold an exactly-once OUTDIR."""
    proto = scheme(url)
    if proto is None or proto in OUTDIR_SCHEMES:
        if proto is not None:
            need_library(url)
        return
    why = NO_CREATE_ONLY.get(proto, "its store is not known to support create-if-absent writes")
    raise UsageError(f"{redact(url)}: cannot be an output directory: {why}; write to s3:// or az:// (or a local "
                     "path) and copy the finished output there")


__all__ = ["Listed", "ObjectStore", "Primitives", "check_outdir_url", "local_tmp_dir"]


class ObjectStore:
    """Objects under one prefix, addressed by names relative to it (``_dspine/keys/commit-X.json``): an object-store
    URL, or a local directory (``local``)."""

    def __init__(self, where: str):
        self.local = not is_url(where)
        if self.local:
            self.url = self.root = self.display = os.path.abspath(local_path(where))
            self.fs: Any = None
        else:
            self.url = strip_url(where)
            self.display = redact(self.url)
            self.fs, self.root = filesystem(self.url)
        self._ops: Primitives | None = None

    @property
    def ops(self) -> Primitives:
        """The primitives of this URL's store, by scheme (built on first use)."""
        if self._ops is None:
            proto = scheme(self.url)
            if self.local:
                from dspine_batch.storage.local import LocalPrimitives

                self._ops = LocalPrimitives(self.root, self.url_of)
            elif proto in ("s3", "s3a"):
                from dspine_batch.storage.s3 import S3Primitives

                self._ops = S3Primitives(self.fs, self.path, self.url_of, self.display)
            elif proto in AZURE_SCHEMES:
                from dspine_batch.storage.azure import AzurePrimitives

                self._ops = AzurePrimitives(self.fs, self.path, self.url_of, self.display)
            else:
                check_outdir_url(self.url)
                raise UsageError(f"{self.display}: no create-only writes are implemented for this store")
        return self._ops

    # -- naming ---------------------------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        return f"{self.display}/{rel}" if rel else self.display

    # -- reads ----------------------------------------------------------------------------------------------------
    def get(self, rel: str) -> bytes | None:
        """The object's bytes, None when there is none."""
        return self.ops.get(rel)

    def head(self, rel: str) -> dict[str, Any] | None:
        """Size and ETag straight from the store (no listing cache), None when absent."""
        return self.ops.head(rel)

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) with the ETag no newer than the bytes (what a compare-and-swap of them needs)."""
        return self.ops.get_with_etag(rel)

    def names(self, rel: str = "") -> list[str]:
        """Every name directly under ``rel``, "directories" included (is this prefix someone else's?)."""
        return self.ops.names(rel)

    def list(self, rel: str = "") -> dict[str, Listed]:
        """Files directly under ``rel`` by name (one consistent listing; "directories" left out)."""
        return self.ops.list(rel)

    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]:
        """Many small objects (full store paths, ``path(rel)``) fetched concurrently; a missing one maps to None."""
        return self.ops.cat_many(paths)

    def open(self, rel: str, mode: str = "rb") -> Any:
        """A read-ahead buffered file object (fsspec's on a store): for reading parts back (checksums, row ids,
        retries)."""
        if self.local:
            return open(self.path(rel), mode)  # noqa: SIM115 - the caller closes it
        return retrying(lambda: self.fs.open(self.path(rel), mode, block_size=8 << 20), self.url_of(rel))

    @property
    def renames(self) -> bool:
        """Whether ``publish`` moves its source (a disk's rename) rather than copying it (a store)."""
        return self.ops.renames

    def local_path(self, rel: str) -> str | None:
        """Where ``rel`` lives on this machine (a local OUTDIR), None on an object store."""
        return self.ops.local_path(rel)

    # -- writes ---------------------------------------------------------------------------------------------------
    def put(self, rel: str, data: bytes, durable: bool = True) -> None:
        """Overwrite, whole for readers: for journals and advisory files, never for a commit record.
        ``durable=False``: a local disk need not fsync it (advisory state)."""
        self.ops.put(rel, data, durable)

    def upload(self, local: str, rel: str) -> None:
        """A local file to ``rel`` (in parts or blocks above a few MiB, each retried by the client)."""
        self.ops.upload(local, rel)

    def create(self, rel: str, data: bytes, durable: bool = True, then: str = "") -> bool:
        """Create-only (``If-None-Match: *``): True when this call created it, False when it already existed
        (then the caller reads it: a retry after a lost answer finds its own write). ``then``: what a full local
        disk's one line says became of the write."""
        return self.ops.create(rel, data, durable, then) is not None

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Compare-and-swap (``If-Match: etag``): the new ETag, or None when the object changed (or is gone)."""
        return self.ops.replace(rel, data, etag)

    def create_etag(self, rel: str, data: bytes) -> str | None:
        """``create`` returning the new ETag (None when the object existed)."""
        return self.ops.create(rel, data)

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        """Server-side copy (no bytes through this machine), complete on return; ``size``, when known, may save
        a request."""
        self.ops.copy(src, dst, size)

    def publish(self, src: str, dst: str, size: int | None = None) -> None:
        """``src``'s bytes under ``dst``, atomically for readers: a rename on a disk (``src`` is gone after), a
        server-side copy on a store (``src`` stays, for a batched delete)."""
        self.ops.publish(src, dst, size)

    def move(self, src: str, dst: str) -> None:
        """``src`` to ``dst``: a rename on a disk, a copy then a delete on a store."""
        self.ops.publish(src, dst)
        if not self.ops.renames:
            self.ops.delete(src)

    def delete(self, rel: str) -> None:
        """One object; absent is fine."""
        self.ops.delete(rel)

    def delete_many(self, rels: list[str]) -> None:
        """Batched deletes (S3: 1,000 keys a request; Azure: 256), no lookups first; absent keys are fine."""
        if rels:
            self.ops.delete_many(rels)

    def delete_tree(self, rel: str) -> None:
        """Everything under ``rel`` (a stage's dedup key log); absent is fine."""
        self.ops.delete_tree(rel)

    def check_bucket(self) -> None:
        """Fail early and in one line when the bucket (container) is missing or not ours to write (before any
        work)."""
        self.ops.check_container()


    def check_conditional_writes(self) -> None:
        """Once a start (four small requests): the store must refuse a second create-only write of one object
        (``If-None-Match: *``) and a compare-and-swap on a stale ETag (``If-Match``). They are the fence between two
        workers (commit records, the lease) and the swap of a record; an S3-compatible store (or a proxy before it)
        that ignores them answers 200 and silently loses exactly-once, so such a store is refused as an OUTDIR."""
        rel = f"_dspine/probe-{uuid.uuid4().hex}"
        first = uuid.uuid4().hex.encode()
        why = None
        try:
            if self.create_etag(rel, first) is None and self.get(rel) != first:
                why = "a create-only write of a new, uniquely named object was refused"
            elif self.create(rel, b"second"):
                why = "a second create-only write (If-None-Match: *) of one object succeeded instead of failing"
            elif self.replace(rel, b"third", '"0-dspine-stale-etag"') is not None:
                why = "a compare-and-swap on a stale ETag (If-Match) succeeded instead of failing"
        finally:
            self.delete(rel)
        if why is not None:
            raise UsageError(f"{self.display}: cannot be an output directory: {why}, so two workers could both "
                             "commit (this store, or a proxy in front of it, ignores conditional writes); write to a "
                             "store that honours them, or to a local path")


def local_tmp_dir() -> str:
    """Where parts are built before their upload: ``$DSPINE_BATCH_TMPDIR`` or the system temp dir."""
    d = os.environ.get("DSPINE_BATCH_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    os.makedirs(d, exist_ok=True)
    return d
