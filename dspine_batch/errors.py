"""Exit codes and the exceptions that map onto them.

The CLI turns these into one-line messages; anything else is a bug and may show a traceback. User mistakes
must always arrive here as one of these classes, never as a bare Python exception.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_USAGE = 2
EXIT_ERROR_BUDGET = 3
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: run the same command again to resume


class BatchError(Exception):
    """Base class: carries the exit code the CLI should return."""

    exit_code = EXIT_FATAL


class UsageError(BatchError):
    """Bad options, unreadable inputs, a config that cannot work: exit 2 before any work is done."""

    exit_code = EXIT_USAGE


class FingerprintMismatch(UsageError):
    """OUTDIR holds a run with different inputs or settings; resuming would mix two runs."""


class LockedError(UsageError):
    """Another process holds the lock on this OUTDIR (and shard)."""


class FatalError(BatchError):
    """Unrecoverable failure (engine load, disk full, --on-error fail tripped)."""

    exit_code = EXIT_FATAL


class DiskFull(FatalError):
    """ENOSPC or EDQUOT while writing output, the manifest, the lock or the state file. Exit 1, not 75:
    running again before space is freed fails the same way (a requeue loop would spin); once it is freed, the
    same command resumes, because whatever was being written when the disk filled was never committed."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"  # unreachable


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent), None when unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


@contextmanager
def disk_full_named(path: str, written: Callable[[], int] = lambda: 0, then: str = "") -> Iterator[None]:
    """Turn ENOSPC/EDQUOT inside the block into one ``DiskFull`` line naming ``path`` and how much of it was
    written (a bare "[Errno 28] No space left on device" names neither). Other errors pass unchanged.
    ``then`` says what became of the write, e.g. "the part was not committed"."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        what = "disk quota exceeded" if e.errno == errno.EDQUOT else "no space left on device"
        free = free_bytes(os.path.dirname(path) or ".")
        room = f", {human_bytes(free)} free" if free is not None else ""
        then = f"; {then}" if then else ""
        raise DiskFull(f"{path}: {what} after writing {human_bytes(written())}{room}{then}; free space (or raise "
                       "the quota) and run the same command again to resume") from e


class EngineDied(Exception):
    """The engine died in a way that running again is expected to fix (a worker process crashed or was
    OOM-killed, a lost device): finished rows are committed and the run exits 75 so Slurm requeues it.
    Engines raise this and only this for transient deaths; any other exception is a bug or a bad setting,
    and exits 1 so a requeue loop does not repeat a deterministic failure. A death that repeats on the same rows
    is told apart by the pipeline (``pipeline.deaths``): the rows in flight (``in_flight``, set by the scheduler)
    run alone on the next start, and one the engine dies on again becomes an error row."""

    in_flight: list[str] = []  # row ids in flight when it died (``pipeline.scheduler`` sets it)


class Interrupted(BaseException):
    """Raised when the grace budget after a stop signal runs out; BaseException so no handler swallows it."""


class RowError(Exception):
    """A problem with one input row. Becomes a ``status=error`` output row (or stops the job with fail).

    The message names the file, the row and the field so a user can find and fix it.
    """

    def __init__(self, file: str, row: int, field: str | None, message: str):
        self.file, self.row, self.field, self.message = file, row, field, message
        where = f"{file}: row {row}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")
