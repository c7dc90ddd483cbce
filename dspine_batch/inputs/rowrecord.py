"""What each row of a JSON Lines input was: the proof ``--retry-errors`` needs to accept a fixed input.

The run's identity holds a digest of each input's content, so any edit refuses the run. To let a user fix the
lines of failed rows and retry them, the job keeps, for every row of every JSON Lines input, its line index, a
digest of its line and the hash of the id the run gave it (``ROW``): ``_dspine/rows-<k>.bin`` for the k-th input,
written by the first run that reads the whole input (rows stream to a local temp file, put in place whole when the
input ends, so memory does not grow with the input). An edited input is then accepted when every changed line
belonged to a failed row and every other row has the same line and the same id as before (``retry``). The record
lives where the OUTDIR does — a local directory or an object store (``Output.read_blob``/``write_blob``) — so a
fixed input is accepted on both. Every shard reads every row, so every shard writes the same record: whichever
lands is the record.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from dspine_batch.inputs.sources import InputFile, RowBatch
from dspine_batch.storage.objects import local_tmp_dir

ROW = np.dtype([("index", "<u8"), ("line", "<u8"), ("id", "<u8")])


def record_rel(k: int) -> str:
    """The k-th input's record, relative to OUTDIR."""
    return f"_dspine/rows-{k}.bin"


def load(out: Any, k: int) -> np.ndarray | None:
    """The k-th input's record in the OUTDIR ``out`` (an ``outputs.Output``), None when there is none."""
    data = out.read_blob(record_rel(k))
    return None if data is None else np.frombuffer(data, dtype=ROW).copy()


def rows_of(batch: RowBatch, hashes: np.ndarray) -> np.ndarray:
    out = np.empty(len(batch), dtype=ROW)
    out["index"] = np.asarray(batch.indices, dtype=np.uint64)
    out["line"] = np.asarray(batch.digests, dtype=np.uint64)
    out["id"] = hashes
    return out


def save(out: Any, k: int, rows: np.ndarray) -> None:
    """Replace the k-th input's record (a retry's accepted fix)."""
    fd, tmp = tempfile.mkstemp(prefix=".dspine-rows-", dir=local_tmp_dir())
    try:
        with os.fdopen(fd, "wb") as f:
            rows.astype(ROW).tofile(f)
        out.write_blob(record_rel(k), tmp)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class RowRecorder:
    """Streams the record of the JSON Lines inputs not recorded yet as the run reads them (``RowSelector``)."""

    def __init__(self, out: Any, files: Sequence[InputFile], tag: str):
        self.out, self.tag = out, tag
        self.index = {f.name: k for k, f in enumerate(files)
                      if f.kind in ("jsonl", "openai") and not out.has_blob(record_rel(k))}
        self.current: tuple[int, IO[bytes], str] | None = None

    def wants(self, name: str) -> bool:
        """Whether this input's record is still to be written (then every line of it must be read)."""
        return name in self.index

    def see(self, batch: RowBatch, hashes: np.ndarray) -> None:
        k = self.index.get(batch.file.name)
        if self.current is not None and self.current[0] != k:
            self._close(complete=True)
        if k is None or batch.digests is None:
            return
        if self.current is None:
            fd, tmp = tempfile.mkstemp(prefix=f".dspine-rows-{self.tag}-", dir=local_tmp_dir())
            self.current = (k, os.fdopen(fd, "wb"), tmp)
        rows_of(batch, hashes).tofile(self.current[1])

    def finish(self, complete: bool) -> None:
        """The inputs were all read (``complete``), or the run stopped before: then nothing is kept."""
        self._close(complete)

    def _close(self, complete: bool) -> None:
        if self.current is None:
            return
        k, f, tmp = self.current
        self.current = None
        f.close()
        try:
            if complete:
                self.out.write_blob(record_rel(k), tmp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
