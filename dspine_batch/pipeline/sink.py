"""Parquet part writer with atomic commits: the only code that makes output visible.

Commit protocol (invariant: a part is committed iff it exists under its final name):
  1. write ``OUTDIR/.{name}.inprogress`` (hidden: readers and globs for ``*.parquet`` skip it),
  2. fsync the file, 3. rename to ``OUTDIR/{name}`` (atomic on POSIX), 4. fsync the directory.
All samples of a row go into the same part, so "row_id present in a part" means "row done".
A crash before 3 leaves only a staging file, deleted on the next start; after 3 the rows are done.

Before step 1, the 64-bit hashes of the part's row ids are written (temp, fsync, rename) to
``_dspine/keys/keys-{shard}-{seq}.npy``, so a resume loads its done-set without reading or hashing row ids. A key file
without its part (crash in between) is overwritten by the next commit of the same name; a part whose key
file is missing or does not match its row count falls back to reading ``row_id`` (``resume.load_done``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.engines.base import Result
from dspine_batch.pipeline.mapping import WorkItem
from dspine_batch.pipeline.schema import BASE_NAMES

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


def keys_path(outdir: str, name: str) -> str:
    """``train-X.parquet`` -> ``_dspine/keys/keys-X.npy`` (no "train" in it: datasets' split pattern)."""
    return os.path.join(outdir, KEYS_DIR, "keys-" + name.removeprefix(PART_PREFIX).removesuffix(".parquet") + ".npy")


def write_keys(outdir: str, name: str, keys: np.ndarray) -> None:
    path = keys_path(outdir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, keys.astype("<u8"), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part_atomically(outdir: str, name: str, table: pa.Table) -> None:
    staged = os.path.join(outdir, staging_name(name))
    with open(staged, "wb") as f:
        pq.write_table(table, f, compression="zstd", row_group_size=256 * 1024)
        f.flush()
        os.fsync(f.fileno())
    os.rename(staged, os.path.join(outdir, name))
    fsync_dir(outdir)


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
                 commit_rows: int, commit_seconds: float, attempt: int, on_commit: Callable[[SinkStats], None]):
        self.outdir, self.schema, self.shard_tag, self.seq = outdir, schema, shard_tag, next_seq
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
            "finish_reason": [r.finish_reason if ok else "error" for r, ok in zip(rs, oks, strict=True)],
            "status": ["ok" if ok else "error" for ok in oks],
            "error": [r.error for r in rs],
            "prompt_tokens": [r.prompt_tokens if ok or r.prompt_tokens else None
                              for r, ok in zip(rs, oks, strict=True)],
            "completion_tokens": [r.completion_tokens if ok else None for r, ok in zip(rs, oks, strict=True)],
            "verify_steps": [r.verify_steps for r in rs],
            "draft_tokens_proposed": [r.draft_tokens_proposed for r in rs],
            "draft_tokens_accepted": [r.draft_tokens_accepted for r in rs],
            "accept_length": [r.accept_length for r in rs],
            "accept_histogram": [r.accept_histogram for r in rs],
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
        keys = [item.row_hash for item in self.items]
        write_keys(self.outdir, name, np.fromiter(keys, dtype=np.uint64, count=len(keys)))
        write_part_atomically(self.outdir, name, table)
        self.stats.absorb(self.pending)
        self.stats.parts += 1
        self.stats.last_commit = time.time()
        self.seq += 1
        self._reset()
        self._since = time.monotonic()
        self.on_commit(self.stats)
        return True
