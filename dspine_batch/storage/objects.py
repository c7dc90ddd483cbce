"""An object-store prefix (an OUTDIR URL) and the few primitives an exactly-once commit needs there.

An object store has no rename, no fsync and no ``flock``. What it has, and what this module exposes:
create-only writes (``If-None-Match: *``: the first writer wins, every other is refused), compare-and-swap
overwrites (``If-Match: <ETag>``), server-side copies, and strongly consistent listings. Every call is retried
with backoff on transient failures (``fs.retrying``); a create-only write retried after a lost answer may find
its own object already there, so ``create`` returns the existing body's ETag-less verdict and callers compare
contents (a commit record carries a unique token for exactly that).

``ObjectStore`` is the one interface the commit protocol (``pipeline.remote``) and the lease (``storage.lease``)
use; they never learn which store is behind it. The store-neutral half (names, listings, plain reads and writes,
``open``) goes through the URL's fsspec filesystem; the conditional half is one small class per store, picked by
URL scheme: ``storage.s3.S3Primitives`` (s3fs: AWS, MinIO, R2, Ceph, moto) and ``storage.azure.AzurePrimitives``
(azure-storage-blob: Azure, Azurite). A store without such a class cannot be an OUTDIR (``check_outdir_url``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from dspine_batch.errors import UsageError
from dspine_batch.storage.fs import RETRIES, filesystem, need_library, permanent, retrying, transient
from dspine_batch.storage.urls import AZURE_SCHEMES, NO_CREATE_ONLY, OUTDIR_SCHEMES, redact, scheme, strip_url


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


@dataclass
class Listed:
    name: str
    size: int
    etag: str | None = None


class Primitives(Protocol):
    """What one kind of store implements (``s3.S3Primitives``, ``azure.AzurePrimitives``): each method retries
    transient failures itself and raises ``fs.permanent``'s one line for the rest."""

    def head(self, rel: str) -> dict[str, Any] | None: ...
    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None: ...
    def create(self, rel: str, data: bytes) -> str | None: ...
    def replace(self, rel: str, data: bytes, etag: str) -> str | None: ...
    def copy(self, src: str, dst: str, size: int | None = None) -> None: ...
    def delete_many(self, rels: list[str]) -> None: ...
    def check_container(self) -> None: ...


class ObjectStore:
    """Objects under one prefix, addressed by names relative to it (``_dspine/keys/commit-X.json``)."""

    def __init__(self, url: str):
        self.url = strip_url(url)
        self.display = redact(self.url)
        self.fs, self.root = filesystem(self.url)
        self._ops: Primitives | None = None

    @property
    def ops(self) -> Primitives:
        """The conditional primitives of this URL's store (built on first use: reads need none)."""
        if self._ops is None:
            proto = scheme(self.url)
            if proto in ("s3", "s3a"):
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
        try:
            return retrying(lambda: self.fs.cat_file(self.path(rel)), self.url_of(rel))
        except FileNotFoundError:
            return None

    def head(self, rel: str) -> dict[str, Any] | None:
        """Size and ETag straight from the store (no listing cache), None when absent."""
        return self.ops.head(rel)

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) with the ETag no newer than the bytes (what a compare-and-swap of them needs)."""
        return self.ops.get_with_etag(rel)

    def names(self, rel: str = "") -> list[str]:
        """Every name directly under ``rel``, "directories" included (is this prefix someone else's?)."""
        try:
            found = retrying(lambda: self.fs.ls(self.path(rel), detail=False, refresh=True), self.url_of(rel))
        except FileNotFoundError:
            return []
        return [n.rstrip("/").rsplit("/", 1)[-1] for n in found]

    def list(self, rel: str = "") -> dict[str, Listed]:
        """Files directly under ``rel`` by name (one consistent listing; "directories" left out)."""
        try:
            entries = retrying(lambda: self.fs.ls(self.path(rel), detail=True, refresh=True), self.url_of(rel))
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            if e.get("type") == "file":
                name = e["name"].rsplit("/", 1)[-1]
                out[name] = Listed(name, int(e.get("size") or 0), e.get("ETag") or e.get("etag"))
        return out

    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]:
        """Many small objects (full store paths) fetched concurrently; a transient failure of some is retried
        for those; a missing one maps to None."""
        out: dict[str, bytes | None] = {}
        todo = list(paths)
        for attempt in range(RETRIES):
            if not todo:
                break
            got = retrying(lambda t=todo: self.fs.cat(t, on_error="return"), self.display)
            failed = []
            for p in todo:
                v = got.get(p) if isinstance(got, dict) else None
                if isinstance(v, bytes):
                    out[p] = v
                elif isinstance(v, FileNotFoundError) or v is None:
                    out[p] = None
                elif attempt == RETRIES - 1 or not transient(v):
                    raise permanent(v, self.display)
                else:
                    failed.append(p)
            todo = failed
            if todo:
                time.sleep(min(10.0, 0.2 * 2 ** attempt))
        return out

    def open(self, rel: str, mode: str = "rb") -> Any:
        return retrying(lambda: self.fs.open(self.path(rel), mode, block_size=8 << 20), self.url_of(rel))

    # -- writes ---------------------------------------------------------------------------------------------------
    def put(self, rel: str, data: bytes) -> None:
        """Plain overwrite: for advisory files (state) only, never for anything a commit depends on."""
        retrying(lambda: self.fs.pipe_file(self.path(rel), data), self.url_of(rel))

    def upload(self, local: str, rel: str) -> None:
        """A local file to ``rel`` (multipart above a few MiB, each part retried by the client)."""
        retrying(lambda: self.fs.put_file(local, self.path(rel)), self.url_of(rel))

    def create(self, rel: str, data: bytes) -> bool:
        """Create-only (``If-None-Match: *``): True when this call created it, False when it already existed
        (then the caller reads it: a retry after a lost answer finds its own write)."""
        return self.ops.create(rel, data) is not None

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Compare-and-swap (``If-Match: etag``): the new ETag, or None when the object changed (or is gone)."""
        return self.ops.replace(rel, data, etag)

    def create_etag(self, rel: str, data: bytes) -> str | None:
        """``create`` returning the new ETag (None when the object existed)."""
        return self.ops.create(rel, data)

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        """Server-side copy (no bytes through this machine); ``size``, when known, may save a request."""
        self.ops.copy(src, dst, size)

    def delete(self, rel: str) -> None:
        try:
            retrying(lambda: self.fs.rm_file(self.path(rel)), self.url_of(rel))
        except FileNotFoundError:
            pass

    def delete_many(self, rels: list[str]) -> None:
        """Batched deletes (S3: 1,000 keys a request; Azure: 256), no lookups first; absent keys are fine."""
        if rels:
            self.ops.delete_many(rels)

    def check_bucket(self) -> None:
        """Fail early and in one line when the bucket (container) is missing or not ours to write (before any
        work)."""
        self.ops.check_container()


def local_tmp_dir() -> str:
    """Where parts are built before their upload: ``$DSPINE_BATCH_TMPDIR`` or the system temp dir."""
    d = os.environ.get("DSPINE_BATCH_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    os.makedirs(d, exist_ok=True)
    return d
