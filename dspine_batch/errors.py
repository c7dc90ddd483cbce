"""Exit codes and the exceptions that map onto them.

The CLI turns these into one-line messages; anything else is a bug and may show a traceback. User mistakes
must always arrive here as one of these classes, never as a bare Python exception.
"""

from __future__ import annotations

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


class EngineDied(Exception):
    """The engine died in a way that running again is expected to fix (a worker process crashed or was
    OOM-killed, a lost device): finished rows are committed and the run exits 75 so Slurm requeues it.
    Engines raise this and only this for transient deaths; any other exception is a bug or a bad setting,
    and exits 1 so a requeue loop does not repeat a deterministic failure."""


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
