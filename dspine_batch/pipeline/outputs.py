"""The storage interface of an OUTDIR: what ``generate``, ``status`` and ``finalize`` ask of where output lives.

Two implementations: ``LocalOutput`` (a directory: POSIX rename, fsync and ``flock``, the protocol in ``sink`` and
``resume``, unchanged in speed and guarantees) and ``remote.ObjectOutput`` (an ``s3://``/``az://`` prefix: create-only
commit records, server-side publish, leases). ``open_output`` picks one from the -o value; a URL whose store
cannot hold an exactly-once output is refused there in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from dspine_batch.errors import disk_full_named, free_bytes
from dspine_batch.pipeline import compact, supersede
from dspine_batch.pipeline.manifest import MANIFEST, create_or_check, read_manifest
from dspine_batch.pipeline.resume import (
    STATE_DIR,
    DoneSet,
    Lock,
    PartCheck,
    _warn,
    check_parts,
    held_locks,
    list_parts,
    load_done,
    prepare_outdir,
    read_state,
    remove_staging,
    verify_parts,
    wipe,
    write_state,
)
from dspine_batch.pipeline.sink import fsync_dir, write_part_atomically
from dspine_batch.storage.urls import is_url, local_path

SUCCESS = "_SUCCESS"


class Output(Protocol):
    """One OUTDIR, wherever it lives. ``display`` is what messages show (a URL's secrets redacted)."""

    display: str
    remote: bool
    commit_rows: int  # --commit-rows when not given (see ``remote.ObjectOutput.commit_rows`` for why they differ)

    def prepare(self) -> None: ...
    def lock(self, tag: str) -> Any: ...
    def held_locks(self) -> list[str]: ...
    def read_manifest(self) -> dict[str, Any] | None: ...
    def create_or_check(self, manifest: dict[str, Any]) -> dict[str, Any]: ...
    def wipe(self) -> None: ...
    def recover(self) -> None: ...
    def free_bytes(self) -> int | None: ...
    def read_state(self, tag: str) -> dict[str, Any]: ...
    def write_state(self, tag: str, state: dict[str, Any]) -> None: ...
    def write_success(self) -> None: ...
    def remove_staging(self, tag: str | None = None) -> int: ...
    def load_done(self, tag: str, id_column: bool = True, on_damaged: str = "repair",
                  report: Callable[[str], None] = _warn) -> DoneSet: ...
    def verify_parts(self, tag: str | None, on_damaged: str, report: Callable[[str], None] = _warn) \
        -> list[PartCheck]: ...
    def commit_part(self, name: str, table: pa.Table, keys: np.ndarray | None = None,
                    rows: int | None = None) -> dict[str, Any]: ...
    def part_urls(self) -> list[str]: ...
    def flush(self) -> None: ...
    # --retry-errors: failed rows taken out of committed parts, a crash's half-done take-out settled
    def recover_retry(self, tag: str) -> str | None: ...
    def drop_rows(self, tag: str, part: str, ids: set[str]) -> int: ...
    def update_manifest(self, manifest: dict[str, Any]) -> None: ...
    def remove_success(self) -> None: ...
    # advisory files of the run beside the protocol (``rowrecord``): read whole, put whole
    def read_blob(self, rel: str) -> bytes | None: ...
    def has_blob(self, rel: str) -> bool: ...
    def write_blob(self, rel: str, local: str) -> None: ...


class LocalOutput:
    """A local directory: today's protocol (``sink``/``resume``), wrapped."""

    remote = False
    commit_rows = 1000

    def __init__(self, path: str):
        self.path = os.path.abspath(local_path(path))
        self.display = self.path

    def prepare(self) -> None:
        prepare_outdir(self.path)

    def lock(self, tag: str) -> Lock:
        return Lock(self.path, tag)

    def held_locks(self) -> list[str]:
        return held_locks(self.path)

    def read_manifest(self) -> dict[str, Any] | None:
        return read_manifest(self.path)

    def create_or_check(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return create_or_check(self.path, manifest)

    def wipe(self) -> None:
        wipe(self.path)

    def recover(self) -> None:
        compact.recover(self.path)  # a crashed `finalize --compact` must not leave duplicates behind

    def free_bytes(self) -> int | None:
        return free_bytes(self.path)

    def read_state(self, tag: str) -> dict[str, Any]:
        return read_state(self.path, tag)

    def write_state(self, tag: str, state: dict[str, Any]) -> None:
        write_state(self.path, tag, state)

    def states(self) -> list[tuple[str, dict[str, Any]]]:
        d, out = os.path.join(self.path, STATE_DIR), []
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if name.startswith("state-") and name.endswith(".json"):
                with open(os.path.join(d, name)) as f:
                    out.append((name[len("state-"):-len(".json")], json.load(f)))
        return out

    def write_success(self) -> None:
        path = os.path.join(self.path, SUCCESS)
        with disk_full_named(path, then="every row is committed, only this marker is missing"):
            with open(path, "w") as f:
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.path)

    def remove_staging(self, tag: str | None = None) -> int:
        return remove_staging(self.path, tag)

    def load_done(self, tag: str, id_column: bool = True, on_damaged: str = "repair",
                  report: Callable[[str], None] = _warn) -> DoneSet:
        return load_done(self.path, tag, id_column=id_column, on_damaged=on_damaged, report=report)

    def verify_parts(self, tag: str | None, on_damaged: str, report: Callable[[str], None] = _warn) \
            -> list[PartCheck]:
        return verify_parts(self.path, tag, on_damaged, report)

    def check_parts(self, tag: str | None = None, checksum: bool = True) -> list[PartCheck]:
        return check_parts(self.path, tag, checksum)

    def commit_part(self, name: str, table: pa.Table, keys: np.ndarray | None = None,
                    rows: int | None = None) -> dict[str, Any]:
        return write_part_atomically(self.path, name, table, keys, rows)

    def part_urls(self) -> list[str]:
        return [p.path for p in list_parts(self.path)]

    def recover_retry(self, tag: str) -> str | None:
        return supersede.recover(self.path, tag)

    def drop_rows(self, tag: str, part: str, ids: set[str]) -> int:
        return supersede.drop_rows(self.path, tag, part, ids)

    def update_manifest(self, manifest: dict[str, Any]) -> None:
        path = os.path.join(self.path, MANIFEST)
        tmp = os.path.join(self.path, f".{MANIFEST}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.path)

    def remove_success(self) -> None:
        try:
            os.unlink(os.path.join(self.path, SUCCESS))
        except FileNotFoundError:
            pass

    def flush(self) -> None:
        """Commits here are synchronous: nothing is ever queued."""

    def read_blob(self, rel: str) -> bytes | None:
        try:
            with open(os.path.join(self.path, rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def has_blob(self, rel: str) -> bool:
        return os.path.exists(os.path.join(self.path, rel))

    def write_blob(self, rel: str, local: str) -> None:
        """``local`` (a file of this machine) put in place whole: copied beside it, fsynced, renamed over."""
        path = os.path.join(self.path, rel)
        tmp = f"{path}.{os.getpid()}.tmp"
        shutil.copyfile(local, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)


def open_output(where: str) -> Output:
    """The ``Output`` for a -o value: a local directory, or an object-store URL (refused in one line when its
    store cannot create-if-absent, or its library is missing)."""
    if is_url(where):
        from dspine_batch.pipeline.remote import ObjectOutput

        return ObjectOutput(where)
    return LocalOutput(where)


def committed_parts(outdir: str) -> list[Any]:
    """``resume.Part``s of an OUTDIR's published committed parts, local or URL (``path`` is then a URL: read it
    with ``arrow_path``)."""
    from dspine_batch.pipeline.resume import PART_RE, Part

    if not is_url(outdir):
        return list_parts(outdir)
    out = open_output(outdir)
    parts = []
    for url in out.part_urls():
        m = PART_RE.match(url.rsplit("/", 1)[-1])
        assert m is not None
        parts.append(Part(url, m.group(1), int(m.group(2))))
    return sorted(parts, key=lambda p: (p.shard, p.seq))


def arrow_path(path: str) -> dict[str, Any]:
    """Keyword arguments for pyarrow's readers (``pq.read_table(**arrow_path(p), columns=...)``): the path, and for a
    URL the fsspec filesystem behind it (ranged reads, the job's storage options)."""
    if not is_url(path):
        return {"source": path}
    from dspine_batch.storage.fs import arrow_filesystem

    fs, inner = arrow_filesystem(path)
    return {"source": inner, "filesystem": fs}


def shard_states(outdir: str) -> list[tuple[str, dict[str, Any]]]:
    """(shard tag, state file) of every shard that wrote one."""
    out = open_output(outdir)
    return out.states()  # type: ignore[attr-defined]
