"""The primitives of an exactly-once OUTDIR (``primitives.Primitives``) on a local disk: the disk as one more store.

Like Delta Lake's LogStore over HDFS, a POSIX directory answers the same few requests an object store does, with
the filesystem's own atomic steps:

- create-only (``If-None-Match: *``): the bytes go to a temp file, which is then hard-linked to the name; ``link``
  fails when the name exists, so of two creators exactly one wins and nobody ever sees a half-written object;
- compare-and-swap (``If-Match``): under an exclusive ``flock`` of the object's directory, the object's ETag (its
  inode, size and mtime in nanoseconds: every write here is a new inode, renamed in) is compared, then a temp file
  renamed over it;
- publish: ``rename`` (atomic for readers), then an fsync of the directory; the source is gone afterwards
  (``renames``), so unlike a store's server-side copy it leaves nothing to delete;
- a part is built where it is staged (``local_path``): no upload, no second copy of its bytes.

Durability is explicit, as a local disk needs it and a store does not: ``durable`` writes are fsynced (file and
directory), the others are not (a commit record, the advisory state: see ``dspine_batch.outdir.commit`` for why a
lost record is safe). A full disk (ENOSPC, EDQUOT) is named in one line (``errors.disk_full_named``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from dspine_batch.errors import disk_full_named
from dspine_batch.storage.primitives import Listed


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def etag_of(st: os.stat_result) -> str:
    """A local object's ETag: a write here always makes a new inode (temp file renamed or linked in), so inode,
    size and mtime change with every version."""
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def size_of(path: str) -> int:
    """Bytes that reached a file (what a full disk let through), 0 when it is gone."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class LocalPrimitives:
    """The requests on one local directory (``root``, absolute); names (``rel``) are relative to it."""

    renames = True  # publish moves the staged file: nothing is left to delete

    def __init__(self, root: str, url_of: Callable[[str], str]):
        self.root, self.url_of = root, url_of

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def local_path(self, rel: str) -> str:
        """Where ``rel`` lives on this machine: a part is written there directly, never uploaded."""
        return self.path(rel)

    # -- reads ----------------------------------------------------------------------------------------------------
    def get(self, rel: str) -> bytes | None:
        try:
            with open(self.path(rel), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def head(self, rel: str) -> dict[str, Any] | None:
        try:
            st = os.stat(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return {"size": st.st_size, "etag": etag_of(st)}

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """Bytes and ETag of one inode (read from the descriptor that ``fstat`` describes)."""
        try:
            with open(self.path(rel), "rb") as f:
                return f.read(), etag_of(os.fstat(f.fileno()))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def names(self, rel: str) -> list[str]:
        try:
            return os.listdir(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list(self, rel: str) -> dict[str, Listed]:
        out = {}
        try:
            with os.scandir(self.path(rel)) as it:
                for e in it:
                    try:
                        if e.is_file(follow_symlinks=False):
                            st = e.stat(follow_symlinks=False)
                            out[e.name] = Listed(e.name, st.st_size, etag_of(st))
                    except FileNotFoundError:  # removed while listed
                        continue
        except (FileNotFoundError, NotADirectoryError):
            pass
        return out

    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        for p in paths:
            try:
                with open(p, "rb") as f:
                    out[p] = f.read()
            except FileNotFoundError:
                out[p] = None
        return out

    def open(self, rel: str, mode: str = "rb") -> Any:
        return open(self.path(rel), mode)  # noqa: SIM115 - the caller closes it

    # -- writes ---------------------------------------------------------------------------------------------------
    def _temp(self, path: str) -> str:
        """A hidden name beside ``path`` (readers and ``*.parquet`` globs skip "." names)."""
        head, tail = os.path.split(path)
        return os.path.join(head, f".{tail}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")

    def _write_temp(self, path: str, data: bytes, durable: bool, then: str = "") -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._temp(path)
        try:
            with disk_full_named(path, lambda: size_of(tmp), then):
                with open(tmp, "wb") as f:
                    f.write(data)
                    if durable:
                        f.flush()
                        os.fsync(f.fileno())
        except BaseException:
            unlink_quietly(tmp)
            raise
        return tmp

    def put(self, rel: str, data: bytes, durable: bool = True) -> None:
        """Temp file, then rename over: a reader sees the old bytes or the new, never a mix."""
        path = self.path(rel)
        tmp = self._write_temp(path, data, durable)
        try:
            with disk_full_named(path, lambda: len(data)):
                os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        if durable:
            fsync_dir(os.path.dirname(path))

    def upload(self, local: str, rel: str) -> None:
        """A file of this machine put in place whole (copied beside its name, fsynced, renamed over); the file stays,
        as a store's upload leaves it. A part is never uploaded here: it is built where it is staged."""
        self._copy_in(local, rel)

    def create(self, rel: str, data: bytes, durable: bool = True, then: str = "") -> str | None:
        """Create-only: a complete temp file hard-linked to the name (``link`` refuses an existing name); the ETag,
        None when the object existed."""
        path = self.path(rel)
        tmp = self._write_temp(path, data, durable, then)
        try:
            with disk_full_named(path, lambda: len(data), then):
                os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            unlink_quietly(tmp)
        if durable:
            fsync_dir(os.path.dirname(path))
        head = self.head(rel)
        return head["etag"] if head else ""

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Compare-and-swap under an exclusive ``flock`` of the object's directory: the new ETag, None when the
        object changed or is gone."""
        path = self.path(rel)
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            now = self.head(rel)
            if now is None or now["etag"] != etag:
                return None
            self.put(rel, data)
            new = self.head(rel)
            return new["etag"] if new else ""
        finally:
            os.close(fd)  # drops the flock

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        self._copy_in(self.path(src), dst)

    def _copy_in(self, source: str, rel: str) -> None:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._temp(path)
        try:
            with disk_full_named(path, lambda: size_of(tmp)):
                shutil.copyfile(source, tmp)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        fsync_dir(os.path.dirname(path))

    def publish(self, src: str, dst: str, size: int | None = None) -> None:
        """``rename`` (atomic for readers), then an fsync of the directory; ``FileNotFoundError`` when the source
        is gone."""
        path = self.path(dst)
        with disk_full_named(path, lambda: size or 0):
            try:
                os.rename(self.path(src), path)
            except FileNotFoundError:
                if not os.path.exists(self.path(src)):
                    raise
                os.makedirs(os.path.dirname(path), exist_ok=True)  # a first move into a new folder
                os.rename(self.path(src), path)
        fsync_dir(os.path.dirname(path))

    def delete(self, rel: str) -> None:
        unlink_quietly(self.path(rel))

    def delete_many(self, rels: list[str]) -> None:
        for rel in rels:
            unlink_quietly(self.path(rel))

    def delete_tree(self, rel: str) -> None:
        shutil.rmtree(self.path(rel), ignore_errors=True)

    def check_container(self) -> None:
        os.makedirs(self.root, exist_ok=True)
