"""Every distinct structure of a job checked with xgrammar before the model loads.

A schema xgrammar cannot compile (invalid JSON Schema, a regex with a look-behind, an EBNF with an undefined
rule, a feature xgrammar does not support) should cost a second, not a model load and then an error at row
3,000,000. ``prescan`` reads the inputs once, only the rows whose text mentions a structure field (JSON Lines:
a byte search before any parsing; Parquet: only those columns), parses their structure exactly as the mapper
will, and compiles each distinct one (by digest) once, without a tokenizer. What it finds is reported in one line
naming file, row and field; those rows become error rows (``--on-error fail``: the job is refused). The mapper
then asks the same ``StructureCheck``, so nothing is compiled twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dspine_batch.engines.base import Structure
from dspine_batch.engines.grammar import grammar_of
from dspine_batch.errors import RowError
from dspine_batch.inputs.sources import InputFile, iter_inputs, mentions
from dspine_batch.requests.fields import STRUCTURE_FIELDS, Defaults, merge, parse_fields

MAX_KNOWN = 100_000  # distinct structures remembered (a job with a schema per row must not grow without bound)
STRUCTURE_KEYS = STRUCTURE_FIELDS + ("tools", "tool_choice")  # tool_choice may force a call: a schema


@dataclass
class StructureCheck:
    """xgrammar's verdict on each distinct structure: None when it compiles, else its reason in one line."""

    known: dict[str, str | None] = field(default_factory=dict)
    compiled: int = 0

    def problem(self, structure: Structure) -> str | None:
        digest = structure.digest
        if digest not in self.known:
            if len(self.known) >= MAX_KNOWN:
                self.known.clear()
            try:
                grammar_of(structure)
                self.known[digest] = None
            except ValueError as e:
                self.known[digest] = f"xgrammar cannot compile this {structure.kind.replace('_', ' ')}: {e}"
            self.compiled += 1
        return self.known[digest]


@dataclass
class PrescanResult:
    rows: int = 0  # rows with a structure of their own
    problems: int = 0  # of which unusable (bad field or a structure xgrammar refuses)
    first: str | None = None  # the first problem, as a one-line RowError


def prescan(files: list[InputFile], row_fields: tuple[str, ...], limit: int | None, defaults: Defaults,
            check: StructureCheck) -> PrescanResult:
    """Check every row's own structure (``row_fields``: the request fields rows may carry) before any work."""
    keys = tuple(k for k in STRUCTURE_KEYS if k in row_fields)
    out = PrescanResult()
    if not keys:
        return out
    needles = re.compile(b'"(?:' + b"|".join(re.escape(k.encode()) for k in keys) + b')"')
    longest = max(len(k) for k in keys) + 2
    if limit is None:  # (a limit counts every row, so every file is read then)
        files = [f for f in files if f.kind not in ("jsonl", "openai") or mentions(f, needles, longest)]
    for batch in iter_inputs(files, list(keys), limit, needles=None if limit is not None else needles):
        openai = batch.file.kind == "openai"
        for index, row in zip(batch.indices, batch.rows, strict=True):
            if not isinstance(row, dict):
                continue
            values = {k: v for k in keys if (v := row.get(k)) is not None}
            if not values:
                continue
            try:
                structure = _row_structure(batch.file.name, index, values, openai, defaults, check)
            except RowError as e:
                out.rows += 1
                out.problems += 1
                out.first = out.first or str(e)
                continue
            out.rows += structure is not None
    return out


def _row_structure(name: str, index: int, values: dict, openai: bool, defaults: Defaults,
                   check: StructureCheck) -> Structure | None:
    def fail(label: str, msg: str) -> RowError:
        return RowError(name, index, label, msg)

    req = parse_fields(values, (lambda n: f"body.{n}") if openai else (lambda n: n), fail)
    over, _, labels = merge(defaults, req, fail)
    structure = over.get("structure")
    if structure is not None:
        problem = check.problem(structure)
        if problem:
            raise fail(labels["structure"], problem)
    return structure
