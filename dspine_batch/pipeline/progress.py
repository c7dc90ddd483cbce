"""Progress: a tqdm bar on a terminal, plain periodic log lines otherwise (tqdm is noise in batch logs).

It shows rows as they finish (the sink's ``taken`` tally: committed or buffered), not as they commit, and
the rows read from the inputs so far; it only reads those counters, every ``interval`` seconds, so a tick
per row costs a clock read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from dspine_batch.pipeline.sink import SinkStats


class Progress:
    def __init__(self, mode: str, total: int | None, initial: int, interval: float = 10.0,
                 stream: TextIO | None = None, taken: Callable[[], SinkStats] = SinkStats,
                 read: Callable[[], int] = lambda: 0):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode, self.total, self.initial, self.interval = mode, total, initial, interval
        self.taken, self.read = taken, read
        self.start = time.monotonic()
        self._last: float | None = None  # the first finished row prints at once: the run is alive
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="row", file=self.stream, dynamic_ncols=True,
                            smoothing=0.1)

    def tick(self) -> None:
        """A row finished."""
        if self.mode == "none":
            return
        now = time.monotonic()
        every = 0.2 if self.bar is not None else self.interval  # tqdm per row would cost more than the pipeline
        if self._last is not None and now - self._last < every:
            return
        self._last = now
        stats = self.taken()
        if self.bar is not None:
            self.bar.update(self.initial + stats.rows - self.bar.n)
            self.bar.set_postfix_str(self._postfix(stats, now), refresh=False)
        else:
            self.log_line(stats, now)

    def _postfix(self, stats: SinkStats, now: float) -> str:
        tps = stats.completion_tokens / max(now - self.start, 1e-9)
        tau = f" tau={stats.tau:.2f}" if stats.tau is not None else ""
        err = f" errors={stats.error_rows}" if stats.error_rows else ""
        return f"{stats.completion_tokens:,} tokens, {tps:,.1f} tok/s{tau}{err}"

    def log_line(self, stats: SinkStats, now: float) -> None:
        dt = max(now - self.start, 1e-9)
        done = self.initial + stats.rows
        of = f"/{self.total:,}" if self.total else ""
        print(f"dspine-batch: {done:,}{of} rows done, {self.read():,} read ({stats.rows / dt:,.1f} rows/s this run) "
              f"| {self._postfix(stats, now)}", file=self.stream, flush=True)

    def close(self) -> None:
        now, stats = time.monotonic(), self.taken()
        if self.bar is not None:
            self.bar.update(self.initial + stats.rows - self.bar.n)
            self.bar.set_postfix_str(self._postfix(stats, now))
            self.bar.close()
            self.bar = None
        elif self.mode == "log":
            self.log_line(stats, now)
            self.mode = "none"  # closed: an exception path may call close again
