"""What a (re)start needs from OUTDIR: the lock, leftover staging files, committed parts, the done-set.

The done-set is the set of row ids present in committed parts (see ``sink`` for why that is exact). Only the
``row_id`` column is read, and ids are kept as 64-bit hashes (``keyset``), so a resume over millions of
committed rows starts in about a second and costs 8 bytes a row.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.errors import FatalError, LockedError, UsageError
from dspine_batch.pipeline.keyset import KeySet, fallback_id_hashes, key_hashes
from dspine_batch.pipeline.manifest import MANIFEST
from dspine_batch.pipeline.sink import KEYS_DIR, PART_PREFIX, keys_path

STATE_DIR = "_dspine"
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
    so a stale lock can never block a restart, and a live process always blocks a second one."""

    def __init__(self, outdir: str, tag: str):
        self.path = os.path.join(outdir, STATE_DIR, f"lock-{tag}")
        self.fd: int | None = None

    def acquire(self) -> Lock:
        for attempt in range(5):  # `status` probes locks for an instant; don't mistake that for a writer
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if attempt == 4:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                    os.close(fd)
                    raise LockedError(f"{os.path.dirname(os.path.dirname(self.path))} is in use by {holder} "
                                      f"({os.path.basename(self.path)}); wait for it or stop it first") from None
                os.close(fd)
                time.sleep(0.05)
                continue
            if _same_file(fd, self.path):  # not a file its last holder unlinked while we waited
                break
            os.close(fd)
        else:
            raise LockedError(f"{self.path}: the lock file keeps changing; is another process starting?")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
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
    """Delete staging files left by a crash (uncommitted by definition). Only this shard's when ``tag``."""
    n = 0
    for name in os.listdir(outdir):
        if name.startswith(f".{PART_PREFIX}") and name.endswith(".inprogress") and (tag is None or tag in name):
            os.unlink(os.path.join(outdir, name))
            n += 1
    return n


def wipe(outdir: str) -> None:
    """--overwrite: remove everything dspine-batch wrote (and only that)."""
    for name in os.listdir(outdir):
        path = os.path.join(outdir, name)
        if name == STATE_DIR:
            for sub in os.listdir(path):
                if sub == "keys":
                    for k in os.listdir(os.path.join(path, sub)):
                        os.unlink(os.path.join(path, sub, k))
                elif not sub.startswith("lock-"):
                    os.unlink(os.path.join(path, sub))
        elif OUTPUT_NAMES.match(name):
            os.unlink(path)


@dataclass
class DoneSet:
    keys: KeySet
    rows: int  # distinct row ids committed
    error_rows: int
    outputs: int
    next_seq: int


def part_info(path: str) -> dict[str, Any]:
    """The part's own bookkeeping (rows, error_rows, ...) from its footer, without reading data."""
    md = pq.read_metadata(path)
    info = json.loads((md.metadata or {}).get(b"dspine_batch.part", b"{}"))
    info["outputs"] = md.num_rows
    return info


def load_done(outdir: str, tag: str, id_column: bool = True) -> DoneSet:
    """The done-set of one shard: key files when they match their part, else the parts' row_id column
    (hashed like ``mapping.RowIds`` does: strings with an id column, ``<file>:<index>`` indices without)."""
    keys = KeySet()
    rows = errors = outputs = 0
    parts = list_parts(outdir, tag)
    for part in parts:
        try:
            info = part_info(part.path)
            sidecar = keys_path(outdir, os.path.basename(part.path))
            hashes = np.load(sidecar) if os.path.exists(sidecar) else None
            if hashes is not None and "rows" in info and len(hashes) == info["rows"]:
                keys.add_many(hashes)
                rows += info["rows"]
                errors += info.get("error_rows", 0)
                outputs += info["outputs"]
                continue
            t = pq.read_table(part.path, columns=["row_id", "status"])
        except (pa.ArrowException, OSError, ValueError) as e:
            # Cannot happen under the commit protocol (parts appear only complete); never guess.
            raise FatalError(f"{part.path}: committed part is unreadable ({e}); move it aside to regenerate "
                             "its rows") from e
        outputs += t.num_rows
        ids = pc.unique(t.column("row_id"))
        rows += len(ids)
        bad = pc.unique(pc.filter(t.column("row_id"), pc.equal(t.column("status"), "error")))
        errors += len(bad)
        keys.add_many((key_hashes if id_column else fallback_id_hashes)(ids.to_pylist()))
    return DoneSet(keys, rows, errors, outputs, (parts[-1].seq + 1) if parts else 0)


def state_path(outdir: str, tag: str) -> str:
    return os.path.join(outdir, STATE_DIR, f"state-{tag}.json")


def read_state(outdir: str, tag: str) -> dict[str, Any]:
    try:
        with open(state_path(outdir, tag)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_state(outdir: str, tag: str, state: dict[str, Any]) -> None:
    """Advisory progress for ``status`` (the truth is in the parts): temp + rename, no fsync needed."""
    state["updated_at"] = time.time()
    path = state_path(outdir, tag)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
