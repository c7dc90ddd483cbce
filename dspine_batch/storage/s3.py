"""The primitives of an exactly-once OUTDIR (``primitives.Primitives``) on S3's API, through s3fs.

AWS, MinIO, R2, Ceph and moto answer ``If-None-Match: *`` (create-only) and ``If-Match: <ETag>`` (compare-and-swap)
on PutObject, ``If-Match`` on GetObject, CopyObject (server-side) and DeleteObjects (1,000 keys a request): those
go to botocore through ``fs.call_s3``; plain reads, listings and uploads are s3fs's own (opened without a listings
cache, ``fs._defaults``). ``storage.objects.ObjectStore`` picks this class for ``s3://``/``s3a://`` URLs.

Every call retries transient failures (``fs.retrying``) and raises what it classifies: a 412 as
``FileExistsError`` (s3fs already turns it into one for some calls; ``precondition_failed`` catches the others),
a missing key as ``FileNotFoundError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dspine_batch.errors import FatalError
from dspine_batch.storage.fs import RETRIES, permanent, retrying, store_errors, transient
from dspine_batch.storage.primitives import Listed, RemotePrimitives


class S3Primitives(RemotePrimitives):
    """The requests on one S3 prefix (``fs`` an s3fs filesystem, ``path``/``url_of`` the store's naming of a
    name relative to the prefix, ``display`` the redacted URL)."""

    def __init__(self, fs: Any, path: Callable[[str], str], url_of: Callable[[str], str], display: str):
        self.fs, self.path, self.url_of, self.display = fs, path, url_of, display

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        return bucket, key

    # -- reads and writes through s3fs ----------------------------------------------------------------------------
    def get(self, rel: str) -> bytes | None:
        try:
            # one GET: s3fs otherwise asks the size first (a HEAD) to read a large object in concurrent ranges, a
            # second request for every small object read here (records, the dedup key log, the manifest)
            return retrying(lambda: self.fs.cat_file(self.path(rel), max_concurrency=1), self.url_of(rel))
        except FileNotFoundError:
            return None

    def _ls(self, rel: str, detail: bool) -> list[Any]:
        try:
            return retrying(lambda: self.fs.ls(self.path(rel), detail=detail, refresh=True), self.url_of(rel))
        except FileNotFoundError:
            return []

    def names(self, rel: str) -> list[str]:
        return [n.rstrip("/").rsplit("/", 1)[-1] for n in self._ls(rel, False)]

    def list(self, rel: str) -> dict[str, Listed]:
        out = {}
        for e in self._ls(rel, True):
            if e.get("type") == "file":
                name = e["name"].rsplit("/", 1)[-1]
                out[name] = Listed(name, int(e.get("size") or 0), e.get("ETag"))
        return out

    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]:
        """s3fs's concurrent ``cat``; the transient failures among the answers are fetched again, alone."""
        out: dict[str, bytes | None] = {}
        todo = list(paths)
        for attempt in range(RETRIES):
            if not todo:
                break
            # max_concurrency=1: one GET an object, as ``get`` (s3fs asks each object's size first otherwise)
            got = retrying(lambda t=todo: self.fs.cat(t, on_error="return", max_concurrency=1), self.display)
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

    def put(self, rel: str, data: bytes, durable: bool = True) -> None:
        retrying(lambda: self.fs.pipe_file(self.path(rel), data), self.url_of(rel))

    def upload(self, local: str, rel: str) -> None:
        """Multipart above a few MiB, each part retried by the client."""
        retrying(lambda: self.fs.put_file(local, self.path(rel)), self.url_of(rel))

    def delete(self, rel: str) -> None:
        try:
            retrying(lambda: self.fs.rm_file(self.path(rel)), self.url_of(rel))
        except FileNotFoundError:
            pass

    # -- conditional requests, straight to botocore ---------------------------------------------------------------
    def head(self, rel: str) -> dict[str, Any] | None:
        bucket, key = self._bucket_key(rel)
        try:
            out = retrying(lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=key), self.url_of(rel))
        except FileNotFoundError:
            return None
        return {"size": int(out.get("ContentLength", 0)), "etag": out.get("ETag")}

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """HEAD first, then GET with ``If-Match`` on its ETag (so the ETag is no newer than the bytes); a change in
        between makes the GET fail with 412 and the pair is read again."""
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

    def create(self, rel: str, data: bytes, durable: bool = True, then: str = "") -> str | None:
        """PutObject with ``If-None-Match: *``: the new ETag ("" when the store sent none), None on 412."""
        bucket, key = self._bucket_key(rel)
        try:
            out = retrying(lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                                   IfNoneMatch="*"), self.url_of(rel))
        except FileExistsError:
            return None
        return out.get("ETag") or ""

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """PutObject with ``If-Match: etag``: the new ETag, None when the object changed or is gone."""
        bucket, key = self._bucket_key(rel)
        try:
            out = retrying(lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag),
                           self.url_of(rel))
        except (FileExistsError, FileNotFoundError):
            return None
        return out.get("ETag") or ""

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        """One CopyObject request when the size is known to be under S3's 5 GiB single-copy limit, else s3fs's
        copy (which looks the source up and copies in parts)."""
        if size is not None and size < 5 << 30:
            bucket, key = self._bucket_key(dst)
            sb, sk = self._bucket_key(src)
            retrying(lambda: self.fs.call_s3("copy_object", Bucket=bucket, Key=key,
                                             CopySource={"Bucket": sb, "Key": sk}), self.url_of(dst))
            return
        retrying(lambda: self.fs.copy(self.path(src), self.path(dst)), self.url_of(dst))

    def delete_many(self, rels: list[str]) -> None:
        """DeleteObjects, 1,000 keys a request (s3fs's ``rm`` would first look each path up)."""
        bucket, _ = self._bucket_key(rels[0])
        keys = [self._bucket_key(r)[1] for r in rels]
        for i in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[i:i + 1000]]
            retrying(lambda c=chunk: self.fs.call_s3("delete_objects", Bucket=bucket,
                                                     Delete={"Objects": c, "Quiet": True}), self.url_of(rels[0]))

    def check_container(self) -> None:
        """HeadBucket: one line for a missing bucket or a 403, before any work."""
        bucket, _ = self._bucket_key("x")
        with store_errors(self.display):
            try:
                retrying(lambda: self.fs.call_s3("head_bucket", Bucket=bucket), self.display)
            except FileNotFoundError:
                raise FatalError(f"{self.display}: no such bucket ({bucket}); create it first or fix the URL") \
                    from None
