"""A stage's rows: what each carries forward (its context and lineage), how the next stage's rows are made from
the committed ones (parsed output, ``explode``), and how a finished row is judged (``where``, ``dedup``).

Every stage's output has the same extra columns (``LINEAGE_FIELDS``): ``root_id`` (the first stage's row id: the
lineage's name, and what shards go by), ``lineage`` (JSON: each earlier stage's row id by stage name), ``context``
(JSON: the columns the row's template saw, for the stages after it), ``kept`` (whether the row goes further:
ok, passed ``where``, not a duplicate), ``dropped_by`` (why not) and ``dedup_key`` (the normalised-text hash a
duplicate is found by, so a resume rebuilds the set from the committed rows).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dspine_batch.engines.base import Result
from dspine_batch.errors import RowError
from dspine_batch.outdir.output import arrow_path
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.stages import near
from dspine_batch.stages.claims import RELEASED, Claims, Owner
from dspine_batch.stages.spec import StageSpec

LINEAGE_FIELDS = ("root_id", "lineage", "context", "kept", "dropped_by", "dedup_key")
LINEAGE_TYPES = (pa.string(), pa.string(), pa.string(), pa.bool_(), pa.string(), pa.string())
JSON_KINDS = ("json_schema", "json_object")


def carried(row: dict[str, Any], root_id: str, lineage: dict[str, str], context: dict[str, Any]) -> dict[str, Any]:
    """A row with its lineage columns set (``kept``/``dropped_by``/``dedup_key`` are decided after generation)."""
    return {**row, "root_id": root_id, "lineage": json.dumps(lineage, ensure_ascii=False),
            "context": json.dumps(context, ensure_ascii=False, default=str), "kept": None, "dropped_by": None,
            "dedup_key": None}


@dataclass
class Parent:
    """A committed row of a stage, as the next stage reads it."""

    row_id: str
    sample_index: int
    samples: int
    output: str
    structure_kind: str | None
    root_id: str
    lineage: dict[str, str]
    context: dict[str, Any]

    @property
    def base(self) -> str:
        """The id its children start from: the row id, with ``#<sample>`` when the parent stage draws several
        samples per row (``samples``: the stage's --num-samples) or this is a later sample of a row's own ``n``.
        It depends on the committed row alone, so a resume makes the same ids.

        A row id that already ends like a sample's (``a#1``: ids are the user's, any text) takes the mark even as
        sample 0 (``a#1#0``), or it would be the same id as sample 1 of a row ``a`` whose own ``n`` is 2: ids made
        this way never collide (an unmarked id never ends in ``#<digits>``, a marked one always does, and the
        mark is read from the right)."""
        if self.samples == 1 and self.sample_index == 0 and not _SAMPLE_MARK.search(self.row_id):
            return self.row_id
        return f"{self.row_id}#{self.sample_index}"


_SAMPLE_MARK = re.compile(r"#\d+$")
_ITEM_MARK = re.compile(r"/(?:\d+|-)$")


def unexploded_id(base: str) -> str:
    """The id of the one error row a parent gives when its ``explode`` field is not a list: its base, marked
    ``/-`` when the base itself ends like an item's id (``b/0``), which would otherwise be item 0 of a parent
    ``b`` — the same reasoning as ``Parent.base``'s."""
    return f"{base}/-" if _ITEM_MARK.search(base) else base


def parent_fields(p: Parent, stage: str) -> dict[str, Any]:
    """What a child's template and ``where`` see of its parent: the parent's own context, ``output``, the parsed
    fields of a JSON output at the top level, and the same under the parent stage's name (``{{ questions.output
    }}``; a field of the output named like the stage wins), plus ``root_id`` and ``lineage``."""
    fields: dict[str, Any] = {"output": p.output}
    if p.structure_kind in JSON_KINDS:
        try:
            parsed = json.loads(p.output)
        except (ValueError, RecursionError):  # nested past the recursion limit: bad JSON all the same
            parsed = None
        if isinstance(parsed, dict):
            fields.update(parsed)
    return {**p.context, stage: dict(fields), **fields, "root_id": p.root_id, "lineage": p.lineage}


def child_ids(p: Parent, explode: str | None) -> list[str]:
    """The ids of a parent's children (what ``children`` makes, without building rows): for ``finalize``."""
    base = p.base
    if explode is None:
        return [base]
    items = parent_fields(p, "").get(explode)
    return [f"{base}/{i}" for i in range(len(items))] if isinstance(items, list) else [unexploded_id(base)]


def children(p: Parent, parent_stage: str, spec: StageSpec) -> Iterator[tuple[str, dict[str, Any] | RowError]]:
    """(child id, row) of a parent for stage ``spec``: one child (the parent's id; ``#s`` per sample when the
    parent stage drew several), or with ``explode`` one per item of the named list field (``<id>/<i>``, stable
    across resumes). A field that is not a list gives one error row naming it (``unexploded_id``)."""
    base = p.base
    lineage = {**p.lineage, parent_stage: base}
    ctx = parent_fields(p, parent_stage)
    if spec.explode is None:
        yield base, carried(ctx, p.root_id, lineage, ctx)
        return
    items = ctx.get(spec.explode)
    if not isinstance(items, list):
        what = "missing" if spec.explode not in ctx else f"expected a list, got {type(items).__name__}"
        yield unexploded_id(base), RowError(f"stage {parent_stage}", 0, spec.explode,
                                            f"{what} (explode of stage {spec.name!r})")
        return
    for i, item in enumerate(items):
        row = {**ctx, spec.explode: item, "explode_index": i}
        yield f"{base}/{i}", carried(row, p.root_id, lineage, row)


PARENT_COLUMNS = ["row_id", "sample_index", "output", "status", "structure_kind", "root_id", "lineage", "context",
                  "kept"]


def committed_parents(paths: Iterable[str], samples: int) -> Iterator[Parent]:
    """The kept rows of a stage's committed parts (``paths``, in commit order) as parents of the next stage:
    what a resume queues again and what ``finalize`` expects the next stage to hold."""
    for path in paths:
        for r in pq.read_table(**arrow_path(path), columns=PARENT_COLUMNS).to_pylist():
            if r["kept"] and r["status"] == "ok" and r["output"] is not None:
                yield Parent(r["row_id"], r["sample_index"], samples, r["output"], r["structure_kind"],
                             r["root_id"] or r["row_id"], json.loads(r["lineage"] or "{}"),
                             json.loads(r["context"] or "{}"))


_SPACE = re.compile(r"\s+")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def dedup_key(value: Any) -> str:
    """The normalised text of a value (case folded, whitespace collapsed; JSON for non-strings), hashed."""
    norm = _SPACE.sub(" ", _text(value).casefold()).strip()
    return hashlib.blake2b(norm.encode(), digest_size=12).hexdigest()


def cut_by_length(where: str) -> str:
    """Why a row whose output reached its token limit fails its stage's ``where`` for want of a field or a whole
    value (a structured output cut before its JSON closed): said as such, not as the field missing."""
    return (f"where {where}: cut by length (the output reached its token limit, finish_reason length, before it held "
            "what the predicate reads; raise max-new-tokens)")


# what a predicate meets in an output cut before its JSON closed: a field not there yet, or half a value of the
# wrong type; a budget blown or an overflow is the data's, said as such whatever the finish reason
_WANT_OF_TEXT = ("no field ", "TypeError:", "ValueError:", "KeyError:", "IndexError:", "AttributeError:")


def for_want_of_text(why: str | None, where: str) -> bool:
    """Whether ``where``'s reason for not keeping a row is one an output cut by length gives."""
    return why is not None and why.startswith(tuple(f"where {where}: {k}" for k in _WANT_OF_TEXT))


@dataclass
class Judge:
    """Decides ``kept`` / ``dropped_by`` / ``dedup_key`` of a stage's finished rows, in the order they are
    committed; ``seen`` holds the dedup keys of the kept rows (rebuilt from the committed parts on resume)."""

    spec: StageSpec
    seen: set[str] = field(default_factory=set)
    kept_rows: set[str] = field(default_factory=set)  # minhash: this shard's kept row ids (claims left by others)
    claims: Claims | None = None  # a sharded job's: keys claimed across its shards (``claims``)
    shard: str = ""
    filtered: int = 0
    duplicates: int = 0
    selected: dict[str, str | None] = field(default_factory=dict)  # a select step's: row id -> why not selected
    unselected: int = 0

    def decide(self, item: WorkItem, results: list[Result] | None, keep_names: list[str]) -> WorkItem:
        if item.keep is None or "kept" not in keep_names:
            return item
        values = dict(zip(keep_names, item.keep, strict=True))
        ok = results is not None and item.error is None and all(r.error is None for r in results)
        kept, why, key = ok, None if ok else "error", None
        if ok:
            r = results[0]  # a row's judgement reads its first sample (a stage with n > 1 keeps all or none)
            ctx = json.loads(values["context"] or "{}")
            kind = item.requests[0].params.structure.kind if item.requests and item.requests[0].params.structure \
                else None
            fields = parent_fields(Parent(item.row_id, 0, 1, r.text, kind, values["root_id"] or item.row_id, {},
                                          ctx), self.spec.name)
            if self.spec.select is not None and self.selected.get(item.row_id):  # ``select``: decided by group
                kept, why = False, self.selected[item.row_id]
                self.unselected += 1
            if kept and self.spec.where is not None:
                kept, why = self.spec.where.test(fields)
                if not kept and r.finish_reason == "length" and for_want_of_text(why, self.spec.where.text):
                    why = cut_by_length(self.spec.where.text)  # no field, or half a value: the output was cut
                self.filtered += not kept
            if kept and self.spec.dedup == "minhash":
                sig = near.signature(_text(fields.get(self.spec.dedup_on, "")), self.spec.dedup_ngram)
                key = near.digest(sig)
                if not self._near_claimed(sig, item.row_id):
                    kept, why = False, f"dedup minhash on {self.spec.dedup_on}"
                    self.duplicates += 1
            elif kept and self.spec.dedup is not None:
                key = dedup_key(fields.get(self.spec.dedup_on, ""))
                if key in self.seen or not self._claimed(key, item.row_id):
                    kept, why = False, f"dedup {self.spec.dedup} on {self.spec.dedup_on}"
                    self.duplicates += 1
                else:
                    self.seen.add(key)
        values.update(kept=kept, dropped_by=why, dedup_key=key)
        return replace(item, keep=tuple(values[n] for n in keep_names))

    def _near_claimed(self, sig: Any, row_id: str) -> bool:
        """Whether no kept row of the job is a near-duplicate of this one: its LSH bands claimed in sorted order
        (``near``), stopping at the first held by a near-duplicate and giving up what this row claimed.

        A band is a chain of slots (``band``, ``band.1``, ...): two rows that share a band without being near
        duplicates (an LSH false positive) both hold it, the second in the next free slot, so a third row near
        the second still finds it there (with one slot a band, the second held nothing and the third was kept
        beside its duplicate). A slot given up becomes ``RELEASED``, never a hole a later walk would stop at. A
        slot held by a row of this shard that is not among its kept rows was left by an attempt that died before
        committing that row (it kept nothing): taken over, as ``_claimed`` does for exact keys."""
        assert self.claims is not None
        me, mine = Owner(self.shard, row_id), []
        note = near.encode(sig)
        for band in near.band_keys(sig, near.bands_for(self.spec.dedup_threshold)):
            for k in range(near.CHAIN):
                slot = band if k == 0 else f"{band}.{k}"
                holder, theirs = self.claims.claim(slot, me, note)
                if holder == me:
                    mine.append(slot)
                    break
                if holder.shard == self.shard and holder.row not in self.kept_rows and holder != RELEASED:
                    self.claims.take(slot, me, note)
                    mine.append(slot)
                    break
                if holder == RELEASED:
                    continue
                other = near.decode(theirs)
                if other is None or near.similarity(sig, other) >= self.spec.dedup_threshold:
                    for claimed in mine:
                        self.claims.take(claimed, RELEASED)
                    return False
        self.kept_rows.add(row_id)
        return True

    def _claimed(self, key: str, row_id: str) -> bool:
        """Whether this row may keep ``key`` across every shard of the job (always, for a job of one shard)."""
        if self.claims is None:
            return True
        me = Owner(self.shard, row_id)
        holder, _ = self.claims.claim(key, me)
        if holder != me and holder.shard == self.shard:
            # a claim by a row of this shard, on a key none of its kept rows holds (``seen``): left by an attempt
            # that died before committing that row — it kept nothing, so the key is free for this row
            holder = self.claims.take(key, me)
        return holder == me
