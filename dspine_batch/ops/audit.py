"""``finalize``'s exactly-once audit: in memory while it fits, by hash partition past it.

Coverage is checked on exact row-id strings (not the 64-bit hashes the run used), with Arrow group-bys: every
expected row present with samples 0..k-1 once each (k = --num-samples, or the row's own ``n``), nothing unexpected.

The group-bys and joins hold every row id of the job at once: ~0.5 KB a row (539 MB at 1M rows, measured), so
~50 GB at 100M rows, which only a large node has. Every check above is a property of one row id, so the rows can be
split by a hash of the id into buckets that are each checked alone and the findings added up: with more than
``DSPINE_BATCH_AUDIT_ROWS`` output rows (default 2M, ~1 GB), one pass over the parts and one over the expected ids
write each row to its bucket's Arrow file in a temporary directory (``$TMPDIR``; ~30 bytes a row twice), then the
buckets are audited one at a time. Memory is then one bucket's, whatever the job's size; the findings are the same
numbers, and the examples named are the first bucket's that has one.

The bucket hash (``string_hashes``) is a polynomial hash over the ids' UTF-8 bytes computed with numpy on Arrow's
buffers (no Python object per row): only a split, never a key, so collisions cost balance, not correctness.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.log import log
from dspine_batch.outdir.keyset import fallback_id_hashes, key_hashes
from dspine_batch.outdir.output import arrow_path, committed_parts

ENV_ROWS = "DSPINE_BATCH_AUDIT_ROWS"
AUDIT_ROWS = 2_000_000  # output rows audited in memory at once (~1 GB at the measured ~0.5 KB a row)
BATCH = 131_072  # rows hashed and split at a time (~30 MB of numpy temporaries at 30-byte ids)
_P = np.uint64(0x100000001B3)  # FNV's 64-bit prime: odd, so its powers never vanish mod 2^64

EMPTY = pa.schema([("row_id", pa.string()), ("sample_index", pa.int32())])
Expected = Callable[[dict], Iterable[pa.Array]]  # the row ids there must be, in chunks, from the manifest


def audit_rows() -> int:
    try:
        return max(1, int(os.environ.get(ENV_ROWS, AUDIT_ROWS)))
    except ValueError:
        return AUDIT_ROWS


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches the low bits the bucket is taken from."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def string_hashes(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash of each string (null as ""), from Arrow's offsets and bytes: sum of byte * P^position within
    the string (mod 2^64), its length mixed in. The same string hashes the same in any array, batch or offset."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    arr = pc.fill_null(arr.cast(pa.large_string()), "")
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    _, offsets_buf, data_buf = arr.buffers()
    offs = np.frombuffer(offsets_buf, dtype=np.int64, count=n + 1, offset=arr.offset * 8)
    lengths = np.diff(offs)
    base, total = int(offs[0]), int(offs[-1] - offs[0])
    h = np.zeros(n, dtype=np.uint64)
    if total:
        data = np.frombuffer(data_buf, dtype=np.uint8, count=total, offset=base).astype(np.uint64)
        starts = offs[:-1] - base
        rel = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        powers = np.cumprod(np.full(int(lengths.max()), _P, dtype=np.uint64))  # P^1, P^2, ... (wrapping)
        with np.errstate(over="ignore"):
            prod = data * powers[rel]
            nonempty = lengths > 0
            h[nonempty] = np.add.reduceat(prod, starts[nonempty])
    with np.errstate(over="ignore"):
        return _mix(h ^ lengths.astype(np.uint64))


@dataclass
class Findings:
    """What the audit found, added up over buckets (examples: the first bucket's that has one)."""

    dup: int = 0
    dup_example: str | None = None
    gaps: int = 0
    gaps_example: str | None = None
    expected: int = 0
    missing: int = 0
    missing_example: str | None = None
    extra: int = 0
    extra_example: str | None = None
    missing_by_shard: dict[int, int] = field(default_factory=dict)

    def problems(self, shards: int) -> list[str]:
        out = []
        if self.dup:
            out.append(f"{self.dup:,} (row, sample) pairs appear more than once, e.g. {self.dup_example}")
        if self.gaps:
            out.append(f"{self.gaps:,} rows do not have samples 0..k-1 exactly once each, e.g. {self.gaps_example}")
        if self.missing:
            out.append(f"{self.missing:,} of {self.expected:,} input rows are missing, e.g. {self.missing_example} "
                       "(run generate again)")
            if shards > 1:
                by = dict(sorted(self.missing_by_shard.items()))
                out.append("missing rows by shard: " + ", ".join(f"{i}/{shards}: {c:,}" for i, c in by.items())
                           + f" (rerun those shards: generate --shard I/{shards}, or array indices "
                           + ",".join(str(i) for i in by) + ")")
        if self.extra:
            out.append(f"{self.extra:,} output rows match no input row, e.g. {self.extra_example}")
        return out


def missing_by_shard(row_ids: list[str], shards: int, id_column: bool) -> dict[int, int]:
    """How many of ``row_ids`` each shard owns (the same hash the run used to split rows)."""
    hashes = (key_hashes if id_column else fallback_id_hashes)(row_ids)
    counts = np.bincount((hashes % np.uint64(shards)).astype(np.int64), minlength=shards)
    return {i: int(c) for i, c in enumerate(counts) if c}


def check_bucket(got: pa.Table, want: pa.Array, f: Findings, shards: int, id_column: bool) -> None:
    """The audit of one bucket (or of everything): ``got`` the outputs' (row_id, sample_index), ``want`` the
    expected row ids, both holding every row of their bucket and none of another's."""
    counts = got.group_by(["row_id", "sample_index"]).aggregate([([], "count_all")])
    dup = counts.filter(pc.greater(counts["count_all"], 1))
    if dup.num_rows:
        f.dup += dup.num_rows
        f.dup_example = f.dup_example or dup["row_id"][0].as_py()
    # a row's own `n` may differ from --num-samples, so each row's samples must be exactly 0..k-1 for some k
    # (the sink commits a row's samples together, so a row short of samples can only be a bug)
    per_row = counts.group_by("row_id").aggregate([([], "count_all"), ("sample_index", "min"),
                                                    ("sample_index", "max")])
    gaps = per_row.filter(pc.or_(pc.not_equal(per_row["sample_index_min"], 0),
                                 pc.not_equal(pc.add(per_row["sample_index_max"], 1), per_row["count_all"])))
    if gaps.num_rows:
        f.gaps += gaps.num_rows
        f.gaps_example = f.gaps_example or gaps["row_id"][0].as_py()
    want_t = pa.table({"row_id": want})
    have = pa.table({"row_id": per_row["row_id"]})
    missing = want_t.join(have, "row_id", join_type="left anti")
    extra = have.join(want_t, "row_id", join_type="left anti")
    f.expected += want_t.num_rows
    if missing.num_rows:
        f.missing += missing.num_rows
        f.missing_example = f.missing_example or missing["row_id"][0].as_py()
        if shards > 1:
            for i, c in missing_by_shard(missing["row_id"].to_pylist(), shards, id_column).items():
                f.missing_by_shard[i] = f.missing_by_shard.get(i, 0) + c
    if extra.num_rows:
        f.extra += extra.num_rows
        f.extra_example = f.extra_example or extra["row_id"][0].as_py()


def _parquet(path: str) -> pq.ParquetFile:
    where = arrow_path(path)
    return pq.ParquetFile(where["source"], filesystem=where.get("filesystem"))


def _output_batches(paths: list[str]) -> Iterator[pa.RecordBatch]:
    """Every committed part's (row_id, sample_index), as ``EMPTY``'s types (parts differ in nullability)."""
    for path in paths:
        for b in _parquet(path).iter_batches(batch_size=BATCH, columns=["row_id", "sample_index"]):
            yield pa.RecordBatch.from_arrays([b.column("row_id").cast(pa.string()),
                                              b.column("sample_index").cast(pa.int32())], schema=EMPTY)


def _split(table: pa.Table | pa.RecordBatch, column: str, buckets: int) -> Iterator[tuple[int, pa.Table]]:
    """(bucket, its rows of ``table``) for each bucket holding any, by ``string_hashes`` of ``column``."""
    b = (string_hashes(table.column(column)) % np.uint64(buckets)).astype(np.int64)
    order = np.argsort(b, kind="stable")
    counts = np.bincount(b, minlength=buckets)
    taken = table.take(pa.array(order))
    at = 0
    for k, c in enumerate(counts):
        if c:
            yield k, taken.slice(at, int(c))
            at += int(c)


def audit_coverage(outdir: str, manifest: dict, expected: Expected, outputs: int | None = None) -> list[str]:
    """Problems with coverage; empty when every input row x sample is present exactly once (``expected``: the
    row ids there must be, in chunks; ``outputs``: the committed output rows when the caller knows them, which
    decides between the audit in memory and the one by buckets)."""
    shards = int(manifest.get("num_shards", 1))
    id_column = manifest["fingerprint_fields"]["columns"]["id"] is not None
    paths = [p.path for p in committed_parts(outdir)]
    if outputs is None:
        outputs = sum(_parquet(p).metadata.num_rows for p in paths)
    buckets = -(-outputs // audit_rows()) if outputs else 1
    f = Findings()
    if buckets <= 1:
        batches = list(_output_batches(paths))
        got = pa.Table.from_batches(batches) if batches else EMPTY.empty_table()
        want = pa.chunked_array(list(expected(manifest)), pa.string())
        check_bucket(got, want, f, shards, id_column)
        return f.problems(shards)
    tmp = tempfile.mkdtemp(prefix="dspine-audit-")
    log(f"audit: {outputs:,} output rows in {buckets} buckets of ~{audit_rows():,} ({ENV_ROWS}), spilled to {tmp}")
    try:
        _spill(tmp, "got", (pa.Table.from_batches([b]) for b in _output_batches(paths)), "row_id", buckets)
        _spill(tmp, "want", (pa.table({"row_id": c}) for c in expected(manifest)), "row_id", buckets)
        for k in range(buckets):
            got = _read(tmp, "got", k, EMPTY)
            want = _read(tmp, "want", k, EMPTY.remove(1))
            check_bucket(got, want.column("row_id"), f, shards, id_column)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return f.problems(shards)


def _spill(tmp: str, what: str, tables: Iterable[pa.Table], column: str, buckets: int) -> None:
    """Every row of ``tables`` appended to its bucket's Arrow file ``tmp/<what>-<k>.arrow``."""
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    try:
        for table in tables:
            for start in range(0, table.num_rows, BATCH):
                for k, rows in _split(table.slice(start, BATCH), column, buckets):
                    if k not in writers:
                        writers[k] = pa.ipc.new_file(os.path.join(tmp, f"{what}-{k}.arrow"), rows.schema)
                    writers[k].write_table(rows)
    finally:
        for w in writers.values():
            w.close()


def _read(tmp: str, what: str, k: int, empty: pa.Schema) -> pa.Table:
    """Bucket ``k``'s rows (read into memory: the file goes when the audit ends)."""
    path = os.path.join(tmp, f"{what}-{k}.arrow")
    if not os.path.exists(path):
        return empty.empty_table()
    with pa.OSFile(path) as src:
        return pa.ipc.open_file(src).read_all()
