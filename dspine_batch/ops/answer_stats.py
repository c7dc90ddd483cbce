"""What ``report`` says about answers: reasoning, tool calls, logprobs, and whether structured outputs hold.

Structured rows are checked with readers we did not write: a ``json_schema`` row's output is parsed with
``json`` and validated with the ``jsonschema`` package against the schema stored beside it (``structure``);
``json_object`` must parse to an object, ``choice`` must be one of the choices, ``regex`` must match in full
under Python's ``re`` (close to xgrammar's dialect; a pattern ``re`` cannot read is not counted). Grammar rows
are counted, not checked. Only rows that ended by themselves (``stop``) can be complete; rows cut by
``max_new_tokens`` (``length``) are counted apart, since their text may stop mid-value.

Counting reads small columns only; ``output`` and ``structure`` are read only from parts that have structured
rows, and ``logprobs`` is counted from its validity bitmap without building Python objects.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.outdir.output import arrow_path

CHECKED = ("json_schema", "json_object", "choice", "regex")
MAX_VALIDATORS = 1024


@dataclass
class AnswerTally:
    reasoning: int = 0  # ok outputs with reasoning_content
    tool_calls: int = 0  # ok outputs with parsed tool calls
    logprobs: int = 0  # ok outputs with logprobs
    structured: Counter = field(default_factory=Counter)  # kind -> ok outputs
    stopped: Counter = field(default_factory=Counter)  # kind -> of which finished by themselves (stop)
    valid: Counter = field(default_factory=Counter)  # kind -> of which valid
    cut: Counter = field(default_factory=Counter)  # kind -> of which cut by max_new_tokens (length)
    _validators: dict[str, Any] = field(default_factory=dict)

    def add_part(self, path: str, have: set[str]) -> None:
        if "structure_kind" not in have:  # written before schema 4
            return
        t = pq.read_table(**arrow_path(path), columns=["status", "finish_reason", "reasoning_content", "tool_calls",
                                         "structure_kind", "logprobs"])
        ok = pc.equal(t["status"], "ok")
        self.reasoning += _count(pc.and_(ok, pc.is_valid(t["reasoning_content"])))
        self.tool_calls += _count(pc.and_(ok, pc.is_valid(t["tool_calls"])))
        self.logprobs += _count(pc.and_(ok, pc.is_valid(t["logprobs"])))
        if t["structure_kind"].null_count == t.num_rows:
            return
        cols = ["status", "finish_reason", "structure_kind", "structure", "output"]
        rows = pq.read_table(**arrow_path(path), columns=cols) \
            .filter(pc.and_(ok, pc.is_valid(t["structure_kind"]))).to_pylist()
        for r in rows:
            kind = r["structure_kind"]
            self.structured[kind] += 1
            if r["finish_reason"] == "length":
                self.cut[kind] += 1
            elif r["finish_reason"] == "stop":
                self.stopped[kind] += 1
                self.valid[kind] += self._valid(kind, r["structure"], r["output"] or "")

    def _valid(self, kind: str, spec: str, text: str) -> bool:
        if kind == "choice":
            return text in json.loads(spec)
        if kind == "regex":
            try:
                return re.fullmatch(spec, text) is not None
            except re.error:
                return False
        if kind not in ("json_schema", "json_object"):
            return False
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        return self._validator(spec).is_valid(value)

    def _validator(self, spec: str) -> Any:
        v = self._validators.get(spec)
        if v is None:
            import jsonschema

            schema = json.loads(spec)
            v = jsonschema.validators.validator_for(schema)(schema)
            if len(self._validators) >= MAX_VALIDATORS:
                self._validators.clear()
            self._validators[spec] = v
        return v

    def summary(self) -> dict[str, Any]:
        kinds = {}
        for kind, n in sorted(self.structured.items()):
            stopped = self.stopped[kind]
            kinds[kind] = {"rows": n, "finished_stop": stopped, "cut_by_length": self.cut[kind],
                           "valid": self.valid[kind] if kind in CHECKED else None,
                           "valid_share": round(self.valid[kind] / stopped, 4) if kind in CHECKED and stopped
                           else None}
        return {"with_reasoning": self.reasoning, "with_tool_calls": self.tool_calls,
                "with_logprobs": self.logprobs, "structured": kinds}


def format_answers(s: dict[str, Any] | None) -> list[str]:
    """The report's lines about answers (none when nothing is to say)."""
    if not s:
        return []
    lines = []
    if s["with_reasoning"] or s["with_tool_calls"] or s["with_logprobs"]:
        lines.append(f"  answers     {s['with_reasoning']:,} with reasoning, {s['with_tool_calls']:,} with tool calls, "
                     f"{s['with_logprobs']:,} with logprobs")
    for kind, k in s["structured"].items():
        valid = "not checked" if k["valid"] is None else (
            f"{k['valid']:,} of {k['finished_stop']:,} finished (stop) valid"
            + (f" ({k['valid_share']:.1%})" if k["valid_share"] is not None else ""))
        lines.append(f"  {kind:<11} {k['rows']:,} rows: {valid}; {k['cut_by_length']:,} cut by length")
    return lines


def _count(mask: Any) -> int:
    return int(pc.sum(mask).as_py() or 0)
