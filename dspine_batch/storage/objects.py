"""An object-store prefix (an OUTDIR URL) and the few primitives an exactly-once commit needs there.

An object store has no rename, no fsync and no ``flock``. What it has, and what this module exposes:
create-only writes (``If-None-Match: *``: the first writer wins, every other gets 412), compare-and-swap
overwrites (``If-Match: <ETag>``), server-side copies, and strongly consistent listings. Every call is retried
with backoff on transient failures (``fs.retrying``); a create-only write retried after a lost answer may find
its own object already there, so ``create`` returns the existing body's ETag-less verdict and callers compare
contents (a commit record carries a unique token for exactly that).

Implemented for S3's API through s3fs (AWS, MinIO, R2, Ceph and moto all answer ``If-None-Match``/``If-Match``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from dspine_batch.errors import FatalError, UsageError
from dspine_batch.storage.fs import RETRIES, filesystem, need_library, permanent, retrying, store_errors, transient
from dspine_batch.storage.urls import NO_CREATE_ONLY, OUTDIR_SCHEMES, redact, scheme, strip_url


def check_outdir_url(url: str) -> None:
    """Refuse, in one line that says why, a URL whose store cannot hold an exactly-once OUTDIR."""
    proto = scheme(url)
    if proto is None or proto in OUTDIR_SCHEMES:
        if proto is not None:
            need_library(url)
        return
    why = NO_CREATE_ONLY.get(proto, "its store is not known to support create-if-absent writes")
    raise UsageError(f"{redact(url)}: cannot be an output directory: {why}; write to s3:// (or a local path) "
                     "and copy the finished output there")


@dataclass
class Listed:
    name: str
    size: int
    etag: str | None = None


class ObjectStore:
    """Objects under one prefix, addressed by names relative to it (``_dspine/keys/commit-X.json``)."""

    def __init__(self, url: str):
        self.url = strip_url(url)
        self.display = redact(self.url)
        self.fs, self.root = filesystem(self.url)

    # -- naming ---------------------------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        return f"{self.display}/{rel}" if rel else self.display

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        return bucket, key

    # -- reads ----------------------------------------------------------------------------------------------------
    def get(self, rel: str) -> bytes | None:
        """The object's bytes, None when there is none."""
        try:
            return retrying(lambda: self.fs.cat_file(self.path(rel)), self.url_of(rel))
        except FileNotFoundError:
            return None

    def head(self, rel: str) -> dict[str, Any] | None:
        """Size and ETag straight from the store (no listing cache), None when absent."""
        bucket, key = self._bucket_key(rel)
        try:
            out = retrying(lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=key), self.url_of(rel))
        except FileNotFoundError:
            return None
        return {"size": int(out.get("ContentLength", 0)), "etag": out.get("ETag")}

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) read so that the ETag is no newer than the bytes: HEAD first, then GET with
        ``If-Match`` on it; a change in between makes the GET fail and the pair is read again."""
        for _ in range(10):
            meta = self.head(rel)
            if meta is None:
                return None
            try:
                body = retrying(lambda m=meta: self._get_if_match(rel, m["etag"]), self.url_of(rel))
            except FileNotFoundError:
                return None
            except FileExistsError:  # 412: changed between HEAD and GET
                continue
            return body, meta["etag"]
        return None

    def _get_if_match(self, rel: str, etag: str) -> bytes:
        bucket, key = self._bucket_key(rel)

        async def read() -> bytes:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, IfMatch=etag)
            async with resp["Body"] as body:
                return await body.read()

        from fsspec.asyn import sync

        return sync(self.fs.loop, read)

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
                out[name] = Listed(name, int(e.get("size") or 0), e.get("ETag"))
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
        bucket, key = self._bucket_key(rel)
        try:
            retrying(lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"),
                     self.url_of(rel))
        except FileExistsError:
            return False
        return True

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Compare-and-swap (``If-Match: etag``): the new ETag, or None when the object changed (or is gone)."""
        bucket, key = self._bucket_key(rel)
        try:
            out = retrying(lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag),
                           self.url_of(rel))
        except (FileExistsError, FileNotFoundError):
            return None
        return out.get("ETag")

    def create_etag(self, rel: str, data: bytes) -> str | None:
        """``create`` returning the new ETag (None when the object existed)."""
        bucket, key = self._bucket_key(rel)
        try:
            out = retrying(lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                                   IfNoneMatch="*"), self.url_of(rel))
        except FileExistsError:
            return None
        return out.get("ETag")

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        """Server-side copy (no bytes through this machine): one CopyObject request when the size is known to be
        under S3's 5 GiB single-copy limit, else s3fs's copy (which looks the source up and copies in parts)."""
        if size is not None and size < 5 << 30:
            bucket, key = self._bucket_key(dst)
            sb, sk = self._bucket_key(src)
            retrying(lambda: self.fs.call_s3("copy_object", Bucket=bucket, Key=key,
                                             CopySource={"Bucket": sb, "Key": sk}), self.url_of(dst))
            return
        retrying(lambda: self.fs.copy(self.path(src), self.path(dst)), self.url_of(dst))

    def delete(self, rel: str) -> None:
        try:
            retrying(lambda: self.fs.rm_file(self.path(rel)), self.url_of(rel))
        except FileNotFoundError:
            pass

    def delete_many(self, rels: list[str]) -> None:
        """DeleteObjects, 1,000 keys a request (s3fs's ``rm`` would first look each path up); absent keys are fine."""
        if not rels:
            return
        bucket, _ = self._bucket_key(rels[0])
        keys = [self._bucket_key(r)[1] for r in rels]
        for i in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[i:i + 1000]]
            retrying(lambda c=chunk: self.fs.call_s3("delete_objects", Bucket=bucket,
                                                     Delete={"Objects": c, "Quiet": True}), self.url_of(rels[0]))

    def check_bucket(self) -> None:
        """Fail early and in one line when the bucket is missing or not ours to write (before any work)."""
        bucket, _ = self._bucket_key("x")
        with store_errors(self.display):
            try:
                retrying(lambda: self.fs.call_s3("head_bucket", Bucket=bucket), self.display)
            except FileNotFoundError:
                raise FatalError(f"{self.display}: no such bucket ({bucket}); create it first or fix the URL") \
                    from None


def local_tmp_dir() -> str:
    """Where parts are built before their upload: ``$DSPINE_BATCH_TMPDIR`` or the system temp dir."""
    d = os.environ.get("DSPINE_BATCH_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    os.makedirs(d, exist_ok=True)
    return d
