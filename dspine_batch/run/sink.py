"""The sink: finished rows buffered and committed as Parquet parts every ``--commit-rows`` rows or
``--commit-seconds``.

Rows are built into columns at commit time, all samples of a row in the same part, so "the row's key is in a
committed part" means "the row is done". How a part is committed (exactly once, on any store) is
``dspine_batch.outdir``'s: the sink hands each table to ``Output.commit_part``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dspine_batch.engines.base import Result
from dspine_batch.ops.funnel import drop_reason
from dspine_batch.outdir.layout import part_name
from dspine_batch.outdir.output import open_output, read_part
from dspine_batch.outdir.schema import BASE_NAMES, SOURCE_STATS
from dspine_batch.outdir.watermark import Span
from dspine_batch.requests.mapping import WorkItem

TALLIES = ("rows", "outputs", "error_rows", "filtered", "duplicates", "prompt_tokens", "completion_tokens",
           "verify_steps", "spec_tokens")


@dataclass
class SinkStats:
    """What the sink has taken in: the one tally of rows, tokens and tau (progress, state file and the final
    summary all read it here, so they cannot disagree)."""

    rows: int = 0  # input rows
    outputs: int = 0  # output rows (rows x samples)
    error_rows: int = 0
    filtered: int = 0  # ok rows a stage's ``where`` did not keep
    duplicates: int = 0  # ok rows a stage's ``dedup`` did not keep
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    spec_tokens: float = 0.0  # tokens committed by verify rounds (accept_length x verify_steps): running tau
    by_source: dict[str, int] = field(default_factory=dict)  # the parts' per-source columns (``SOURCE_STATS``)
    parts: int = 0
    last_commit: float = field(default_factory=time.time)
    commit_s: float = 0.0  # how long the last commit took (the metrics' commit latency)

    def add_row(self, results: list[Result], dropped: str | None = None) -> None:
        """One finished row; ``dropped``: why a stage's rules did not keep it (``funnel.drop_reason``)."""
        self.rows += 1
        self.outputs += len(results)
        self.error_rows += any(r.error is not None for r in results)
        self.filtered += dropped in ("where false", "no field", "cut by length")
        self.duplicates += dropped == "duplicate"
        for r in results:
            if r.error is None:
                self.prompt_tokens += r.prompt_tokens or 0
                self.completion_tokens += r.completion_tokens
                if r.verify_steps:
                    self.verify_steps += r.verify_steps
                    self.spec_tokens += (r.accept_length or 0.0) * r.verify_steps
                    for name in SOURCE_STATS:
                        if v := getattr(r, name, None):
                            self.by_source[name] = self.by_source.get(name, 0) + v

    def absorb(self, other: SinkStats) -> None:
        for name in TALLIES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, v in other.by_source.items():
            self.by_source[name] = self.by_source.get(name, 0) + v

    def totals(self) -> dict[str, Any]:
        """The tallies as the state file keeps them (``ShardState``: carried across starts)."""
        return {**{name: getattr(self, name) for name in TALLIES}, "by_source": dict(self.by_source)}

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per verify round; None without speculation."""
        return self.spec_tokens / self.verify_steps if self.verify_steps else None


def committed_tallies(paths: list[str]) -> SinkStats:
    """The tallies of committed parts, read from their columns: what a start carries when its state file lags its
    parts (killed between a commit and the state's save that follows it, or a --retry-errors that took rows out),
    so its totals are the parts' and never count a row twice or miss one."""
    total = SinkStats()
    wanted = ("row_id", "status", "finish_reason", "prompt_tokens", "completion_tokens", "verify_steps",
              "accept_length", "kept", "dropped_by", *SOURCE_STATS)
    for path in paths:
        t = read_part(path, [], wanted).to_pydict()
        seen: dict[str, bool] = {}  # row -> errored (a row's samples are in one part)
        for i, rid in enumerate(t["row_id"]):
            ok = t["status"][i] == "ok"
            if rid not in seen:
                seen[rid] = False
                if "kept" in t and not t["kept"][i]:
                    why = drop_reason(t["dropped_by"][i], t["status"][i], t["finish_reason"][i], None)
                    total.filtered += why in ("where false", "no field", "cut by length")
                    total.duplicates += why == "duplicate"
            seen[rid] = seen[rid] or not ok
            total.outputs += 1
            if not ok:
                continue
            total.prompt_tokens += t["prompt_tokens"][i] or 0
            total.completion_tokens += t["completion_tokens"][i] or 0
            if steps := t["verify_steps"][i]:
                total.verify_steps += steps
                total.spec_tokens += (t["accept_length"][i] or 0.0) * steps
                for name in SOURCE_STATS:
                    if name in t and t[name][i]:
                        total.by_source[name] = total.by_source.get(name, 0) + t[name][i]
        total.rows += len(seen)
        total.error_rows += sum(seen.values())
    return total


class PartSink:
    """Buffers finished rows and commits them as Parquet parts every ``commit_rows`` rows / ``commit_seconds``."""

    def __init__(self, outdir: str, schema: pa.Schema, shard_tag: str, next_seq: int, num_samples: int,
                 commit_rows: int, commit_seconds: float, attempt: int, on_commit: Callable[[SinkStats], None],
                 commit: Callable[..., dict[str, Any]] | None = None):
        self.outdir, self.schema, self.shard_tag, self.seq = outdir, schema, shard_tag, next_seq
        # how a part is committed: ``Output.commit_part`` (``dspine_batch.outdir``)
        self.commit_part = commit or open_output(outdir).commit_part
        self.num_samples, self.commit_rows, self.commit_seconds = num_samples, commit_rows, commit_seconds
        self.attempt, self.on_commit = attempt, on_commit
        self.save_ids = "output_token_ids" in schema.names
        self.keep_names = [n for n in schema.names[len(BASE_NAMES):] if n != "output_token_ids"]
        self.stats = SinkStats()  # committed by this process
        self._since = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.items: list[WorkItem] = []
        self.results: list[Result] = []  # all samples of the buffered rows, row by row
        self.owners: list[WorkItem] = []  # the row of each result
        self.pending = SinkStats()  # buffered, not committed yet

    def add(self, item: WorkItem, results: list[Result] | None) -> None:
        """Buffer one finished row (all its samples); columns are built at commit time, column by column."""
        if results is None:
            results = [Result(item.row_id, s, error=item.error) for s in range(self.num_samples)]
        self.items.append(item)
        self.results.extend(results)
        self.owners.extend([item] * len(results))
        self.pending.add_row(results, self._dropped(item, results))

    def _dropped(self, item: WorkItem, results: list[Result]) -> str | None:
        """Why a stage's rules did not keep this row (None: kept, or a job without rules)."""
        if item.keep is None or "dropped_by" not in self.keep_names:
            return None
        v = dict(zip(self.keep_names, item.keep, strict=True))
        if v.get("kept"):
            return None
        status = "error" if item.error or any(r.error for r in results) else "ok"
        return drop_reason(v.get("dropped_by"), status, results[0].finish_reason if results else None, None)

    @property
    def taken(self) -> SinkStats:
        """Committed plus buffered rows: what progress shows as done, before the next commit."""
        total = SinkStats(parts=self.stats.parts, last_commit=self.stats.last_commit)
        total.absorb(self.stats)
        total.absorb(self.pending)
        return total

    def _columns(self) -> dict[str, list[Any]]:
        rs, owners = self.results, self.owners
        oks = [r.error is None for r in rs]
        cols: dict[str, list[Any]] = {
            "row_id": [o.row_id for o in owners],
            "sample_index": [r.sample_index for r in rs],
            "output": [r.text if ok else None for r, ok in zip(rs, oks, strict=True)],
            # set by the answer step on ok results only
            "reasoning_content": [r.reasoning_content for r in rs],
            "tool_calls": [r.tool_calls for r in rs],
            "finish_reason": [r.finish_reason if ok else "error" for r, ok in zip(rs, oks, strict=True)],
            "status": ["ok" if ok else "error" for ok in oks],
            "error": [r.error for r in rs],
            "prompt_tokens": [r.prompt_tokens if ok or r.prompt_tokens else None
                              for r, ok in zip(rs, oks, strict=True)],
            # null wherever prompt_tokens is: a cache count never stands without the count it is a share of
            "cached_prompt_tokens": [r.cached_prompt_tokens if ok or r.prompt_tokens else None
                                     for r, ok in zip(rs, oks, strict=True)],
            "completion_tokens": [r.completion_tokens if ok else None for r, ok in zip(rs, oks, strict=True)],
            "verify_steps": [r.verify_steps for r in rs],
            "draft_tokens_proposed": [r.draft_tokens_proposed for r in rs],
            "draft_tokens_accepted": [r.draft_tokens_accepted for r in rs],
            "accept_length": [r.accept_length for r in rs],
            "accept_histogram": [r.accept_histogram for r in rs],
            **{name: [getattr(r, name) for r in rs] for name in SOURCE_STATS},
            **_structure_columns(owners),
            "logprobs": [r.logprobs if ok else None for r, ok in zip(rs, oks, strict=True)]
            if any(r.logprobs is not None for r in rs) else [None] * len(rs),
            "latency_s": [r.latency_s for r in rs],
            "attempt": [self.attempt] * len(rs),
        }
        for i, name in enumerate(self.keep_names):
            cols[name] = [o.keep[i] if o.keep is not None else None for o in owners]
        if self.save_ids:
            cols["output_token_ids"] = [r.token_ids if ok else None for r, ok in zip(rs, oks, strict=True)]
        return cols

    def due(self) -> bool:
        return self.pending.rows > 0 and (self.pending.rows >= self.commit_rows
                                          or time.monotonic() - self._since >= self.commit_seconds)

    def commit(self) -> bool:
        """Commit everything buffered as one part. Returns whether a part was written."""
        if not self.pending.rows:
            self._since = time.monotonic()
            return False
        table = pa.Table.from_pydict(self._columns(), schema=self.schema)
        meta = dict(self.schema.metadata or {})
        meta[b"dspine_batch.part"] = json.dumps(
            {"shard": self.shard_tag, "seq": self.seq, "rows": self.pending.rows, "error_rows": self.pending.error_rows,
             "attempt": self.attempt, "committed_at": time.time()}).encode()
        table = table.replace_schema_metadata(meta)
        name = part_name(self.shard_tag, self.seq)
        keys = np.fromiter((item.row_hash for item in self.items), dtype=np.uint64, count=len(self.items))
        t0 = time.monotonic()
        self.commit_part(name, table, keys, self.pending.rows, spans=part_spans(self.items))
        self.stats.commit_s = time.monotonic() - t0
        self.stats.absorb(self.pending)
        self.stats.parts += 1
        self.stats.last_commit = time.time()
        self.seq += 1
        self._reset()
        self._since = time.monotonic()
        self.on_commit(self.stats)
        return True


def part_spans(items: list[WorkItem]) -> dict[str, list[Span]] | None:
    """Where a part's rows sit in the inputs (``outdir.watermark``), by file; None unless every row has a span (a
    part's spans must cover all its rows, or a resume would drop rows it never reads again)."""
    by_file: dict[str, list[list[int]]] = {}
    for item in items:
        if item.span is None:
            return None
        name, lo, hi, off = item.span
        got = by_file.setdefault(name, [])
        if got and got[-1][1] == lo:  # the row after the last one (most are): one interval grows, no new one
            got[-1][1], got[-1][2] = hi, off
        else:
            got.append([lo, hi, off])
    return {name: [(a, b, c) for a, b, c in v] for name, v in by_file.items()} or None


def _structure_columns(owners: list[WorkItem]) -> dict[str, list[Any]]:
    """``structure_kind`` / ``structure`` of each output row: its row's constraint (all samples share it)."""
    structures = [o.requests[0].params.structure if o.requests else None for o in owners]
    if not any(structures):
        return {"structure_kind": structures, "structure": structures}
    return {"structure_kind": [s.kind if s is not None else None for s in structures],
            "structure": [s.spec if s is not None else None for s in structures]}
