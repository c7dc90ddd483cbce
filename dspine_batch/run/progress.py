"""Progress: a tqdm bar on a terminal, plain periodic log lines otherwise (tqdm is noise in batch logs).

It shows rows as they finish (the sink's ``taken`` tally: committed or buffered), not as they commit, and
the rows read from the inputs so far; it only reads those counters, every ``interval`` seconds, so a tick
per row costs a clock read.

With a total it shows done / total, the percentage and the time left (rows left at this run's rate). The total is
exact where the inputs' metadata has it (Parquet footers, Arrow, a dataset's split info; ``totals.exact_rows``),
about a shard's share of it with --shard, and for JSON Lines estimated while reading: rows read so far over the
share of the input bytes they took (``totals.ReadPosition``), marked "~".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from dspine_batch.run.sink import SinkStats


class Progress:
    def __init__(self, mode: str, total: int | None, initial: int, interval: float = 10.0,
                 stream: TextIO | None = None, taken: Callable[[], SinkStats] = SinkStats,
                 read: Callable[[], int] = lambda: 0, share: Callable[[], float | None] = lambda: None,
                 approx: bool = False):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode, self.total, self.initial, self.interval = mode, total, initial, interval
        self.taken, self.read, self.share, self.approx = taken, read, share, approx or total is None
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
            total = self.expected()
            if total is not None and total != self.bar.total:
                self.bar.total = total  # tqdm then shows the percentage and the time left
            self.bar.update(self.initial + stats.rows - self.bar.n)
            self.bar.set_postfix_str(self._postfix(stats, now), refresh=False)
        else:
            self.log_line(stats, now)

    def _postfix(self, stats: SinkStats, now: float) -> str:
        tps = stats.completion_tokens / max(now - self.start, 1e-9)
        tau = f" tau={stats.tau:.2f}" if stats.tau is not None else ""
        err = f" errors={stats.error_rows}" if stats.error_rows else ""
        return f"{stats.completion_tokens:,} tokens, {tps:,.1f} tok/s{tau}{err}"

    def expected(self) -> int | None:
        """The shard's total rows: given, or estimated from the share of the input bytes read so far."""
        if self.total is not None and not (self.approx and self.read() > self.total):
            return self.total
        share, read = self.share(), self.read()
        if share is None or share <= 0 or not read:
            return None
        return max(read, round(read / share))

    def eta(self, stats: SinkStats | None = None, now: float | None = None) -> float | None:
        """Seconds left: the rows left at this run's rate (None without a total or a finished row; 0 when done)."""
        stats = stats if stats is not None else self.taken()
        now = now if now is not None else time.monotonic()
        total, done = self.expected(), self.initial + stats.rows
        rate = stats.rows / max(now - self.start, 1e-9)
        if not total:
            return None
        if total <= done:
            return 0.0
        return (total - done) / rate if rate > 0 else None

    def log_line(self, stats: SinkStats, now: float) -> None:
        dt = max(now - self.start, 1e-9)
        done = self.initial + stats.rows
        total = self.expected()
        of = ""
        if total:
            eta = self.eta(stats, now)
            left = format_seconds(eta) if eta else "-"
            of = f"/{'~' if self.approx else ''}{total:,} ({min(done / total, 1.0):.1%}, {left} left)"
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


def format_seconds(s: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``: a time left as a person reads it."""
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
