"""Progress: a tqdm bar on a terminal, plain periodic log lines otherwise (tqdm is noise in batch logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, mode: str, total: int | None, initial: int, interval: float = 10.0,
                 stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode, self.total, self.initial, self.interval = mode, total, initial, interval
        self.rows = self.errors = self.tokens = self.steps = self.spec_tokens = 0
        self.start = self._last = time.monotonic()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="row", file=self.stream, dynamic_ncols=True,
                            smoothing=0.1)

    def update(self, rows: int, errors: int, tokens: int, steps: int, spec_tokens: float) -> None:
        self.rows += rows
        self.errors += errors
        self.tokens += tokens
        self.steps += steps
        self.spec_tokens += spec_tokens
        if self.mode == "none":
            return
        now = time.monotonic()
        if self.bar is not None:
            if now - self._last >= 0.2:  # tqdm per row would cost more than the rest of the pipeline
                self._last = now
                self.bar.update(self.initial + self.rows - self.bar.n)
                self.bar.set_postfix_str(self._postfix(now), refresh=False)
        elif now - self._last >= self.interval:
            self._last = now
            self.log_line(now)

    def _postfix(self, now: float) -> str:
        tps = self.tokens / max(now - self.start, 1e-9)
        tau = f" tau={self.spec_tokens / self.steps:.2f}" if self.steps else ""
        err = f" errors={self.errors}" if self.errors else ""
        return f"{tps:,.0f} tok/s{tau}{err}"

    def log_line(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        dt = max(now - self.start, 1e-9)
        done = self.initial + self.rows
        of = f"/{self.total:,}" if self.total else ""
        print(f"dspine-batch: {done:,}{of} rows ({self.rows / dt:,.1f} rows/s this run) | {self._postfix(now)}",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.initial + self.rows - self.bar.n)
            self.bar.set_postfix_str(self._postfix(time.monotonic()))
            self.bar.close()
        elif self.mode == "log":
            self.log_line()
