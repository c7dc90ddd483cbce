"""Where dspine keeps what it computes once per machine, and how a cache entry is written so it cannot wedge.

``$DSPINE_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/dspine`` (default ``~/.cache/dspine``): built CPU kernels
(``kernels/``), calibrated cost models (``cost/``), packed weights (``packed/``), the embedded model's conversion.

Why the helpers: these caches are shared by every process of a machine, often by every task of a Slurm array on a
shared home, and any writer may be killed half-way (preemption, the OOM killer, Ctrl-\\, a time limit). So:

* an entry becomes visible only complete: files and folders are written under a temporary sibling name and
  renamed into place (``atomic_file``, ``atomic_write``, ``publish_dir``); a reader sees the old entry or the new
  one, never a torn one, and a killed writer leaves only a temporary that the next writer removes;
* work done once (a 40 s kernel build, a model conversion) is done by one process while the others wait
  (``exclusive``): an ``flock`` on an open file, which the kernel releases when its holder dies, even by
  ``kill -9``, so a dead holder can never block the next run. The holder writes who it is into the lock file
  (pid, host, since when, what); a waiter says whom it waits for, and a holder that finds a previous holder's
  record there knows that one died before finishing. Where a filesystem has no ``flock`` (some Lustre mounts) the
  lock is skipped with a note: atomic publishing alone still keeps every entry whole, the work is then merely
  done more than once;
* whether a temporary's writer is alive is asked of the writer itself: it holds an ``flock`` on its temporary
  file while it writes (``atomic_file``), so a temporary whose lock can be taken was left by a dead writer
  (``remove_dead_temps``). A pid and a host name cannot tell: containers that share a cache and a host name
  but not a pid namespace each see the other's live writers as dead pids.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

TEMP_MARK = ".tmp-"  # temporaries are ``.{name}.tmp-{host}-{pid}-{random}``: hidden, and attributable
PENDING_MARK = ".new-"  # a temporary's name while its writer takes its lock (never matched as a temporary)


def cache_root() -> Path:
    root = os.environ.get("DSPINE_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspine")
    return Path(root).expanduser()


def say(msg: str) -> None:
    """One line on stderr, flushed (what every cache action reports)."""
    print(f"dspine: {msg}", file=sys.stderr, flush=True)


# -- atomic writes ------------------------------------------------------------------------------------------------


def temp_sibling(path: Path) -> Path:
    """A fresh temporary name beside ``path``, on the same filesystem (so a rename publishes it atomically)."""
    return path.with_name(f".{path.name}{TEMP_MARK}{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file or folder by name; best effort (some filesystems refuse a folder's fsync)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path for a writer that needs a file name (e.g. safetensors); when the block ends
    without an exception the file is given the permissions a new file gets here, fsynced and renamed over
    ``path``, else removed. The writer writes into the file at that path (truncating it is fine) and must not
    replace it: the file exists, locked, before the block starts.

    Permissions without the umask: writers like safetensors make 0600 files, which the cache's other users
    cannot read, so the file is chmod-ed at the end to the mode the kernel gave it when it was created with
    0666 (the umask applied, or a folder's default ACL). Reading the umask itself means setting it
    (``os.umask``), which races with every other thread that creates files meanwhile; ``/proc/self/status``
    has it but only on Linux, and neither knows about ACLs.

    Liveness without pids: the temporary is created under a pending name, ``flock``-ed, and only then renamed to
    its temporary name, so no other process ever sees it unlocked while its writer lives (a killed writer's lock
    goes with it; see ``remove_dead_temps``). Where the filesystem has no ``flock`` it is written unlocked."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    pending = tmp.with_name(tmp.name.replace(TEMP_MARK, PENDING_MARK, 1))
    fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
        with contextlib.suppress(OSError):  # (no flock here: the dead-writer test falls back to pid and host)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.rename(pending, tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                pending.unlink()
            raise
        try:
            yield tmp
            os.chmod(tmp, mode)
            _fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    finally:
        os.close(fd)  # releases the lock, after the rename: the temporary's name never exists unlocked
    _fsync_path(path.parent, directory=True)
    remove_dead_temps(path)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``path`` whole or not at all: readers, concurrent writers and a writer killed half-way see the old
    file or a complete new one (the last rename wins)."""
    with atomic_file(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            _write_all(fd, data.encode() if isinstance(data, str) else data)
        finally:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_alive(entry: Path, host: str, pid: str) -> bool:
    """Whether the writer of the temporary ``entry`` (named with ``host`` and ``pid``) is alive: it holds a lock
    on the file (``atomic_file``), so if this process can take it, nobody holds it. Where that cannot be asked
    (a folder, a filesystem without ``flock``) only a writer of this host whose pid is gone counts as dead. (A
    temporary of an older version, which did not lock its temporaries, counts as dead even while it writes.)"""
    if host == _host() and pid == str(os.getpid()):
        return True  # this process's own (another thread's; on NFS its locks would not exclude ours)
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        fd = None
    if fd is not None:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False  # the lock is free: its writer died (closing fd below releases it again)
        except BlockingIOError:
            return True
        except OSError as e:
            if not _no_flock(e):
                return True  # cannot tell: keep it
        finally:
            os.close(fd)
    return host != _host() or not pid.isdigit() or _pid_alive(int(pid))


def _host() -> str:
    return socket.gethostname().split(".")[0].replace("-", "_")


def remove_dead_temps(path: Path) -> int:
    """Remove the temporaries of ``path`` left by writers of this host name that died (``_writer_alive``: the
    lock they held is free, whatever their pid says); how many. Those of other hosts are left alone (a network
    filesystem mounted with local locks could not tell their writers' locks): ``remove_temps`` under a lock
    takes them."""
    path = Path(path)
    host = _host()
    prefix = f".{path.name}{TEMP_MARK}{host}-"
    n = 0
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            if entry.name.startswith(prefix):
                pid = entry.name[len(prefix):].split("-", 1)[0]
                if not _writer_alive(entry, host, pid):
                    _remove(entry)
                    n += 1
    return n


def remove_temps(path: Path) -> int:
    """Remove every temporary of ``path`` (call with ``exclusive`` held: no live writer owns one then)."""
    n = 0
    with contextlib.suppress(OSError):
        for entry in Path(path).parent.iterdir():
            if entry.name.startswith(f".{Path(path).name}{TEMP_MARK}"):
                _remove(entry)
                n += 1
    return n


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            entry.unlink()


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` visible as ``final`` in one rename (its files fsynced first). An existing
    ``final`` (damaged, or from an older writer) is moved aside first, since a rename cannot replace a full
    folder; call with ``exclusive`` held so no other writer publishes meanwhile."""
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_path(f)
    if final.exists():
        old = temp_sibling(final)
        with contextlib.suppress(FileNotFoundError):
            os.rename(final, old)
        _remove(old)
    os.rename(tmp, final)
    _fsync_path(final.parent, directory=True)


# -- one process does the work, the others wait -------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock, as its lock file says."""

    pid: int
    host: str
    since: float
    what: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    @staticmethod
    def parse(text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return Holder(int(d["pid"]), str(d["host"]), float(d["since"]), str(d.get("what", "")))
        except (ValueError, KeyError, TypeError):
            return None


def _read_holder(fd: int) -> Holder | None:
    try:
        return Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
    except OSError:
        return None


@dataclass
class Held:
    """What ``exclusive`` yields: ``died`` is the previous holder that left its record behind (it was killed or
    crashed while holding the lock), ``waited_for`` whom this process waited for (None: the lock was free)."""

    died: Holder | None = None
    waited_for: Holder | None = None
    waited_s: float = 0.0
    locked: bool = True  # False where the filesystem has no flock (the work runs unlocked)


def _no_flock(e: OSError) -> bool:
    return e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


@contextlib.contextmanager
def exclusive(lock_path: Path, what: str, report: Callable[[str], None] = say,
              poll_s: float = 0.5) -> Iterator[Held]:
    """Hold ``lock_path`` (an flock) for the block; ``what`` (e.g. "building the CPU kernels for avx512") goes
    into the lock file for waiters to read. While another process holds it, says once whom it waits for (and
    again when the holder changes), then waits; a holder that dies releases it by dying. Leaving the block, even
    by an exception, empties the lock file (kept, never unlinked: unlinking races with a waiter that already
    opened it), so a record found there on entry means its writer died holding the lock (killed: no Python
    cleanup ran)."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    held = Held()
    try:
        t0, seen = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                if holder != seen and holder is not None:
                    ago = max(0.0, time.time() - holder.since)
                    report(f"waiting for {holder.describe()}, which is {holder.what or 'working'} (for {ago:.0f} s "
                           f"so far; lock {lock_path}); if that process is gone this run takes over")
                    held.waited_for = seen = holder
                time.sleep(poll_s)
            except OSError as e:
                if not _no_flock(e):
                    raise
                report(f"note: {lock_path.parent} has no file locks ({e.strerror}); working without one")
                held.locked = False
                break
        held.waited_s = time.monotonic() - t0 if held.waited_for else 0.0
        if held.locked:
            held.died = _read_holder(fd)
            record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": what}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
            os.fsync(fd)
        try:
            yield held
        finally:
            if held.locked:  # this process ends its turn (even by an exception): it did not die holding it
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock
