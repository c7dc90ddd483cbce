"""Watermarks: how far into each input file every row of a shard is committed, so a resume seeks past them.

Each commit record of a first stage carries the part's **spans**: per input file, intervals ``[lo, hi)`` of row
positions (a Parquet/Arrow row index, a JSON Lines line index) such that every row of this shard inside one is in
this part. A row's own span runs from just after the shard's previous row in that file to just after itself: the
positions in between belong to other shards (or are blank lines), which the input alone decides. A JSON Lines span
also names the byte offset (in the decompressed text) where its last line ends, so a resume can seek there.

On resume the spans of every record that checks out are united per file; the **watermark** is the end of the
interval that starts at 0: every row of this shard before it is in a checked part. Nothing is trusted beyond what
the records say about themselves: a record that does not check out is demoted with its spans (a hole: the
watermark stops there and its rows are generated again), a record without spans (from before watermarks, a
compaction's, a ``--retry-errors`` take-out's, a later stage's) is a hole too, and rows finishing out of order only
make more intervals. Only parts holding a row at or above a watermark need their keys in the done-set: the
in-memory done-set is bounded by what sits above the watermarks, not by the rows committed.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ENV = "DSPINE_BATCH_WATERMARKS"  # "0": resume by the full done-set, as before watermarks (benchmarks compare both)

Span = tuple[int, int, int]  # (lo, hi, byte offset where position hi starts; -1 when not a text file)


@dataclass(frozen=True)
class Mark:
    """Every row of the shard in this file before ``index`` is committed; ``offset``: the byte (decompressed) where
    line ``index`` starts in a JSON Lines file, -1 for other formats."""

    index: int
    offset: int = -1


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def merge(spans: Iterable[Span]) -> list[Span]:
    """Intervals united: sorted, touching or overlapping ones joined (the offset of the one reaching furthest)."""
    out: list[list[int]] = []
    for lo, hi, off in sorted(spans):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1][1], out[-1][2] = hi, off
        else:
            out.append([lo, hi, off])
    return [(a, b, c) for a, b, c in out]


def _crc(spans: dict[str, list[Span]]) -> int:
    return zlib.crc32(json.dumps(spans, sort_keys=True, separators=(",", ":")).encode())


def spans_fields(by_file: dict[str, list[Span]]) -> dict[str, Any]:
    """A part's spans as its commit record carries them (merged, with their own crc32, like the keys)."""
    spans = {name: [list(s) for s in merge(v)] for name, v in by_file.items()}
    return {"spans": spans, "spans_crc32": _crc(spans)}  # type: ignore[arg-type]


def record_spans(record: dict[str, Any]) -> dict[str, list[Span]] | None:
    """A record's spans when they check out, else None (the part is then a hole, its keys loaded)."""
    spans = record.get("spans")
    if not isinstance(spans, dict) or _crc(spans) != record.get("spans_crc32"):
        return None
    try:
        return {str(name): [(int(a), int(b), int(c)) for a, b, c in v] for name, v in spans.items()}
    except (TypeError, ValueError):
        return None


def watermarks(parts: dict[str, dict[str, list[Span]]]) -> tuple[dict[str, Mark], set[str]]:
    """(file -> watermark, the parts wholly below the watermarks) from the checked parts' spans (part -> spans).
    A part is wholly below when each of its intervals ends at or before its file's watermark: its rows are never
    read again, so its keys need not be loaded."""
    by_file: dict[str, list[Span]] = {}
    for spans in parts.values():
        for name, v in spans.items():
            by_file.setdefault(name, []).extend(v)
    marks: dict[str, Mark] = {}
    for name, v in by_file.items():
        merged = merge(v)
        if merged and merged[0][0] == 0:
            marks[name] = Mark(merged[0][1], merged[0][2])
    below = {part for part, spans in parts.items()
             if spans and all(name in marks and hi <= marks[name].index for name, v in spans.items() for _, hi, _ in v)}
    return marks, below
