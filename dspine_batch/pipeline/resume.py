"""What a (re)start needs from OUTDIR: the lock, leftover staging files, committed parts, the done-set.

The done-set is the set of row ids present in committed parts (see ``sink`` for why that is exact). Only the
``row_id`` column is read, and ids are kept as 64-bit hashes (``keyset``), so a resume over millions of
committed rows starts in about a second and costs 8 bytes a row.

Before a part is trusted it is checked against its commit record (``check_parts``): size, crc32 of its bytes,
row count. A part that is missing, truncated, unreadable or altered is reported in one line, moved aside to
``_dspine/damaged/`` (never deleted) and left out of the done-set, so its rows are generated again; with
``--on-damaged-part fail`` the start is refused instead. Parts without a record (written by older versions)
are trusted as before: readable footer, and row count matching their key file or row_id column.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.errors import FatalError, LockedError, UsageError, disk_full_named
from dspine_batch.pipeline.keyset import KeySet, fallback_id_hashes, key_hashes
from dspine_batch.pipeline.manifest import MANIFEST
from dspine_batch.pipeline.sink import (
    CHECKSUM,
    KEYS_DIR,
    PART_PREFIX,
    file_checksum,
    fsync_dir,
    keys_path,
    load_keys,
    read_record,
    record_part_name,
    record_path,
)

STATE_DIR = "_dspine"
CLAIM_SPACES = ("dedup", "minhash")  # ``stages.claims``' directories under STATE_DIR: wiped with the run
DAMAGED_DIR = os.path.join(STATE_DIR, "damaged")
ON_DAMAGED = ("repair", "fail")
PART_RE = re.compile(r"^train-(\d{5}-of-\d{5})-(\d{6})\.parquet$")
OUTPUT_NAMES = re.compile(r"^(train-.*\.parquet|\..*\.inprogress|_manifest\.json|_dspine|_SUCCESS|_report\.json|"
                  r"\._manifest\.json\..*\.tmp)$")


@dataclass
class Part:
    path: str
    shard: str
    seq: int


def list_parts(outdir: str, shard: str | None = None) -> list[Part]:
    parts = []
    for name in os.listdir(outdir):
        m = PART_RE.match(name)
        if m and (shard is None or m.group(1) == shard):
            parts.append(Part(os.path.join(outdir, name), m.group(1), int(m.group(2))))
    return sorted(parts, key=lambda p: (p.shard, p.seq))


def prepare_outdir(outdir: str) -> None:
    """Create OUTDIR; refuse a non-empty directory that is not ours (a typo in -o must not mix outputs)."""
    os.makedirs(os.path.join(outdir, KEYS_DIR), exist_ok=True)
    foreign = [n for n in os.listdir(outdir) if not OUTPUT_NAMES.match(n)]
    if foreign and not os.path.exists(os.path.join(outdir, MANIFEST)):
        raise UsageError(f"{outdir}: not empty and not a dspine-batch output (found {foreign[0]!r}); "
                         "choose a new -o directory")


class Lock:
    """An exclusive flock on ``_dspine/lock-<shard>``: the kernel drops it when the process dies (even kill -9),
    so a stale lock can never block a restart, and a live process always blocks a second one: that start ends with
    ``LockedError`` (exit 75, naming the holder: a requeue may come back once it has stopped)."""

    def __init__(self, outdir: str, tag: str):
        self.path, self.tag = os.path.join(outdir, STATE_DIR, f"lock-{tag}"), tag
        self.fd: int | None = None

    def acquire(self) -> Lock:
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
    d = os.path.join(outdir, STATE_DIR)
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


def remove_staging(outdir: str, tag: str | None = None) -> int:
    """Delete staging files left by a crash (uncommitted by definition), with the key file and commit record
    written for them. Only this shard's when ``tag``."""
    n = 0
    for name in os.listdir(outdir):
        if name.startswith(f".{PART_PREFIX}") and name.endswith(".inprogress") and (tag is None or tag in name):
            part = name[1:].removesuffix(".inprogress")
            for sidecar in (record_path(outdir, part), keys_path(outdir, part)):  # the record first (see sink)
                if os.path.exists(sidecar) and not os.path.exists(os.path.join(outdir, part)):
                    os.unlink(sidecar)
            os.unlink(os.path.join(outdir, name))
            n += 1
    return n


def wipe(outdir: str) -> None:
    """--overwrite: remove everything dspine-batch wrote (and only that)."""
    for name in os.listdir(outdir):
        path = os.path.join(outdir, name)
        if name == STATE_DIR:
            for sub in os.listdir(path):
                if sub == "damaged":  # moved aside by a repair: never deleted by us, not even by --overwrite
                    continue
                if sub == "keys":
                    for k in os.listdir(os.path.join(path, sub)):
                        os.unlink(os.path.join(path, sub, k))
                elif sub in CLAIM_SPACES:
                    shutil.rmtree(os.path.join(path, sub))
                elif not sub.startswith("lock-"):
                    os.unlink(os.path.join(path, sub))
        elif OUTPUT_NAMES.match(name):
            os.unlink(path)


def part_info(path: str) -> dict[str, Any]:
    """The part's own bookkeeping (rows, error_rows, ...) from its footer, without reading data."""
    md = pq.read_metadata(path)
    info = json.loads((md.metadata or {}).get(b"dspine_batch.part", b"{}"))
    info["outputs"] = md.num_rows
    return info


@dataclass
class PartCheck:
    """One committed part (or one commit record whose part is gone), checked against its commit record."""

    path: str  # OUTDIR/train-....parquet
    problem: str | None = None  # "missing", "truncated (...)", "unreadable (...)", "altered (...)"; None: good
    info: dict[str, Any] | None = None  # footer bookkeeping (rows, error_rows, outputs) of a good part
    verified: bool = False  # checked against a record (False: an old part, trusted by its row count)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


def check_part(outdir: str, path: str, checksum: bool = True) -> PartCheck:
    """Size, crc32 (when ``checksum``), readable footer and row count, against the part's commit record.
    Cheapest test first: a truncated part is found by one stat, only intact-looking ones are read."""
    name = os.path.basename(path)
    record = read_record(outdir, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return PartCheck(path, "missing")
    if record is not None:
        want = int(record["bytes"])
        if size < want:
            return PartCheck(path, f"truncated ({size:,} of {want:,} bytes)")
        if size > want:
            return PartCheck(path, f"altered ({size:,} bytes, {want:,} committed)")
        if checksum:
            try:
                crc = file_checksum(path)
            except OSError as e:
                return PartCheck(path, f"unreadable ({_short(e)})")
            if crc != record[CHECKSUM]:
                return PartCheck(path, f"altered ({CHECKSUM} {crc:08x}, {int(record[CHECKSUM]):08x} committed)")
    try:
        info = part_info(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        return PartCheck(path, f"unreadable ({_short(e)})")
    if record is not None and info["outputs"] != record["outputs"]:
        return PartCheck(path, f"altered ({info['outputs']:,} rows, {record['outputs']:,} committed)")
    return PartCheck(path, None, info, verified=record is not None)


def check_parts(outdir: str, tag: str | None = None, checksum: bool = True) -> list[PartCheck]:
    """Check every committed part of one shard (all when ``tag`` is None), plus a "missing" entry for each
    commit record whose part is gone with no staging file to explain it (a crash mid-commit leaves one).
    Side-effect free, so ``status`` can run it next to a live writer. Parts are hashed on a few threads:
    zlib and file reads release the GIL."""
    keys_dir = os.path.join(outdir, KEYS_DIR)
    # records listed before parts: a commit landing in between then shows up as a part, never as "missing"
    records = []
    for n in os.listdir(keys_dir) if os.path.isdir(keys_dir) else []:
        m = PART_RE.match(record_part_name(n)) if n.startswith("commit-") and n.endswith(".json") else None
        if m and (tag is None or m.group(1) == tag):
            records.append(m.group(0))
    parts = list_parts(outdir, tag)
    workers = min(4, os.cpu_count() or 1, len(parts))
    if workers > 1 and checksum:
        with ThreadPoolExecutor(workers) as pool:
            checks = list(pool.map(lambda p: check_part(outdir, p.path, checksum), parts))
    else:
        checks = [check_part(outdir, p.path, checksum) for p in parts]
    present = {os.path.basename(p.path) for p in parts}
    for name in sorted(set(records) - present):
        if not os.path.exists(os.path.join(outdir, f".{name}.inprogress")) and \
                not os.path.exists(os.path.join(outdir, name)):
            checks.append(PartCheck(os.path.join(outdir, name), "missing"))
    return checks


def _warn(msg: str) -> None:
    print(f"dspine-batch: {msg}", file=sys.stderr, flush=True)


def handle_damage(outdir: str, check: PartCheck, on_damaged: str = "repair",
                  report: Callable[[str], None] = _warn) -> None:
    """``repair``: report the part in one line and move it (and its key file and record) aside, so its rows are
    generated again; ``fail``: refuse, saying how to continue. Never deletes anything."""
    assert check.problem is not None
    if on_damaged == "fail":
        raise FatalError(f"{check.path}: committed part is {check.problem}; stopped (--on-damaged-part fail): rerun "
                         "with --on-damaged-part repair to move it aside and regenerate its rows")
    dest = move_aside(outdir, os.path.basename(check.path))
    success = os.path.join(outdir, "_SUCCESS")
    if os.path.exists(success):  # no longer true; a marker, not data: generate or finalize writes it again
        os.unlink(success)
    where = f"its commit record moved aside to {os.path.dirname(dest)}/" if check.problem == "missing" \
        else f"moved aside to {dest}"
    report(f"{check.path}: committed part is {check.problem}; {where}, its rows will be generated again")


def move_aside(outdir: str, name: str) -> str:
    """Move a part and its sidecars to ``_dspine/damaged/`` under names with neither "train" nor ".parquet"
    (readers' globs and datasets' split patterns must not pick them up). The part goes first: once it is
    gone it is no longer committed. Returns where the part (or, when it is missing, its record) went."""
    damaged = os.path.join(outdir, DAMAGED_DIR)
    os.makedirs(damaged, exist_ok=True)
    stem = "part-" + name.removeprefix(PART_PREFIX).removesuffix(".parquet") + time.strftime(".%Y%m%dT%H%M%S")
    n = 0
    while any(f.startswith(stem + (f".{n}" if n else "") + ".") for f in os.listdir(damaged)):
        n += 1
    stem += f".{n}" if n else ""
    moved = []
    for src, suffix in ((os.path.join(outdir, name), ".damaged"), (keys_path(outdir, name), ".keys.npy"),
                        (record_path(outdir, name), ".commit.json")):
        if os.path.exists(src):
            os.rename(src, os.path.join(damaged, stem + suffix))
            moved.append(os.path.join(damaged, stem + suffix))
    for d in (outdir, os.path.join(outdir, KEYS_DIR), damaged):
        if os.path.isdir(d):
            fsync_dir(d)
    return moved[0] if moved else damaged


def verify_parts(outdir: str, tag: str | None = None, on_damaged: str = "repair",
                 report: Callable[[str], None] = _warn) -> list[PartCheck]:
    """``check_parts`` and ``handle_damage`` for each damaged one; returns the good parts' checks. Call with the
    shard's lock held (``generate``) or every lock (``finalize``): it moves files."""
    good = []
    for check in check_parts(outdir, tag):
        if check.problem is None:
            good.append(check)
        else:
            handle_damage(outdir, check, on_damaged, report)
    return good


@dataclass
class DoneSet:
    keys: KeySet
    rows: int  # distinct row ids committed
    error_rows: int
    outputs: int
    next_seq: int
    damaged: int = 0  # parts moved aside by this start (their rows are not in the done-set)


def load_done(outdir: str, tag: str, id_column: bool = True, on_damaged: str = "repair",
              report: Callable[[str], None] = _warn) -> DoneSet:
    """The done-set of one shard, from its verified parts: key files when they match their part, else the
    parts' row_id column (hashed like ``mapping.RowIds`` does: strings with an id column, ``<file>:<index>``
    indices without). A part that fails its check, or whose row_id column cannot be read, is handled by
    ``handle_damage`` and left out."""
    keys = KeySet()
    rows = errors = outputs = 0
    checks = check_parts(outdir, tag)
    damaged = [c for c in checks if c.problem is not None]
    for check in damaged:
        handle_damage(outdir, check, on_damaged, report)
    for check in checks:
        if check.problem is not None:
            continue
        info = check.info or {}
        name = os.path.basename(check.path)
        hashes = load_keys(outdir, name, info.get("rows"), read_record(outdir, name))  # None: read row_id
        if hashes is not None:
            keys.add_many(hashes)
            rows += info["rows"]
            errors += info.get("error_rows", 0)
            outputs += info["outputs"]
            continue
        try:
            t = pq.read_table(check.path, columns=["row_id", "status"])
        except (pa.ArrowException, OSError, ValueError) as e:
            check.problem = f"unreadable ({_short(e)})"
            handle_damage(outdir, check, on_damaged, report)
            damaged.append(check)
            continue
        outputs += t.num_rows
        ids = pc.unique(t.column("row_id"))
        rows += len(ids)
        bad = pc.unique(pc.filter(t.column("row_id"), pc.equal(t.column("status"), "error")))
        errors += len(bad)
        keys.add_many((key_hashes if id_column else fallback_id_hashes)(ids.to_pylist()))
    parts = list_parts(outdir, tag)
    return DoneSet(keys, rows, errors, outputs, (parts[-1].seq + 1) if parts else 0, len(damaged))


def state_path(outdir: str, tag: str) -> str:
    return os.path.join(outdir, STATE_DIR, f"state-{tag}.json")


def read_state(outdir: str, tag: str) -> dict[str, Any]:
    try:
        with open(state_path(outdir, tag)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_state(outdir: str, tag: str, state: dict[str, Any]) -> None:
    """Advisory progress for ``status`` (the truth is in the parts): temp + rename, no fsync needed. A full
    disk is named (``DiskFull``) and leaves no temp file behind."""
    state["updated_at"] = time.time()
    path = state_path(outdir, tag)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with disk_full_named(path, lambda: os.path.getsize(tmp) if os.path.exists(tmp) else 0):
            with open(tmp, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
