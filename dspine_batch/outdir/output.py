"""An OUTDIR as the run sees it (``Output``): one implementation, ``OutDir``, over any store.

``open_output`` takes the -o value: a local directory or an ``s3://``/``az://`` prefix (a URL whose store cannot
hold an exactly-once output is refused there in one line). Every method is the same protocol on every store
(``commit``, ``check``, ``done``, ``compact``, ``supersede``, ``sweep``); what differs is the store's primitives
and the shard's lock: a local ``flock`` (``lock``), or an object store's lease (``storage.lease``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from dspine_batch.errors import UsageError, free_bytes
from dspine_batch.outdir import check, compact, done, manifest, supersede, sweep
from dspine_batch.outdir.check import PartCheck, warn
from dspine_batch.outdir.commit import Committer, commit_part
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.done import DoneSet
from dspine_batch.outdir.layout import (
    CLAIM_SPACES,
    KEYS,
    MANIFEST,
    OUTPUT_NAMES,
    STAGING,
    STATE,
    SUCCESS,
    Part,
    parts_of,
    state_rel,
)
from dspine_batch.outdir.lock import Lock, held_locks
from dspine_batch.outdir.watermark import Span
from dspine_batch.storage.lease import Lease, holder_gone, live, read_lease
from dspine_batch.storage.urls import is_url


class Output(Protocol):
    """One OUTDIR, wherever it lives. ``display`` is what messages show (a URL's secrets redacted)."""

    display: str
    remote: bool
    commit_rows: int  # --commit-rows when not given (see ``OutDir.commit_rows`` for why they differ)

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
                  report: Callable[[str], None] = warn) -> DoneSet: ...
    def verify_parts(self, tag: str | None, on_damaged: str, report: Callable[[str], None] = warn) \
        -> list[PartCheck]: ...
    def commit_part(self, name: str, table: pa.Table, keys: np.ndarray | None = None,
                    rows: int | None = None, spans: dict[str, list[Span]] | None = None) -> dict[str, Any]: ...
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


class OutDir(Outdir):
    """The ``Output`` of any OUTDIR: the protocol of this package over its store."""

    def __init__(self, where: str):
        super().__init__(where)
        self.committer: Committer | None = None

    @property
    def commit_rows(self) -> int:
        """--commit-rows when not given: 1,000 on a disk, ten times that on a store. A store's part costs three
        requests (upload, record, copy), one more object to list and one GET on every resume, and the client's CPU
        per request; a local part costs an fsync. For any real engine --commit-seconds (5 s) ends a part long
        before 10,000 rows, so the work a crash can lose is the same; only a very fast job (cheap rows, cheap to
        redo) gets fewer, larger parts: on the zero-cost pipeline 10x fewer requests, and a resume over 1M rows
        reads 100 records instead of 1,000 (BENCHMARKS.md, issue 39)."""
        return 1000 if self.store.local else 10_000

    # -- setup ----------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check the store answers (one line for 403 / no bucket, before any work), that the OUTDIR is empty or
        ours (a typo in -o must not mix outputs), and, on an object store, that it honours conditional writes."""
        self.store.check_bucket()
        foreign = [n for n in self.store.names() if not OUTPUT_NAMES.match(n)]
        if foreign and self.read_manifest() is None:
            raise UsageError(f"{self.display}: not empty and not a dspine-batch output (found {foreign[0]!r}); "
                             f"choose a new -o {'prefix' if self.remote else 'directory'}")
        if self.remote:  # a disk's link and flock are the kernel's; a store (or a proxy) may ignore If-None-Match
            self.store.check_conditional_writes()

    def lock(self, tag: str) -> Any:
        if self.store.local:
            return Lock(self.path, tag)
        self.lease = Lease(self.store, tag, before_release=self._drain)
        return self.lease

    def _drain(self) -> None:
        """Before the lease goes: let queued commits land (or fail) while the shard is still ours."""
        if self.committer is not None:
            try:
                self.committer.flush()
            except BaseException:  # noqa: BLE001 - raised to the caller by the commit or flush that saw it
                pass

    def held_locks(self) -> list[str]:
        """Locks (a disk) or leases (a store) whose holder may be alive."""
        if self.store.local:
            return held_locks(self.path)
        return [f"lease-{tag}" for tag, held in self.lease_states().items() if held]

    def lease_states(self) -> dict[str, bool]:
        """shard tag -> whether a live lease holds it (``status``: running, or dead)."""
        out = {}
        for n in self.store.list(STATE):
            if n.startswith("lease-") and n.endswith(".json"):
                tag = n.removeprefix("lease-").removesuffix(".json")
                lease = read_lease(self.store, tag)
                out[tag] = live(lease) and holder_gone(lease or {}) is None
        return out

    def read_manifest(self) -> dict[str, Any] | None:
        return manifest.read_manifest(self.store)

    def create_or_check(self, run: dict[str, Any]) -> dict[str, Any]:
        return manifest.create_or_check(self.store, run)

    def update_manifest(self, run: dict[str, Any]) -> None:
        manifest.update_manifest(self.store, run)

    def wipe(self) -> None:
        """--overwrite: delete what dspine-batch wrote here (never ``_dspine/damaged/``, never locks or leases)."""
        top = [n for n in self.store.list("") if OUTPUT_NAMES.match(n)]
        ours = [f"{KEYS}/{n}" for n in self.store.list(KEYS)] + [f"{STAGING}/{n}" for n in self.store.list(STAGING)]
        ours += [f"{STATE}/{n}" for n in self.store.list(STATE) if not n.startswith(("lease-", "lock-"))]
        self.store.delete_many(ours + top)
        for space in CLAIM_SPACES:  # a stage's dedup key log
            self.store.delete_tree(f"{STATE}/{space}")
        self.forget_records()

    def free_bytes(self) -> int | None:
        return free_bytes(self.path) if self.store.local else None

    # -- recovery (``recovery`` calls these in its order) ----------------------------------------------------------
    def recover(self) -> None:
        """Finish a ``finalize --compact`` a crash interrupted, before any record is read."""
        compact.recover(self)

    def recover_retry(self, tag: str) -> str | None:
        return supersede.recover(self, tag)

    def remove_staging(self, tag: str | None = None) -> int:
        """Finish interrupted publishes and sweep uncommitted staged bytes of one shard (all with None)."""
        return sweep.sweep(self, tag)

    # -- --retry-errors -------------------------------------------------------------------------------------------
    def drop_rows(self, tag: str, part: str, ids: set[str]) -> int:
        return supersede.drop_rows(self, tag, part.rsplit("/", 1)[-1], ids)

    # -- state and markers ----------------------------------------------------------------------------------------
    def read_state(self, tag: str) -> dict[str, Any]:
        data = self.store.get(state_rel(tag))
        try:
            return json.loads(data) if data else {}
        except ValueError:
            return {}

    def write_state(self, tag: str, state: dict[str, Any]) -> None:
        """Advisory progress for ``status`` (the truth is in the parts); on a store written by the committer after
        the commits queued before it, at most every ``Committer.STATE_SECONDS`` while a run goes on."""
        state["updated_at"] = time.time()
        body = json.dumps(state, indent=1, sort_keys=True).encode()
        if self.committer is not None and state.get("state") == "running" and \
                self.committer.submit_state(state_rel(tag), body):
            return
        self.flush()
        self.store.put(state_rel(tag), body, durable=False)

    def states(self) -> list[tuple[str, dict[str, Any]]]:
        """(shard tag, state) of every shard that wrote one."""
        out = []
        for n in sorted(self.store.list(STATE)):
            if n.startswith("state-") and n.endswith(".json"):
                tag = n.removeprefix("state-").removesuffix(".json")
                out.append((tag, self.read_state(tag)))
        return out

    def write_success(self) -> None:
        """``_SUCCESS``, created once (after every queued commit landed)."""
        self.flush()
        self.store.create(SUCCESS, b"", then="every row is committed, only this marker is missing")

    def has_success(self) -> bool:
        return self.store.head(SUCCESS) is not None

    def remove_success(self) -> None:
        self.store.delete(SUCCESS)

    def read_blob(self, rel: str) -> bytes | None:
        return self.store.get(rel)

    def has_blob(self, rel: str) -> bool:
        return self.store.head(rel) is not None

    def write_blob(self, rel: str, local: str) -> None:
        """An advisory file of this machine put whole (a reader sees the old bytes or the new, never a mix)."""
        self.store.upload(local, rel)

    # -- commits and parts ----------------------------------------------------------------------------------------
    def commit_part(self, name: str, table: pa.Table, keys: np.ndarray | None = None,
                    rows: int | None = None, spans: dict[str, list[Span]] | None = None,
                    token: str | None = None) -> dict[str, Any]:
        """Commit one part (``commit``): published on return on a disk, queued on a store."""
        if self.committer is None:
            self.committer = Committer(self)
        return commit_part(self, self.committer, name, table, keys, rows, token, spans)

    def flush(self) -> None:
        """Wait until every queued part is committed and published (raises what failed)."""
        if self.committer is not None:
            self.committer.flush()

    def compact(self, target_rows: int) -> int:
        if self.committer is None:
            self.committer = Committer(self)
        return compact.compact(self, self.committer, target_rows)

    def check_parts(self, tag: str | None = None, checksum: bool | None = None) -> list[PartCheck]:
        return check.check_parts(self, tag, checksum)

    def verify_parts(self, tag: str | None, on_damaged: str, report: Callable[[str], None] = warn,
                     checksum: bool = True) -> list[PartCheck]:
        return check.verify_parts(self, tag, on_damaged, report, checksum)

    def load_done(self, tag: str, id_column: bool = True, on_damaged: str = "repair",
                  report: Callable[[str], None] = warn) -> DoneSet:
        return done.load_done(self, tag, id_column, on_damaged, report)

    def parts(self, shard: str | None = None) -> list[Part]:
        """Published committed parts (of one shard), in (shard, seq) order."""
        return parts_of(self.store.list(""), self.display, shard)

    def part_urls(self) -> list[str]:
        return [p.path for p in self.parts()]


def open_output(where: str) -> OutDir:
    """The ``Output`` for a -o value: a local directory, or an object-store URL (refused in one line when its
    store cannot create-if-absent, or its library is missing)."""
    return OutDir(where)


def list_parts(where: str, shard: str | None = None) -> list[Part]:
    """Published committed parts of an OUTDIR (of one shard), in (shard, seq) order: paths, or URLs on a store."""
    return OutDir(where).parts(shard)


def committed_parts(where: str) -> list[Part]:
    return list_parts(where)


def arrow_path(path: str) -> dict[str, Any]:
    """Keyword arguments for pyarrow's readers (``pq.read_table(**arrow_path(p), columns=...)``): the path, and for a
    URL the fsspec filesystem behind it (ranged reads, the job's storage options)."""
    if not is_url(path):
        return {"source": path}
    from dspine_batch.storage.fs import arrow_filesystem

    fs, inner = arrow_filesystem(path)
    return {"source": inner, "filesystem": fs}


def read_part(path: str, columns: list[str] | None = None, optional: tuple[str, ...] = ()) -> pa.Table:
    """A committed part (a path or a URL) read whole, or ``columns`` of it and those of ``optional`` it has (parts
    written before a column existed). A URL's object is opened once, its size asked once (a HEAD on S3) and its
    bytes read ahead from there: pyarrow handed the fsspec filesystem asks for the object's info and opens it twice
    within one ``read_table``, five HEADs an object before its GETs (counted on moto), and a resume or a
    ``finalize`` reads every part of a stage."""
    from contextlib import nullcontext

    import pyarrow.parquet as pq

    from dspine_batch.storage.fs import open_file

    with (open_file(path) if is_url(path) else nullcontext(path)) as src, pq.ParquetFile(src) as pf:
        if columns is not None and optional:
            have = set(pf.schema_arrow.names)
            columns = [*columns, *(c for c in optional if c in have)]
        return pf.read(columns=columns)


def shard_states(where: str) -> list[tuple[str, dict[str, Any]]]:
    """(shard tag, state file) of every shard that wrote one."""
    return OutDir(where).states()


__all__ = ["MANIFEST", "SUCCESS", "Output", "OutDir", "arrow_path", "committed_parts", "list_parts", "open_output",
           "read_part", "shard_states"]
