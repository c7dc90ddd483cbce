"""Parquet part writer with atomic commits: the only code that makes output visible.

Commit protocol (invariant: a part is committed iff it exists under its final name):
  1. write ``OUTDIR/.{name}.inprogress`` (hidden: readers and globs for ``*.parquet`` skip it), counting and
     crc32-ing its bytes on the way out, and fsync it;
  2. write the part's **key file** ``_dspine/keys/keys-{shard}-{seq}.npy`` (the 64-bit hashes of its row ids,
     so a resume loads its done-set without reading or hashing row ids) and its **commit record**
     ``_dspine/keys/commit-{shard}-{seq}.json`` (rows, outputs, bytes, crc32: what resume checks the part
     against), each temp + rename (the key file fsynced; the record not: a lost record only makes its part
     "trusted by row count", see ``write_record``);
  3. rename the staging file to ``OUTDIR/{name}`` (atomic on POSIX), 4. fsync the directory.
All samples of a row go into the same part, so "row_id present in a part" means "row done".
A crash before 3 leaves a staging file (and maybe its sidecars), all removed on the next start; after 3 the
rows are done. A failure before 3 (a full disk) removes what it wrote, so nothing is half-committed. A commit
record whose part is gone while no staging file explains it means the part was lost after its commit
(``resume.check_parts`` reports it as missing). A part without a record (older versions) is trusted by its
row count; a part whose key file is missing or does not match its row count falls back to reading
``row_id`` (``resume.load_done``).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.engines.base import Result
from dspine_batch.errors import disk_full_named
from dspine_batch.pipeline.mapping import WorkItem
from dspine_batch.pipeline.schema import BASE_NAMES, SOURCE_STATS

# Parts are named like Hub shards ("train-00000-of-00001-000012.parquet"): `datasets.load_dataset("parquet",
# data_dir=OUTDIR)` then matches them by its split pattern and skips _manifest.json, _SUCCESS and _dspine/
# (it does not ignore "_" names itself). pyarrow, pandas, polars and duckdb only need the ".parquet" suffix.
PART_PREFIX = "train-"


def part_name(shard_tag: str, seq: int) -> str:
    return f"{PART_PREFIX}{shard_tag}-{seq:06d}.parquet"


def staging_name(name: str) -> str:
    return f".{name}.inprogress"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


KEYS_DIR = os.path.join("_dspine", "keys")
CHECKSUM = "crc32"  # zlib.crc32: ~1.3 GiB/s on one core here (BENCHMARKS.md), stdlib, catches bit rot and torn writes


def _sidecar(outdir: str, name: str, prefix: str, suffix: str) -> str:
    return os.path.join(outdir, KEYS_DIR, prefix + name.removeprefix(PART_PREFIX).removesuffix(".parquet") + suffix)


def keys_path(outdir: str, name: str) -> str:
    """``train-X.parquet`` -> ``_dspine/keys/keys-X.npy`` (no "train" in it: datasets' split pattern)."""
    return _sidecar(outdir, name, "keys-", ".npy")


def record_path(outdir: str, name: str) -> str:
    """``train-X.parquet`` -> ``_dspine/keys/commit-X.json``: the commit record resume checks the part against."""
    return _sidecar(outdir, name, "commit-", ".json")


def record_part_name(record_file: str) -> str:
    """``commit-X.json`` -> ``train-X.parquet`` (inverse of ``record_path``)."""
    return PART_PREFIX + record_file.removeprefix("commit-").removesuffix(".json") + ".parquet"


def _write_durably(path: str, write: Callable[[Any], None], binary: bool, fsync: bool = True) -> None:
    """temp (+ fsync) + rename; on any failure the temp file is removed, and a full disk is named (``DiskFull``)."""
    tmp = f"{path}.tmp"
    try:
        with disk_full_named(path, lambda: _size(tmp)):
            with open(tmp, "wb" if binary else "w") as f:
                write(f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _size(path: str) -> int:
    """Bytes that reached the file (what a full disk let through), 0 when it is gone."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_keys(outdir: str, name: str, keys: np.ndarray) -> None:
    path = keys_path(outdir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_durably(path, lambda f: np.save(f, keys.astype("<u8"), allow_pickle=False), binary=True)


def write_record(outdir: str, name: str, record: dict[str, Any]) -> None:
    """No fsync (it cost ~10% of throughput at 1,000-row commits): a record lost or torn by a power cut only
    makes its part "trusted by row count" like a part from before records existed; it can never drop rows."""
    path = record_path(outdir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_durably(path, lambda f: json.dump(record, f, sort_keys=True), binary=False, fsync=False)


def keys_checksum(keys: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(keys, dtype="<u8").view(np.uint8))


def load_keys(outdir: str, name: str, rows: int | None, record: dict[str, Any] | None) -> np.ndarray | None:
    """The part's key file when it can be trusted: present, ``rows`` long, and matching the crc32 in the commit
    record (when there is one). A key file is only a cache of the part's row ids, but a wrong hash in it would
    skip an unrelated row or redo a done one, so a doubtful one is ignored and ``row_id`` is read instead."""
    path = keys_path(outdir, name)
    try:
        hashes = np.load(path) if os.path.exists(path) else None
    except (OSError, ValueError):
        return None
    if hashes is None or rows is None or len(hashes) != rows:
        return None
    if record is not None and "keys_crc32" in record and keys_checksum(hashes) != record["keys_crc32"]:
        return None
    return hashes


def read_record(outdir: str, name: str) -> dict[str, Any] | None:
    """The part's commit record; None when it has none (written before records existed) or it is unreadable
    (then the part is trusted by its row count, as an old part is: never worse than before records)."""
    try:
        with open(record_path(outdir, name)) as f:
            rec = json.load(f)
        return rec if isinstance(rec, dict) and {"bytes", CHECKSUM, "outputs"} <= rec.keys() else None
    except (OSError, ValueError):
        return None


def file_checksum(path: str, chunk: int = 4 << 20) -> int:
    """crc32 of a file's bytes, read in 4 MiB chunks into one buffer (zlib releases the GIL: threads scale)."""
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


class ChecksumWriter:
    """A write-only file wrapper that counts and crc32s the bytes on their way to disk, so the commit record's
    checksum costs no second read of the part."""

    def __init__(self, f: Any):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.f.write(view)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    @property
    def closed(self) -> bool:
        return self.f.closed

    def writable(self) -> bool:
        return True


def stage_part(outdir: str, name: str, table: pa.Table, keys: np.ndarray | None = None,
               rows: int | None = None) -> dict[str, Any]:
    """Steps 1-2 of the commit protocol: the fsynced staging file, its key file and its commit record; returns
    the record. On any failure all of them are removed again (``unstage``), so a full disk leaves the output
    exactly as it was before the commit."""
    staged, final = os.path.join(outdir, staging_name(name)), os.path.join(outdir, name)
    try:
        with disk_full_named(final, lambda: _size(staged), "this part was not committed"):
            with open(staged, "wb") as f:
                w = ChecksumWriter(f)
                pq.write_table(table, w, compression="zstd", row_group_size=256 * 1024)
                f.flush()
                os.fsync(f.fileno())
        record = {"part": name, "rows": table.num_rows if rows is None else rows, "outputs": table.num_rows,
                  "bytes": w.size, CHECKSUM: w.crc, "committed_at": time.time()}
        if keys is not None:
            write_keys(outdir, name, keys)
            record["keys_crc32"] = keys_checksum(keys)
        write_record(outdir, name, record)
    except BaseException:
        unstage(outdir, name)
        raise
    return record


def unstage(outdir: str, name: str) -> None:
    """Remove an uncommitted part's staging file and sidecars. The record goes first: a record with neither
    part nor staging file is how a lost committed part is recognised (``resume.check_parts``)."""
    for path in (record_path(outdir, name), keys_path(outdir, name), os.path.join(outdir, staging_name(name))):
        _unlink_quietly(path)


def write_part_atomically(outdir: str, name: str, table: pa.Table, keys: np.ndarray | None = None,
                          rows: int | None = None) -> dict[str, Any]:
    """Steps 1-4 of the commit protocol; returns the commit record. Nothing of a failed commit stays behind."""
    record = stage_part(outdir, name, table, keys, rows)
    try:
        with disk_full_named(os.path.join(outdir, name), lambda: record["bytes"], "this part was not committed"):
            os.rename(os.path.join(outdir, staging_name(name)), os.path.join(outdir, name))
    except BaseException:
        unstage(outdir, name)
        raise
    fsync_dir(outdir)
    return record


@dataclass
class SinkStats:
    """What the sink has taken in: the one tally of rows, tokens and tau (progress, state file and the final
    summary all read it here, so they cannot disagree)."""

    rows: int = 0  # input rows
    outputs: int = 0  # output rows (rows x samples)
    error_rows: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    spec_tokens: float = 0.0  # tokens committed by verify rounds (accept_length x verify_steps): running tau
    parts: int = 0
    last_commit: float = field(default_factory=time.time)

    def add_row(self, results: list[Result]) -> None:
        self.rows += 1
        self.outputs += len(results)
        self.error_rows += any(r.error is not None for r in results)
        for r in results:
            if r.error is None:
                self.completion_tokens += r.completion_tokens
                if r.verify_steps:
                    self.verify_steps += r.verify_steps
                    self.spec_tokens += (r.accept_length or 0.0) * r.verify_steps

    def absorb(self, other: SinkStats) -> None:
        for name in ("rows", "outputs", "error_rows", "completion_tokens", "verify_steps", "spec_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per verify round; None without speculation."""
        return self.spec_tokens / self.verify_steps if self.verify_steps else None


class PartSink:
    """Buffers finished rows and commits them as Parquet parts every ``commit_rows`` rows / ``commit_seconds``."""

    def __init__(self, outdir: str, schema: pa.Schema, shard_tag: str, next_seq: int, num_samples: int,
                 commit_rows: int, commit_seconds: float, attempt: int, on_commit: Callable[[SinkStats], None],
                 commit: Callable[..., dict[str, Any]] | None = None):
        self.outdir, self.schema, self.shard_tag, self.seq = outdir, schema, shard_tag, next_seq
        # how a part is committed: the local protocol here, or an object store's (``outputs.Output.commit_part``)
        self.commit_part = commit or (lambda name, table, keys, rows: write_part_atomically(outdir, name, table,
                                                                                            keys, rows))
        self.num_samples, self.commit_rows, self.commit_seconds = num_samples, commit_rows, commit_seconds
        self.attempt, self.on_commit = attempt, on_commit
        self.save_ids = "output_token_ids" in schema.names
        self.keep_names = [n for n in schema.names[len(BASE_NAMES):] if n != "output_token_ids"]
        self.stats = SinkStats()  # committed by this process
        self._since = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.items: list[WorkItem] = []
        self.results: list[Result] = []  # all samples of the buffered rows, row by row
        self.owners: list[WorkItem] = []  # the row of each result
        self.pending = SinkStats()  # buffered, not committed yet

    def add(self, item: WorkItem, results: list[Result] | None) -> None:
        """Buffer one finished row (all its samples); columns are built at commit time, column by column."""
        if results is None:
            results = [Result(item.row_id, s, error=item.error) for s in range(self.num_samples)]
        self.items.append(item)
        self.results.extend(results)
        self.owners.extend([item] * len(results))
        self.pending.add_row(results)

    @property
    def taken(self) -> SinkStats:
        """Committed plus buffered rows: what progress shows as done, before the next commit."""
        total = SinkStats(parts=self.stats.parts, last_commit=self.stats.last_commit)
        total.absorb(self.stats)
        total.absorb(self.pending)
        return total

    def _columns(self) -> dict[str, list[Any]]:
        rs, owners = self.results, self.owners
        oks = [r.error is None for r in rs]
        cols: dict[str, list[Any]] = {
            "row_id": [o.row_id for o in owners],
            "sample_index": [r.sample_index for r in rs],
            "output": [r.text if ok else None for r, ok in zip(rs, oks, strict=True)],
            # set by the answer step on ok results only
            "reasoning_content": [r.reasoning_content for r in rs],
            "tool_calls": [r.tool_calls for r in rs],
            "finish_reason": [r.finish_reason if ok else "error" for r, ok in zip(rs, oks, strict=True)],
            "status": ["ok" if ok else "error" for ok in oks],
            "error": [r.error for r in rs],
            "prompt_tokens": [r.prompt_tokens if ok or r.prompt_tokens else None
                              for r, ok in zip(rs, oks, strict=True)],
            # null wherever prompt_tokens is: a cache count never stands without the count it is a share of
            "cached_prompt_tokens": [r.cached_prompt_tokens if ok or r.prompt_tokens else None
                                     for r, ok in zip(rs, oks, strict=True)],
            "completion_tokens": [r.completion_tokens if ok else None for r, ok in zip(rs, oks, strict=True)],
            "verify_steps": [r.verify_steps for r in rs],
            "draft_tokens_proposed": [r.draft_tokens_proposed for r in rs],
            "draft_tokens_accepted": [r.draft_tokens_accepted for r in rs],
            "accept_length": [r.accept_length for r in rs],
            "accept_histogram": [r.accept_histogram for r in rs],
            **{name: [getattr(r, name) for r in rs] for name in SOURCE_STATS},
            **_structure_columns(owners),
            "logprobs": [r.logprobs if ok else None for r, ok in zip(rs, oks, strict=True)]
            if any(r.logprobs is not None for r in rs) else [None] * len(rs),
            "latency_s": [r.latency_s for r in rs],
            "attempt": [self.attempt] * len(rs),
        }
        for i, name in enumerate(self.keep_names):
            cols[name] = [o.keep[i] if o.keep is not None else None for o in owners]
        if self.save_ids:
            cols["output_token_ids"] = [r.token_ids if ok else None for r, ok in zip(rs, oks, strict=True)]
        return cols

    def due(self) -> bool:
        return self.pending.rows > 0 and (self.pending.rows >= self.commit_rows
                                          or time.monotonic() - self._since >= self.commit_seconds)

    def commit(self) -> bool:
        """Commit everything buffered as one part. Returns whether a part was written."""
        if not self.pending.rows:
            self._since = time.monotonic()
            return False
        table = pa.Table.from_pydict(self._columns(), schema=self.schema)
        meta = dict(self.schema.metadata or {})
        meta[b"dspine_batch.part"] = json.dumps(
            {"shard": self.shard_tag, "seq": self.seq, "rows": self.pending.rows, "error_rows": self.pending.error_rows,
             "attempt": self.attempt, "committed_at": time.time()}).encode()
        table = table.replace_schema_metadata(meta)
        name = part_name(self.shard_tag, self.seq)
        keys = np.fromiter((item.row_hash for item in self.items), dtype=np.uint64, count=len(self.items))
        self.commit_part(name, table, keys, self.pending.rows)
        self.stats.absorb(self.pending)
        self.stats.parts += 1
        self.stats.last_commit = time.time()
        self.seq += 1
        self._reset()
        self._since = time.monotonic()
        self.on_commit(self.stats)
        return True


def _structure_columns(owners: list[WorkItem]) -> dict[str, list[Any]]:
    """``structure_kind`` / ``structure`` of each output row: its row's constraint (all samples share it)."""
    structures = [o.requests[0].params.structure if o.requests else None for o in owners]
    if not any(structures):
        return {"structure_kind": structures, "structure": structures}
    return {"structure_kind": [s.kind if s is not None else None for s in structures],
            "structure": [s.spec if s is not None else None for s in structures]}
