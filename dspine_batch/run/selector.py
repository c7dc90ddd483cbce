"""Which input rows a shard still owes: this shard's rows (by row-id hash) not in its done-set, in input order, as work
items (``RowSelector``), each with its span (where it sits in its file, ``outdir.watermark``). It counts what it
read, so the end of a run knows whether every input row was seen, and records each JSON Lines row's line and id for
--retry-errors (``inputs.rowrecord``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dspine_batch.inputs.rowrecord import RowRecorder
from dspine_batch.inputs.sources import InputFile, RowBatch, Start
from dspine_batch.inputs.totals import ReadPosition
from dspine_batch.outdir.keyset import KeySet
from dspine_batch.outdir.watermark import Mark
from dspine_batch.requests.mapping import RowMapper, WorkItem


@dataclass
class RowSelector:
    """Input batches -> work items for the rows of this shard that are not committed yet, in input order.
    Counts what it read, so the end of a run knows whether every input row was seen."""

    mapper: RowMapper
    shard: tuple[int, int]
    done: KeySet
    rows: int = 0  # rows of this shard read from the inputs
    skipped: int = 0  # of which already committed
    finished: bool = False
    position: ReadPosition = field(default_factory=ReadPosition)  # how far into the inputs' bytes (progress)
    recorder: RowRecorder | None = None  # each JSON Lines row's line and id, for --retry-errors (``rowrecord``)
    marks: dict[str, Mark] = field(default_factory=dict)  # rows before these positions are done (``done.load_done``)

    def run(self, batches: Iterator[RowBatch]) -> Iterator[WorkItem]:
        index, count = self.shard
        check_done = len(self.done) > 0
        prev: dict[str, int] = {}  # input name -> position of this shard's last row read (``outdir.watermark``)
        for batch in batches:
            self.position.see(batch)
            ids, problems, hashes = self.mapper.assign_ids(batch)
            if self.recorder is not None:
                self.recorder.see(batch, hashes)
            name = batch.file.name
            at = _positions(batch)
            mask = (hashes % np.uint64(count)) == np.uint64(index) if count > 1 else None
            mine_at = np.flatnonzero(mask) if mask is not None else np.arange(len(at))
            mine = len(mine_at)
            mark = self.marks.get(name)
            if name not in prev:  # read from the top, or from the watermark (then nothing before it is this run's)
                prev[name] = mark.index - 1 if mark is not None and len(at) and at[0] >= mark.index else -1
            lo = np.empty(len(at), dtype=np.int64)
            if mine:
                lo[mine_at] = np.concatenate([[prev[name]], at[mine_at[:-1]]]) + 1
                prev[name] = int(at[mine_at[-1]])
            if check_done:
                todo = ~self.done.contains_many(hashes)
                mask = todo if mask is None else mask & todo
            if mark is not None and len(at) and at[0] < mark.index:  # read anyway (a format that cannot seek)
                todo = at >= mark.index
                mask = todo if mask is None else mask & todo
            picks = range(len(ids)) if mask is None else np.flatnonzero(mask).tolist()
            self.rows += mine
            self.skipped += mine - len(picks)
            if not picks:
                continue
            rows = batch.rows_at(list(picks))
            sel = slice(None) if isinstance(picks, range) else picks  # plain ints, taken once a batch
            los, his = lo[sel].tolist(), (at[sel] + 1).tolist()
            ends = [batch.ends[k] for k in picks] if batch.ends is not None else [-1] * len(los)
            for k, row, a, b, c in zip(picks, rows, los, his, ends, strict=True):
                item = self.mapper.build(ids[k], batch.file, batch.indices[k], row, problems[k], int(hashes[k]))
                item.span = (name, a, b, c)
                yield item
        self.finished = True
        if self.recorder is not None:
            self.recorder.finish(complete=True)


def seek_starts(marks: dict[str, Mark], files: list[InputFile], limit: int | None,
                recorder: RowRecorder | None = None) -> dict[str, Start] | None:
    """Where to start reading each input on a resume: at its watermark, except a JSON Lines input whose row record
    ``--retry-errors`` still needs (``rowrecord``: written by a run that reads every line) and any input under
    ``--limit`` (it counts rows from the top). Rows read below a watermark are skipped by position anyway."""
    if limit is not None or not marks:
        return None
    return {f.name: Start(m.index, m.offset) for f in files
            if (m := marks.get(f.name)) is not None and (recorder is None or not recorder.wants(f.name))}


def _positions(batch: RowBatch) -> np.ndarray:
    """The rows' positions in their file, as an array."""
    ix = batch.indices
    if isinstance(ix, range):
        return np.arange(ix.start, ix.stop, ix.step, dtype=np.int64)
    return np.asarray(ix, dtype=np.int64)


# -- the run ----------------------------------------------------------------------------------------------------
