"""A local shard's lock: an exclusive ``flock`` on ``_dspine/lock-<shard>``.

The kernel drops it when the process dies (even ``kill -9``), so a stale lock can never block a restart, and a
live process always blocks a second one: that start ends with ``LockedError`` (exit 75, naming the holder: a
requeue may come back once it has stopped). An object store has no ``flock``: its shards are held by a lease
(``storage.lease``); ``output.OutDir.lock`` picks the one its store has.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

from dspine_batch.errors import LockedError, disk_full_named
from dspine_batch.outdir.layout import STATE


class Lock:
    """``acquire``/``release`` (or a ``with`` block) of one shard's ``flock``."""

    def __init__(self, outdir: str, tag: str):
        self.path, self.tag = os.path.join(outdir, STATE, f"lock-{tag}"), tag
        self.fd: int | None = None

    def acquire(self) -> Lock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for attempt in range(5):  # `status` probes locks for an instant; don't mistake that for a writer
            with disk_full_named(self.path):  # creating it needs an inode
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if attempt == 4:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                    os.close(fd)
                    outdir = os.path.dirname(os.path.dirname(self.path))
                    raise LockedError(f"{outdir}: shard {self.tag} is in use by {holder}, "
                                      f"which is alive (it holds {os.path.basename(self.path)}); this start ends: "
                                      "run it again (or let the scheduler requeue it) once that one has stopped") \
                        from None
                os.close(fd)
                time.sleep(0.05)
                continue
            if _same_file(fd, self.path):  # not a file its last holder unlinked while we waited
                break
            os.close(fd)
        else:
            raise LockedError(f"{self.path}: the lock file keeps changing; is another process starting? Run again "
                              "once it has")
        self.fd = fd  # held from here: release() cleans up even if writing the holder fails
        holder = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
        with disk_full_named(self.path, lambda: 0, "the lock was released"):
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, holder, 0)
            except OSError:
                self.release()
                raise
        return self

    def release(self) -> None:
        """Unlock and remove the lock file (removed while still locked, so nobody can lock the old inode and
        think they hold the path: ``acquire`` checks that the file it locked is still the path)."""
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def held_locks(outdir: str) -> list[str]:
    """Names of lock files currently held by some process (used by --overwrite and finalize)."""
    held = []
    d = os.path.join(outdir, STATE)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not name.startswith("lock-"):
            continue
        try:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
        except FileNotFoundError:  # released meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held.append(name)
        finally:
            os.close(fd)
    return held
