"""Exit codes and the exceptions that map onto them.

The CLI turns these into one-line messages; anything else is a bug and may show a traceback. User mistakes
must always arrive here as one of these classes, never as a bare Python exception.
"""

from __future__ import annotations

import errno
import os
import re
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


class LockedError(BatchError):
    """A live worker holds this OUTDIR's shard (its local lock, or its object-store lease, renewed while we
    watched). Exit 75, not 2: nothing is wrong with the command, the shard is busy; run again (or let the scheduler
    requeue it) once that worker has stopped, and it resumes. A dead holder never raises this: its lock is freed
    by the kernel, its lease taken over (``storage.lease``)."""

    exit_code = EXIT_INTERRUPTED


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
    is told apart by the pipeline (``run.deaths``): the rows in flight (``in_flight``, set by the scheduler)
    run alone on the next start, and one the engine dies on again becomes an error row."""

    in_flight: list[str] = []  # row ids in flight when it died (``run.scheduler`` sets it)


def engine_side(error: str) -> bool:
    """Whether a row's error is the engine's doing (it hung past --request-timeout, or died on the row), not the
    request's: OpenAI's batch output calls these ``engine_error``, the request's own ``invalid_request``."""
    return error.startswith(("request timed out after", "the engine died"))


def request_timed_out(seconds: float) -> str:
    """The error of a row whose request outlived --request-timeout: one wording for every engine."""
    return f"request timed out after {seconds:g}s (--request-timeout); the engine's answer, if any, was dropped"


class Interrupted(BaseException):
    """Raised when the grace budget after a stop signal runs out; BaseException so no handler swallows it."""


JSONL_NAMES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".json", ".ndjson.gz", ".ndjson.zst")


class RowError(Exception):
    """A problem with one input row. Becomes a ``status=error`` output row (or stops the job with fail).

    The message names the file, the row and the field so a user can find and fix it: in a JSON Lines file the
    1-based line an editor shows (``row`` is the 0-based index, which for JSONL is line - 1), elsewhere the 0-based
    row index that pyarrow, pandas and datasets use; and, once known (``with_id``), the row's id as its column
    calls it, e.g. ``batch.jsonl: line 10 (custom_id 'req-9'), field 'body.temperature': expected a number >= 0,
    got 'hot'``. This one string is what the log, the report, the Parquet ``error`` column and ``export`` show.
    """

    def __init__(self, file: str, row: int, field: str | None, message: str,
                 ident: tuple[str, str] | None = None):
        self.file, self.row, self.field, self.message, self.ident = file, row, field, message, ident
        super().__init__(file, row, field, message, ident)

    @property
    def where(self) -> str:
        pos = f"line {self.row + 1}" if self.file.lower().endswith(JSONL_NAMES) else f"row {self.row}"
        ident = f" ({self.ident[0]} {self.ident[1]!r})" if self.ident else ""
        return f"{self.file}: {pos}{ident}" + (f", field {self.field!r}" if self.field else "")

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"

    def with_id(self, column: str, value: str) -> RowError:
        """The same error naming the row's id (``column`` as the input names it: custom_id, id, qid...)."""
        return RowError(self.file, self.row, self.field, self.message, (column, value))


_LOCATED = re.compile(r"^(?P<where>.+?: (?:line|row) \d+(?: \(.*?\))?)(?:, field (?P<field>'[^']*'|\"[^\"]*\"))?"
                      r": (?P<message>.*)$", re.S)
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"\b\d{2,}\b")


def split_error(text: str) -> tuple[str | None, str | None, str]:
    """A stored error message as (where, field, message): ``RowError``'s shape, or (None, None, text) for an
    engine's own error."""
    m = _LOCATED.match(text)
    if m is None:
        return None, None, text
    field = m.group("field")
    return m.group("where"), field[1:-1] if field else None, m.group("message")


def error_kind(text: str) -> str:
    """What went wrong, without where or the offending value: the key errors are counted by in the run log, the
    final over-budget line and ``report`` (one function, so they count the same kinds). "field 'body.temperature':
    expected a number >= 0" for every row whose temperature is not a number, whatever it held."""
    _, field, message = split_error(text)
    message = message.split(", got ", 1)[0]
    if message.endswith(")"):  # a trailing explanation ("malformed JSON (Expecting ',' ...)"), not "in (0, 1]"
        message = message.split(" (", 1)[0]
    message = _NUMBER.sub("N", _QUOTED.sub("'…'", message)).strip()[:120]
    return f"field {field!r}: {message}" if field else message
