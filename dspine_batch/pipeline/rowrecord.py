"""What each row of a JSON Lines input was: the proof ``--retry-errors`` needs to accept a fixed input.

The run's identity holds a digest of each input's content, so any edit refuses the run. To let a user fix the
lines of failed rows and retry them, the job keeps, for every row of every JSON Lines input, its line index, a
digest of its line and the hash of the id the run gave it (``ROW``): ``_dspine/rows-<k>.bin`` for the k-th input,
written by the first run that reads the whole input (rows stream to a temp file, renamed when the input ends,
so memory does not grow with the input). An edited input is then accepted when every changed line belonged to a
failed row and every other row has the same line and the same id as before (``retry.check_inputs``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import IO

import numpy as np

from dspine_batch.pipeline.sources import InputFile, RowBatch

ROW = np.dtype([("index", "<u8"), ("line", "<u8"), ("id", "<u8")])
STATE_DIR = "_dspine"


def record_path(outdir: str, k: int) -> str:
    return os.path.join(outdir, STATE_DIR, f"rows-{k}.bin")


def load(outdir: str, k: int) -> np.ndarray | None:
    path = record_path(outdir, k)
    if not os.path.exists(path):
        return None
    return np.fromfile(path, dtype=ROW)


def rows_of(batch: RowBatch, hashes: np.ndarray) -> np.ndarray:
    out = np.empty(len(batch), dtype=ROW)
    out["index"] = np.asarray(batch.indices, dtype=np.uint64)
    out["line"] = np.asarray(batch.digests, dtype=np.uint64)
    out["id"] = hashes
    return out


def save(outdir: str, k: int, rows: np.ndarray) -> None:
    path = record_path(outdir, k)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        rows.astype(ROW).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RowRecorder:
    """Streams the record of the JSON Lines inputs not recorded yet as the run reads them (``RowSelector``)."""

    def __init__(self, outdir: str, files: Sequence[InputFile], tag: str):
        self.outdir, self.tag = outdir, tag
        self.index = {f.name: k for k, f in enumerate(files)
                      if f.kind in ("jsonl", "openai") and not os.path.exists(record_path(outdir, k))}
        self.current: tuple[int, IO[bytes], str] | None = None
        for k in self.index.values():  # a killed run's unfinished record of this shard
            stale = f"{record_path(outdir, k)}.{tag}.tmp"
            if os.path.exists(stale):
                os.unlink(stale)

    def see(self, batch: RowBatch, hashes: np.ndarray) -> None:
        k = self.index.get(batch.file.name)
        if self.current is not None and self.current[0] != k:
            self._close(complete=True)
        if k is None or batch.digests is None:
            return
        if self.current is None:
            tmp = f"{record_path(self.outdir, k)}.{self.tag}.tmp"
            self.current = (k, open(tmp, "wb"), tmp)  # noqa: SIM115 - closed in _close
        rows_of(batch, hashes).tofile(self.current[1])

    def finish(self, complete: bool) -> None:
        """The inputs were all read (``complete``), or the run stopped before: then nothing is kept."""
        self._close(complete)

    def _close(self, complete: bool) -> None:
        if self.current is None:
            return
        k, f, tmp = self.current
        self.current = None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if complete:
            os.replace(tmp, record_path(self.outdir, k))
        else:
            os.unlink(tmp)
