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

import numpy as np
import pyarrow as pa

from dspine_batch.engines.base import Result
from dspine_batch.errors import RowError
from dspine_batch.outdir.keyset import KeySet, key_hashes
from dspine_batch.outdir.output import read_part
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.stages import near
from dspine_batch.stages.keylog import Entry, KeyLog
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
        for r in read_part(path, PARENT_COLUMNS).to_pylist():
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


_MIX = np.uint64(0x9E3779B97F4A7C15)


def key64s(keys: Iterable[str]) -> np.ndarray:
    """Dedup keys (hex) as 64-bit ints, how the held set keeps them (8 bytes a key in a ``KeySet``, not ~115 in a
    set of strings: every shard holds the whole job's). Two keys sharing their first 64 bits would drop a unique
    row, never keep a duplicate (~1e-4 at 50M kept keys); ``finalize`` audits the full keys."""
    return np.fromiter((int(k[:16], 16) for k in keys), np.uint64)


def pair_hashes(rows: np.ndarray, keys: Iterable[str]) -> np.ndarray:
    """(row-id hash, dedup key) pairs as one 64-bit hash each: how a shard knows its own committed kept rows."""
    with np.errstate(over="ignore"):
        return rows.astype(np.uint64) ^ (key64s(keys) * _MIX)


@dataclass
class NearIndex:
    """The kept rows' MinHash signatures by LSH band (``near``): this shard's, and every other shard's the key log
    holds. A band lists every row holding it, so a false positive never hides a near duplicate behind it.

    Compact, since every shard holds the whole job's kept rows: signatures in one growing ``uint32`` array (512
    bytes a row), bands as sorted ``uint64`` hashes with the row each belongs to (12 bytes a band), new bands in a
    small dict merged into the sorted arrays as it grows (an insert of a sorted batch: linear, not a re-sort)."""

    threshold: float
    bands: near.Bands
    n: int = 0
    sigs: np.ndarray = field(default_factory=lambda: np.empty((0, near.NUM_PERM), np.uint32))
    keys: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))  # sorted band hashes
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint32))  # the row of each
    recent: dict[int, list[int]] = field(default_factory=dict)
    in_recent: int = 0

    def _holding(self, h: int) -> list[int]:
        at = np.uint64(h)
        lo, hi = np.searchsorted(self.keys, at, "left"), np.searchsorted(self.keys, at, "right")
        return self.rows[lo:hi].tolist() + self.recent.get(h, [])

    def near_one(self, sig: np.ndarray, hashes: list[int]) -> bool:
        """Whether a row held here is a near duplicate of ``sig`` (``hashes``: its bands)."""
        return any(near.similarity(sig, self.sigs[j]) >= self.threshold for h in hashes for j in self._holding(h))

    def add(self, sig: np.ndarray, hashes: list[int] | None = None) -> None:
        if self.n == len(self.sigs):
            grown = np.empty((max(1024, 2 * self.n), near.NUM_PERM), np.uint32)
            grown[:self.n] = self.sigs[:self.n]
            self.sigs = grown
        self.sigs[self.n] = sig
        for h in hashes if hashes is not None else near.band_hashes(sig, self.bands):
            self.recent.setdefault(h, []).append(self.n)
            self.in_recent += 1
        self.n += 1
        if self.in_recent >= max(65536, len(self.keys) // 8):
            self._merge()

    def _merge(self) -> None:
        ks = np.fromiter((h for h, js in self.recent.items() for _ in js), np.uint64, self.in_recent)
        rs = np.fromiter((j for js in self.recent.values() for j in js), np.uint32, self.in_recent)
        order = np.argsort(ks, kind="stable")
        ks, rs = ks[order], rs[order]
        at = np.searchsorted(self.keys, ks)
        self.keys, self.rows = np.insert(self.keys, at, ks), np.insert(self.rows, at, rs)
        self.recent, self.in_recent = {}, 0


@dataclass
class Judge:
    """Decides ``kept`` / ``dropped_by`` / ``dedup_key`` of a stage's finished rows. ``where`` is decided as a row
    reaches its sink (``decide``); ``dedup`` when its part is about to be committed (``settle``), all of the part's
    rows at once against every key held before them: this shard's committed and decided rows (``seen``, rebuilt
    from the committed parts on resume) and, through the stage's key log (``keylog``), every other shard's. A
    job of one shard doing exact dedup needs no log (its ``seen`` sees every row)."""

    spec: StageSpec
    seen: KeySet = field(default_factory=KeySet)  # exact: every key held (this shard's, and the log's; ``key64s``)
    own: KeySet = field(default_factory=KeySet)  # this shard's committed kept rows (``pair_hashes``)
    log: KeyLog | None = None
    shard: str = ""
    filtered: int = 0
    duplicates: int = 0
    index: NearIndex | None = None  # minhash: every kept row's signature by band
    pending: dict[str, np.ndarray] = field(default_factory=dict)  # minhash: the signatures of rows not settled yet
    selected: dict[str, str | None] = field(default_factory=dict)  # a select step's: row id -> why not selected
    unselected: int = 0

    def __post_init__(self) -> None:
        if self.spec.dedup == "minhash":
            self.index = NearIndex(self.spec.dedup_threshold, near.bands_for(self.spec.dedup_threshold))

    def decide(self, item: WorkItem, results: list[Result] | None, keep_names: list[str]) -> WorkItem:
        """A finished row's ``where``, and its dedup key: a row that passes is kept until ``settle`` says it is a
        duplicate."""
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
                self.pending[item.row_id] = sig
            elif kept and self.spec.dedup is not None:
                key = dedup_key(fields.get(self.spec.dedup_on, ""))
        values.update(kept=kept, dropped_by=why, dedup_key=key)
        return replace(item, keep=tuple(values[n] for n in keep_names))

    # -- dedup, a part at a time ---------------------------------------------------------------------------------
    def settle(self, items: list[WorkItem], keep_names: list[str]) -> list[WorkItem]:
        """The part's rows (``items``, in the order they reached the sink) with dedup decided: a kept row whose key
        (or a near duplicate) is held before it is dropped. With a key log, the part's kept rows are appended as
        one entry (``keylog``) before the part commits; losing the race for a position reads the winner's entry
        and decides again. What is decided here is what the part's rows carry into its commit."""
        if self.spec.dedup is None or "kept" not in keep_names:
            return items
        at = {n: i for i, n in enumerate(keep_names)}
        cands = [i for i, it in enumerate(items) if it.keep is not None and it.keep[at["kept"]]
                 and it.keep[at["dedup_key"]]]
        sigs = {i: self.pending.pop(items[i].row_id) for i in cands} if self.index is not None else {}
        if not cands:
            return items
        if self.log is not None and self.log.busy:
            self._absorb()
        while True:
            kept = self._decided(items, cands, sigs, at["dedup_key"])
            if self.log is None or self.log.append(self._entry(items, kept, sigs, at["dedup_key"])):
                break
            self._absorb()
        out = list(items)
        for i in cands:
            key = items[i].keep[at["dedup_key"]]
            if i in kept:
                if self.index is not None:
                    self.index.add(sigs[i])
                else:
                    self.seen.add(int(key[:16], 16))
                continue
            self.duplicates += 1
            values = list(items[i].keep)
            values[at["kept"]], values[at["dropped_by"]] = False, f"dedup {self.spec.dedup} on {self.spec.dedup_on}"
            out[i] = replace(items[i], keep=tuple(values))
        return out

    def _decided(self, items: list[WorkItem], cands: list[int], sigs: dict[int, np.ndarray], k: int) -> set[int]:
        """Which of the part's candidate rows stay kept, in order, against what is held (nothing is changed)."""
        kept: set[int] = set()
        if self.index is None:
            part: set[str] = set()
            for i in cands:
                key = items[i].keep[k]
                if int(key[:16], 16) not in self.seen and key not in part:
                    part.add(key)
                    kept.add(i)
            return kept
        local = NearIndex(self.index.threshold, self.index.bands)
        for i in cands:
            hashes = near.band_hashes(sigs[i], self.index.bands)
            if not self.index.near_one(sigs[i], hashes) and not local.near_one(sigs[i], hashes):
                local.add(sigs[i], hashes)
                kept.add(i)
        return kept

    def _entry(self, items: list[WorkItem], kept: set[int], sigs: dict[int, np.ndarray], k: int) -> Entry:
        order = sorted(kept)
        return Entry(self.shard, key_hashes(items[i].row_id for i in order), [items[i].keep[k] for i in order],
                     np.stack([sigs[i] for i in order]) if self.index is not None and order else None)

    def _absorb(self) -> None:
        """The log's new entries into what is held: another shard's whole, this shard's only for rows it has
        committed as kept (an entry whose part a crash left uncommitted holds nothing for its own shard)."""
        assert self.log is not None
        for e in self.log.read_new():
            if e is None or not e.keys:
                continue
            # another shard's entry holds all its rows; this shard's only those its committed parts keep
            take = self.own.contains_many(pair_hashes(e.rows, e.keys)) if e.shard == self.shard else \
                np.ones(len(e.keys), bool)
            if self.index is None:
                self.seen.add_many(key64s(e.keys)[take])
            elif e.sigs is not None:
                for j in np.flatnonzero(take).tolist():
                    self.index.add(e.sigs[j])
