"""The storage interface under an OUTDIR: what one kind of store must answer, and nothing more.

``objects.ObjectStore`` (what the commit protocol in ``dspine_batch.outdir`` and the lease call) names objects
relative to the OUTDIR and hands every request to one ``Primitives`` implementation, picked by the -o value:
``s3.S3Primitives`` (S3's API through s3fs), ``azure.AzurePrimitives`` (Azure Blob Storage through
azure-storage-blob), or ``local.LocalPrimitives`` (a directory: the disk as one more store, with ``link``, ``flock``
and ``rename``). Adding a store means one more such class, tested against a real server of that store: the
protocol above does not change.

The contract every method keeps: transient failures (throttling, 5xx, dropped connections) are retried inside
(``fs.retrying``); a permanent one (403, no bucket or container) is ``fs.permanent``'s one line; an absent object
is an answer (None, {}, or ``FileNotFoundError`` from ``copy``/``publish``), not an error; conditional writes
return None when their condition fails. Names (``rel``) are relative to the prefix; ``cat_many`` takes full store
paths. ``durable`` asks a local disk to fsync (a store's writes are durable when answered).
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
    renames: bool  # publish moves the source (a disk's rename); False: it copies, and the source is deleted later

    # -- reads
    def get(self, rel: str) -> bytes | None: ...  # the bytes, None when absent
    def head(self, rel: str) -> dict[str, Any] | None: ...  # {"size", "etag"} straight from the store
    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None: ...  # ETag no newer than the bytes
    def names(self, rel: str) -> list[str]: ...  # everything directly under rel, "directories" too
    def list(self, rel: str) -> dict[str, Listed]: ...  # objects directly under rel (one consistent listing)
    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]: ...  # many small objects, concurrently
    def local_path(self, rel: str) -> str | None: ...  # where rel lives on this machine (a disk), else None

    # -- writes
    def put(self, rel: str, data: bytes, durable: bool = True) -> None: ...  # overwrite, whole for readers
    def upload(self, local: str, rel: str) -> None: ...  # a local file, in blocks/parts when large
    def create(self, rel: str, data: bytes, durable: bool = True, then: str = "") -> str | None: ...  # create-only
    def replace(self, rel: str, data: bytes, etag: str) -> str | None: ...  # If-Match; None when changed or gone
    def copy(self, src: str, dst: str, size: int | None = None) -> None: ...  # server-side, complete on return
    def publish(self, src: str, dst: str, size: int | None = None) -> None: ...  # src's bytes under dst, atomically
    def delete(self, rel: str) -> None: ...  # absent is fine
    def delete_many(self, rels: list[str]) -> None: ...  # batched; absent keys are fine
    def delete_tree(self, rel: str) -> None: ...  # everything under rel; absent is fine
    def check_container(self) -> None: ...  # the bucket/container exists and answers us, else one line


class RemotePrimitives:
    """What every object store shares: no rename, so publishing is a server-side copy (the staged source stays
    until a batched delete), and nothing lives on this machine."""

    renames = False

    def publish(self, src: str, dst: str, size: int | None = None) -> None:
        self.copy(src, dst, size)  # type: ignore[attr-defined]

    def local_path(self, rel: str) -> str | None:
        return None

    def delete_tree(self, rel: str) -> None:
        """A store's "folder" is flat: its listing, deleted in batches."""
        names = self.list(rel)  # type: ignore[attr-defined]
        if names:
            self.delete_many([f"{rel}/{n}" for n in names])  # type: ignore[attr-defined]
