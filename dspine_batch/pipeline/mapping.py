"""From input rows to requests: which columns mean what, row ids, per-row params, prompt rendering.

All validation of user data happens here, so every problem is reported the same way: a ``RowError``
naming file, row and field. Column resolution runs once up front (exit 2 for unknown columns) so nobody
learns about a typo at row 3,000,000.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from dspine_batch.engines.base import Request, SamplingParams, Tokenizer, derive_seed
from dspine_batch.errors import RowError, UsageError
from dspine_batch.pipeline.keyset import KeySet, index_hashes, key_hash, key_hashes
from dspine_batch.pipeline.sources import InputFile, RowBatch, arrow_schema, peek_rows

ROW_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Columns:
    """Resolved column roles; part of the fingerprint."""

    prompt: str | None
    messages: str | None
    id: str | None
    keep: tuple[str, ...]
    keep_types: tuple[pa.DataType, ...]  # typed up front: the output schema must not drift between parts
    row_params: tuple[str, ...]

    def read_columns(self) -> list[str]:
        cols = [c for c in (self.prompt, self.messages, self.id) if c]
        return list(dict.fromkeys(cols + list(self.keep) + list(self.row_params)))

    def keep_schema(self) -> list[pa.Field]:
        return [pa.field(n, t) for n, t in zip(self.keep, self.keep_types, strict=True)]


def resolve_columns(files: list[InputFile], prompt: str | None, messages: str | None, id_column: str | None,
                    keep: Sequence[str], row_params: bool) -> Columns:
    """Decide column roles from flags and the first input's columns; check every input that has a schema."""
    if prompt and messages:
        raise UsageError("--prompt-column and --messages-column are exclusive: pick one")
    first, schema, sample, names = files[0], None, [], []
    for first in files:  # the first input with rows decides; empty inputs are skipped (and reported)
        schema = arrow_schema(first)
        sample = [] if schema is not None else peek_rows(first)
        names = list(schema.names) if schema is not None else list(dict.fromkeys(k for r in sample for k in r))
        if names or first.kind == "hf":
            break
    else:
        which = files[0].name if len(files) == 1 else "any input"
        raise UsageError(f"{which}: no rows (empty file)" if len(files) == 1 else f"no rows in {which}")
    if not prompt and not messages:
        if "messages" in names and "prompt" not in names:
            messages = "messages"
        else:
            prompt = "prompt"
    if id_column is None:
        id_column = "custom_id" if first.kind == "openai" else ("id" if "id" in names else None)
    elif id_column == "":
        id_column = None
    role_cols = [c for c in (prompt, messages, id_column) if c]
    params = tuple(p for p in ROW_PARAMS if row_params and p in names and p not in role_cols)
    keep = tuple(dict.fromkeys(keep))
    for inp in files:
        sch = schema if inp is first else arrow_schema(inp)
        if sch is not None and not sch.names:
            continue
        have = list(sch.names) if sch is not None else (names if inp is first else None)
        if have is None or (inp.kind == "hf" and not have):
            continue  # JSONL beyond the first file: checked row by row
        for col, flag in [(prompt, "--prompt-column"), (messages, "--messages-column"), (id_column, "--id-column")] + [
                (k, "--keep-columns") for k in keep]:
            if col and col not in have:
                raise UsageError(f"{inp.name}: no column {col!r} for {flag} (columns: {', '.join(have) or 'none'})")
    keep_types = tuple(_keep_type(first, schema, sample, k, files) for k in keep)
    return Columns(prompt, messages, id_column, keep, keep_types, params)


def _keep_type(first: InputFile, schema: pa.Schema | None, sample: list[dict], col: str,
               files: list[InputFile]) -> pa.DataType:
    if schema is not None:
        t = schema.field(col).type
        for inp in files[1:]:
            other = arrow_schema(inp)
            if other is not None and other.field(col).type != t:
                raise UsageError(f"{inp.name}: column {col!r} is {other.field(col).type}, but {t} in {first.name}")
        return t
    # JSONL has no schema: the first non-null value decides; rows that disagree become row errors later.
    first_value = next((r[col] for r in sample if r.get(col) is not None), None)
    try:
        t = pa.array([first_value]).type
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise UsageError(f"{first.name}: column {col!r} cannot be stored ({e})") from e
    return pa.string() if pa.types.is_null(t) else t


@dataclass(slots=True)
class WorkItem:
    """One input row on its way through the pipeline. ``error`` rows carry no requests."""

    row_id: str
    requests: list[Request]
    keep: tuple[Any, ...] | None
    error: str | None = None
    row_hash: int = 0  # 64-bit hash of row_id (keyset.key_hash), stored beside each part for fast resume


@dataclass(frozen=True)
class MapSettings:
    columns: Columns
    defaults: SamplingParams
    num_samples: int
    system_prompt: str | None
    use_chat: bool


class FallbackIds(Sequence[str]):
    """The ids ``<file>:<index>`` of a batch, built on access (skipped rows never need theirs)."""

    def __init__(self, name: str, indices: Sequence[int]):
        self.name, self.indices = name, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [f"{self.name}:{i}" for i in self.indices[k]]
        return f"{self.name}:{self.indices[k]}"


class RowIds:
    """Row identity: the id column, else ``<file>:<index>``. Stateful: a duplicate id (seen-set) gets the
    fallback id and an error, so the output still has exactly one row per input row."""

    def __init__(self, id_column: str | None):
        self.id_column = id_column
        self.seen = KeySet()

    def assign_ids(self, batch: RowBatch) -> tuple[Sequence[str], list[str | None], np.ndarray]:
        """Row ids, id problems (or None), and the ids' 64-bit hashes."""
        col = self.id_column
        name = batch.file.name
        if col is None:  # every id is <file>:<index>: hash the indices, build strings only when asked
            return FallbackIds(name, batch.indices), [None] * len(batch), index_hashes(name, batch.indices)
        ids = []
        problems: list[str | None] = []
        for index, value in zip(batch.indices, batch.column(col), strict=True):
            if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
                ids.append(f"{name}:{index}")
                # (a row that is itself an error reports that error, not a missing id)
                what = ("missing" if value is None or value == ""
                        else f"expected a string or int, got {_type_name(value)}")
                problems.append(str(RowError(name, index, col, what)))
                continue
            key = str(value)
            h = key_hash(key)
            if h in self.seen:
                ids.append(f"{name}:{index}")
                problems.append(str(RowError(name, index, col, f"duplicate id {key!r} (an earlier row has it)")))
                continue
            self.seen.add(h)
            ids.append(key)
            problems.append(None)
        return ids, problems, key_hashes(ids)


class RowMapper:
    """Maps rows to work items: validation, per-row params, prompt rendering, per-sample seeds."""

    def __init__(self, settings: MapSettings, tokenizer: Tokenizer, max_context: int | None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.ids = RowIds(settings.columns.id)
        self.assign_ids = self.ids.assign_ids
        self.max_context = max_context
        self._keep_types = [f.type for f in settings.columns.keep_schema()]
        self._has_keep = bool(settings.columns.keep)
        self._row_params = bool(settings.columns.row_params)
        self._samples = settings.num_samples
        self._stop_cache: dict[tuple[str, ...], tuple[int, ...]] = {}

    def build(self, row_id: str, file: InputFile, index: int, row: dict[str, Any] | RowError,
              id_problem: str | None, row_hash: int = 0) -> WorkItem:
        if isinstance(row, RowError):
            return WorkItem(row_id, [], None, str(row), row_hash)
        keep, problem = self._keep(file, index, row) if self._has_keep else (None, None)
        problem = id_problem or problem
        if problem:
            return WorkItem(row_id, [], keep, problem, row_hash)
        try:
            params = self._params(file, index, row) if self._row_params else self.settings.defaults
            ids = self._prompt_ids(file, index, row)
        except RowError as e:
            return WorkItem(row_id, [], keep, str(e), row_hash)
        if params.temperature > 0:  # greedy output does not depend on the seed: skip the hashing
            reqs = [Request(row_id, s, ids, replace(params, seed=derive_seed(params.seed, row_id, s)))
                    for s in range(self._samples)]
        elif self._samples == 1:
            reqs = [Request(row_id, 0, ids, params)]
        else:
            reqs = [Request(row_id, s, ids, params) for s in range(self._samples)]
        return WorkItem(row_id, reqs, keep, None, row_hash)

    def _keep(self, file: InputFile, index: int, row: dict[str, Any]) -> tuple[tuple[Any, ...] | None, str | None]:
        cols = self.settings.columns.keep
        if not cols:
            return None, None
        values = tuple(row.get(c) for c in cols)
        if file.kind in ("parquet", "arrow"):
            return values, None  # already typed by the schema
        for c, v, t in zip(cols, values, self._keep_types, strict=True):
            if v is not None and not _fits(v, t):
                problem = RowError(file.name, index, c, f"expected {t}, got {_type_name(v)}")
                return tuple(None for _ in cols), str(problem)
        return values, None

    def _params(self, file: InputFile, index: int, row: dict[str, Any]) -> SamplingParams:
        p = self.settings.defaults
        over: dict[str, Any] = {}
        for name in self.settings.columns.row_params:
            value = row.get(name)
            if value is None:
                continue
            over[name] = check_param(name, value, lambda msg, n=name: RowError(file.name, index, n, msg))
        if not over:
            return p
        if "stop" in over:
            over["stop_token_ids"] = self._stop_ids(over["stop"])
        return replace(p, **over)

    def _stop_ids(self, stop: tuple[str, ...]) -> tuple[int, ...]:
        if stop not in self._stop_cache:
            self._stop_cache[stop] = self.tokenizer.stop_token_ids(stop)
        return self._stop_cache[stop]

    def _prompt_ids(self, file: InputFile, index: int, row: dict[str, Any]) -> list[int]:
        cols = self.settings.columns
        if cols.messages:
            messages = _check_messages(file.name, index, cols.messages, row.get(cols.messages, _MISSING))
            if self.settings.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.settings.system_prompt}, *messages]
            field = cols.messages
        else:
            field = cols.prompt or "prompt"
            text = row.get(field, _MISSING)
            if text is _MISSING:
                raise RowError(file.name, index, field, "missing")
            if not isinstance(text, str):
                raise RowError(file.name, index, field, f"expected a string, got {_type_name(text)}")
            if not text.strip():
                raise RowError(file.name, index, field, "empty prompt")
            messages = None
            if self.settings.use_chat:
                messages = [{"role": "user", "content": text}]
                if self.settings.system_prompt:
                    messages.insert(0, {"role": "system", "content": self.settings.system_prompt})
        try:
            ids = self.tokenizer.render_chat(messages) if messages is not None else self.tokenizer.encode(text)
        except Exception as e:  # template errors are data errors: the row's content broke the template
            raise RowError(file.name, index, field, f"cannot render the prompt ({str(e)[:200]})") from e
        if self.max_context and len(ids) >= self.max_context:
            raise RowError(file.name, index, field,
                           f"prompt is {len(ids)} tokens; the model's context is {self.max_context}")
        return ids


_MISSING = object()


def _check_messages(name: str, index: int, field: str, value: Any) -> list[dict[str, Any]]:
    if value is _MISSING:
        raise RowError(name, index, field, "missing")
    if not isinstance(value, list) or not value:
        raise RowError(name, index, field, f"expected a non-empty list of messages, got {_type_name(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(name, index, f"{field}[{i}]", f"expected an object, got {_type_name(m)}")
        if m.get("role") not in ROLES:
            raise RowError(name, index, f"{field}[{i}].role", f"expected one of {sorted(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise RowError(name, index, f"{field}[{i}].content",
                           f"expected a string, got {_type_name(m.get('content'))}")
    return value


def check_param(name: str, value: Any, fail: Any) -> Any:
    """Validate one sampling parameter; ``fail(msg)`` builds the exception (RowError or UsageError)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_num = (is_int or isinstance(value, float)) and not (isinstance(value, float) and not math.isfinite(value))
    if name == "max_new_tokens":
        if not is_int or value < 1:
            raise fail(f"expected an integer >= 1, got {value!r}")
    elif name == "temperature":
        if not is_num or value < 0:
            raise fail(f"expected a number >= 0, got {value!r}")
        value = float(value)
    elif name == "top_p":
        if not is_num or not 0 < value <= 1:
            raise fail(f"expected a number in (0, 1], got {value!r}")
        value = float(value)
    elif name == "top_k":
        if not is_int or value < -1:
            raise fail(f"expected an integer >= 0 (0 or -1: off), got {value!r}")
        value = max(value, 0)
    elif name == "seed":
        if not is_int:
            raise fail(f"expected an integer, got {value!r}")
    elif name == "stop":
        if isinstance(value, str):
            value = (value,)
        elif isinstance(value, list) and all(isinstance(s, str) and s for s in value):
            value = tuple(value)
        else:
            raise fail(f"expected a string or a list of non-empty strings, got {value!r}")
    return value


def _fits(v: Any, t: pa.DataType) -> bool:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return isinstance(v, str)
    if pa.types.is_boolean(t):
        return isinstance(v, bool)
    if pa.types.is_integer(t):
        return isinstance(v, int) and not isinstance(v, bool)
    if pa.types.is_floating(t):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    try:
        pa.scalar(v, type=t)
        return True
    except (pa.ArrowException, TypeError, ValueError):
        return False


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__
