"""A select step (a ``[[stages]]`` table with ``select = {...}`` and no template): the best rows of each group of the
stage before it, decided once every row of the group is committed; no model runs.

::

    [[stages]]
    name = "best"
    select = {group = "root_id", by = "score", keep = 1, order = "desc"}
    # or keep = "all above" with threshold = 0.5: every row whose `by` is above it (rejection sampling)

Its rows are its parent stage's kept rows, one each (the same ids, the parent's ``output``, its fields in the
context); those not selected are ``kept = false`` with ``dropped_by = "select: rank 3 of 4"``. Its own ``where``
and ``dedup`` then apply to the selected rows.

``group`` is ``root_id`` (every row descending from one input row: the n samples of a question) or the name of an
earlier stage (rows sharing that stage's row: its lineage id). Either way a group lives in one shard (shards go
by root), so shards never split a group. A group is decided by a pure function of its rows, which are committed
and immutable in the parent stage: ranked by ``by`` (``order``), ties broken by row id, the same on every start.
The runner decides a select stage's groups once every stage before it is finished in this shard (``segment``), from
its parent's committed parts (``run.stage.select_rows``), so each group is complete; a start killed half way through
committing a group's rows decides the group again from the same rows, the same way, and commits only the rows not
yet committed — exactly once without claims.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dspine_batch.errors import UsageError

ALL_ABOVE = "all above"


@dataclass(frozen=True)
class SelectSpec:
    """How a select step ranks and keeps: ``keep`` rows per group (an int), or every row above ``threshold``."""

    group: str = "root_id"
    by: str = "score"
    keep: int | None = 1  # None: "all above"
    order: str = "desc"
    threshold: float | None = None

    def identity(self) -> dict[str, Any]:
        return {"group": self.group, "by": self.by, "keep": ALL_ABOVE if self.keep is None else self.keep,
                "order": self.order, "threshold": self.threshold}


_KEYS = ("group", "by", "keep", "order", "threshold")


def parse_select(value: Any, label: str, earlier: list[str]) -> SelectSpec:
    """``select = {...}`` checked (``UsageError`` naming the stage); ``earlier``: the names of the stages before."""
    if not isinstance(value, Mapping):
        raise UsageError(f'{label}: `select` must be a table: {{group = "root_id", by = "score", keep = 1}}')
    unknown = [k for k in value if k not in _KEYS]
    if unknown:
        raise UsageError(f"{label}: select: unknown key {unknown[0]!r} (it takes {', '.join(_KEYS)})")
    group, by = value.get("group", "root_id"), value.get("by", "score")
    if group != "root_id" and group not in earlier:
        raise UsageError(f"{label}: select group {group!r}: expected root_id or the name of an earlier stage (a group "
                         "must live in one shard)")
    if not isinstance(by, str) or not by:
        raise UsageError(f"{label}: select `by` names a numeric field of the rows (e.g. score)")
    order = value.get("order", "desc")
    if order not in ("desc", "asc"):
        raise UsageError(f"{label}: select order {order!r}: expected desc or asc")
    keep, threshold = value.get("keep", 1), value.get("threshold")
    if keep == ALL_ABOVE:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
            raise UsageError(f'{label}: select keep = "{ALL_ABOVE}" needs a numeric `threshold`')
        return SelectSpec(group, by, None, order, float(threshold))
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise UsageError(f'{label}: select keep must be a whole number >= 1 or "{ALL_ABOVE}"')
    if threshold is not None:
        raise UsageError(f'{label}: select `threshold` goes with keep = "{ALL_ABOVE}"')
    return SelectSpec(group, by, keep, order)


def group_of(spec: SelectSpec, root_id: str, lineage: Mapping[str, str]) -> str:
    """The group a row belongs to: its root, or its row at the named earlier stage."""
    return root_id if spec.group == "root_id" else str(lineage.get(spec.group, root_id))


def number(value: Any) -> float | None:
    """``value`` as a rankable number (bools and NaN are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def decide(spec: SelectSpec, rows: list[tuple[str, Any]]) -> dict[str, str | None]:
    """One group's decision: row id -> None (selected) or why not (``dropped_by``). ``rows``: (row id, the value of
    ``by``). Ranked by value (``order``), ties by row id; a row without a number ranks after every other."""
    values = {rid: number(v) for rid, v in rows}
    sign = -1.0 if spec.order == "desc" else 1.0
    ranked = sorted(values, key=lambda rid: (values[rid] is None, sign * (values[rid] or 0.0), rid))
    out: dict[str, str | None] = {}
    n = len(ranked)
    for rank, rid in enumerate(ranked, 1):
        v = values[rid]
        if v is None:
            out[rid] = f"select: no number in {spec.by!r} (rank {rank} of {n})"
        elif spec.keep is not None:
            out[rid] = None if rank <= spec.keep else f"select: rank {rank} of {n}"
        else:
            assert spec.threshold is not None
            above = v > spec.threshold if spec.order == "desc" else v < spec.threshold
            word = "above" if spec.order == "desc" else "below"
            out[rid] = None if above else f"select: {spec.by} {v:g} not {word} {spec.threshold:g} (rank {rank} of {n})"
    return out
