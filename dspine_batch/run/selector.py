"""Which input rows a shard still owes: this shard's rows (by row-id hash) not in its done-set, in input order, as
work items (``RowSelector``). It counts what it read, so the end of a run knows whether every input row was seen,
and records each JSON Lines row's line and id for --retry-errors (``inputs.rowrecord``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dspine_batch.inputs.rowrecord import RowRecorder
from dspine_batch.inputs.sources import RowBatch
from dspine_batch.inputs.totals import ReadPosition
from dspine_batch.outdir.keyset import KeySet
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

    def run(self, batches: Iterator[RowBatch]) -> Iterator[WorkItem]:
        index, count = self.shard
        check_done = len(self.done) > 0
        for batch in batches:
            self.position.see(batch)
            ids, problems, hashes = self.mapper.assign_ids(batch)
            if self.recorder is not None:
                self.recorder.see(batch, hashes)
            mask = (hashes % np.uint64(count)) == np.uint64(index) if count > 1 else None
            mine = len(ids) if mask is None else int(mask.sum())
            if check_done:
                todo = ~self.done.contains_many(hashes)
                mask = todo if mask is None else mask & todo
            picks = range(len(ids)) if mask is None else np.flatnonzero(mask).tolist()
            self.rows += mine
            self.skipped += mine - len(picks)
            if not picks:
                continue
            rows = batch.rows_at(list(picks))
            for k, row in zip(picks, rows, strict=True):
                yield self.mapper.build(ids[k], batch.file, batch.indices[k], row, problems[k], int(hashes[k]))
        self.finished = True
        if self.recorder is not None:
            self.recorder.finish(complete=True)


# -- the run ----------------------------------------------------------------------------------------------------
