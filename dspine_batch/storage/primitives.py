"""The storage interface under an object-store OUTDIR: what one kind of store must answer, and nothing more.

``objects.ObjectStore`` (what the commit protocol and the lease call) names objects relative to the OUTDIR prefix
and hands every request to one ``Primitives`` implementation, picked by URL scheme: ``s3.S3Primitives`` (S3's API
through s3fs) or ``azure.AzurePrimitives`` (Azure Blob Storage through azure-storage-blob). Adding a store means one
more such class, tested against a real server of that store: the protocol above does not change.

The contract every method keeps: transient failures (throttling, 5xx, dropped connections) are retried inside
(``fs.retrying``); a permanent one (403, no bucket or container) is ``fs.permanent``'s one line; an absent object
is an answer (None, {}, or ``FileNotFoundError`` from ``copy``), not an error; conditional writes return None when
their condition fails. Names (``rel``) are relative to the prefix; ``cat_many`` takes full store paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Listed:
    """One object of a listing: its name under the listed prefix, its size, and its ETag when the store gave one."""

    name: str
    size: int
    etag: str | None = None


class Primitives(Protocol):
    # -- reads
    def get(self, rel: str) -> bytes | None: ...  # the bytes, None when absent
    def head(self, rel: str) -> dict[str, Any] | None: ...  # {"size", "etag"} straight from the store
    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None: ...  # ETag no newer than the bytes
    def names(self, rel: str) -> list[str]: ...  # everything directly under rel, "directories" too
    def list(self, rel: str) -> dict[str, Listed]: ...  # objects directly under rel (one consistent listing)
    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]: ...  # many small objects, concurrently

    # -- writes
    def put(self, rel: str, data: bytes) -> None: ...  # plain overwrite (advisory files only)
    def upload(self, local: str, rel: str) -> None: ...  # a local file, in blocks/parts when large
    def create(self, rel: str, data: bytes) -> str | None: ...  # If-None-Match: *; the new ETag, None if it existed
    def replace(self, rel: str, data: bytes, etag: str) -> str | None: ...  # If-Match; None when changed or gone
    def copy(self, src: str, dst: str, size: int | None = None) -> None: ...  # server-side, complete on return
    def delete(self, rel: str) -> None: ...  # absent is fine
    def delete_many(self, rels: list[str]) -> None: ...  # batched; absent keys are fine
    def check_container(self) -> None: ...  # the bucket/container exists and answers us, else one line
