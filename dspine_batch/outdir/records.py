"""Commit records: what a part is committed as, and the part bytes they describe.

A record names its part, its rows (input rows), outputs (output rows), error rows, bytes and crc32, the unique
``token`` of the commit that made it and the ``staged`` name its bytes were uploaded to, the part's row-key hashes
(``keys_b64``, little-endian uint64 in base64, with their own crc32) and a first stage's ``spans`` (where its rows
sit in the inputs, ``watermark``): a resume builds its done-set from records alone, one small read a part. The crc32
is computed while the part is written (``ChecksumWriter``), so it costs no second read.

Records written before this layout (a local disk) lack ``token``/``staged``/``error_rows``/``keys_b64``; they are
still checked against their part (bytes, crc32, outputs), and their part's key file is ``legacy``'s."""

from __future__ import annotations

import base64
import json
import time
import zlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.outdir.watermark import Span, spans_fields

CHECKSUM = "crc32"  # zlib.crc32: ~1.3 GiB/s on one core (BENCHMARKS.md), stdlib, catches bit rot and torn writes
REQUIRED = frozenset({"bytes", CHECKSUM, "outputs"})


class ChecksumWriter:
    """A write-only file wrapper that counts and crc32s the bytes on their way out, so the commit record's
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


def write_part(table: pa.Table, f: Any) -> ChecksumWriter:
    """A part's Parquet bytes to the open file ``f``; returns the writer (size and crc32 of what went out)."""
    w = ChecksumWriter(f)
    pq.write_table(table, w, compression="zstd", row_group_size=256 * 1024)
    return w


def part_meta(table: pa.Table) -> dict[str, Any]:
    """The part's own bookkeeping (rows, error_rows, attempt, ...) from its schema metadata."""
    return json.loads((table.schema.metadata or {}).get(b"dspine_batch.part", b"{}"))


def keys_checksum(keys: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(keys, dtype="<u8").view(np.uint8))


def keys_fields(keys: np.ndarray) -> dict[str, Any]:
    """A part's row-key hashes as its commit record carries them: the little-endian bytes in base64, their crc32."""
    keys = np.ascontiguousarray(keys, dtype="<u8")
    return {"keys_b64": base64.b64encode(keys.view(np.uint8)).decode(), "keys_crc32": keys_checksum(keys)}


def record_keys(record: dict[str, Any]) -> np.ndarray | None:
    """A commit record's row-key hashes when they check out (``rows`` of them, matching the recorded crc32), else
    None: then the part's row ids are read instead. A doubtful list is never trusted, nor blessed by a new record
    (a compaction's or a retry's): one wrong hash would skip an unrelated row or redo a done one."""
    if not isinstance(record.get("keys_b64"), str):
        return None
    try:
        keys = np.frombuffer(base64.b64decode(record["keys_b64"]), dtype="<u8")
    except ValueError:
        return None
    if len(keys) != record.get("rows") or keys_checksum(keys) != record.get("keys_crc32"):
        return None
    return keys


def new_record(name: str, table: pa.Table, w: ChecksumWriter, token: str, staged: str, rows: int | None,
               keys: np.ndarray | None, spans: dict[str, list[Span]] | None = None) -> dict[str, Any]:
    """The commit record of part ``name`` whose bytes ``w`` wrote from ``table`` (``spans``: its rows' positions
    in the inputs, ``watermark``; only a first stage's parts whose every row has one carry them)."""
    record = {"part": name, "rows": table.num_rows if rows is None else rows, "outputs": table.num_rows,
              "error_rows": part_meta(table).get("error_rows", 0), "bytes": w.size, CHECKSUM: w.crc,
              "committed_at": time.time(), "token": token, "staged": staged}
    if keys is not None:
        record.update(keys_fields(keys))
    if spans is not None:
        record.update(spans_fields(spans))
    return record


def parse_record(data: bytes | None) -> dict[str, Any] | None:
    """A record's content when it reads as one (None when absent, torn or not a record: then its part is trusted
    by its row count, like a part from before records existed — never worse than that)."""
    try:
        rec = json.loads(data) if data else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and REQUIRED <= rec.keys() else None


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def crc_of(f: Any, chunk: int = 4 << 20) -> int:
    """crc32 of an open binary file's bytes, read in 4 MiB chunks into one buffer (zlib releases the GIL: threads
    scale)."""
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    while n := f.readinto(buf):
        crc = zlib.crc32(view[:n], crc)
    return crc
