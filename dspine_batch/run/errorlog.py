"""Error rows said where they are seen: the first row of each kind of error in the run log as it happens, a count
per kind at the end, and the kinds behind an exceeded ``--max-error-rate``.

A user learns about a bad row while the job runs, in the words the output keeps: the log line carries the
message exactly as the Parquet ``error`` column, ``report`` and ``export`` show it (``errors.RowError``: file,
1-based JSONL line or Parquet row index, the row's id, the field, what was expected). Kinds are
``errors.error_kind`` (field and what went wrong, without the value), the same function ``report`` groups by, so
the log's counts and the report's agree. Only the first row of a kind is printed: a file with a million rows
that all lack a prompt logs one line, not a million.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.errors import error_kind, split_error

TOP = 3  # kinds named in the over-budget line


class ErrorLog:
    """A pipeline step: passes finished rows on unchanged, logging the first error row of each kind."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.counts: Counter[str] = Counter()

    def run(self, finished: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        for item, results in finished:
            error = item.error or next((r.error for r in results or () if r.error), None)
            if error:
                self.note(item.row_id, error)
            yield item, results

    def note(self, row_id: str, error: str) -> None:
        kind = error_kind(error)
        if kind not in self.counts:
            where, _, _ = split_error(error)
            text = error if where is not None else f"row {row_id!r}: {error}"  # an engine's message names no row
            self.log(f"error row: {text} (the first of its kind; each kind is counted at the end)")
        self.counts[kind] += 1

    def summary(self) -> list[str]:
        """The end-of-run lines: rows per kind, most frequent first."""
        if not self.counts:
            return []
        total = sum(self.counts.values())
        lines = [f"{total:,} error row(s) this run, by kind:"]
        lines += [f"  {n:>6,} x {kind}" for kind, n in self.counts.most_common()]
        return lines


def top_kinds(counts: Counter[str], n: int = TOP) -> str:
    """``2 x field 'prompt': missing; 1 x malformed JSON`` (and how many other kinds)."""
    common = counts.most_common(n)
    more = len(counts) - len(common)
    return "; ".join(f"{c:,} x {k}" for k, c in common) + (f"; {more} more kind(s)" if more > 0 else "")


def committed_kinds(parts: list[str]) -> Counter[str]:
    """Error rows per kind in committed parts (reads ``status`` and ``error`` of parts that have errors): what
    the over-budget line names when the errors came from earlier starts too."""
    counts: Counter[str] = Counter()
    for path in parts:
        meta = pq.read_metadata(path).metadata or {}
        if b'"error_rows": 0' in meta.get(b"dspine_batch.part", b""):
            continue
        t = pq.read_table(path, columns=["row_id", "status", "error"])
        t = t.filter(pc.equal(t.column("status"), "error"))
        seen: set[str] = set()
        for rid, err in zip(t.column("row_id").to_pylist(), t.column("error").to_pylist(), strict=True):
            if rid not in seen:  # a row counts once, whatever number of its samples failed
                seen.add(rid)
                counts[error_kind(err or "failed")] += 1
    return counts


def part_paths(outdir: str, tag: str) -> list[str]:
    from dspine_batch.outdir.output import list_parts

    return [p.path for p in list_parts(outdir, tag) if os.path.exists(p.path)]
