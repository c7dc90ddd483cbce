"""From input rows to requests: which columns mean what, row ids, per-row request fields, prompts.

All validation of user data happens here (with ``requests`` for the fields, ``prompts`` for conversations and
``structures`` for grammars), so every problem is reported the same way: a ``RowError`` naming file, row and
field. Column resolution runs once up front (exit 2 for unknown columns) so nobody learns about a typo at row
3,000,000. A row that asks for a feature its engine does not honour (``Engine.features``) is refused here,
naming the field, rather than answered without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from dspine_batch.engines.base import STRUCTURE_KINDS, Request, Tokenizer, derive_seed
from dspine_batch.errors import RowError, UsageError
from dspine_batch.inputs.sources import InputFile, RowBatch, arrow_schema, peek_rows
from dspine_batch.outdir.keyset import KeySet, index_hashes, key_hash, key_hashes
from dspine_batch.outdir.schema import BASE_NAMES, TOKEN_IDS_FIELD
from dspine_batch.requests.fields import ROW_FIELDS, Defaults, RowOptions, merge, parse_fields
from dspine_batch.requests.prompts import PromptRenderer, check_messages
from dspine_batch.requests.structures import StructureCheck
from dspine_batch.requests.templates import PromptTemplates

OUTPUT_NAMES = frozenset([*BASE_NAMES, TOKEN_IDS_FIELD.name])


@dataclass(frozen=True)
class Columns:
    """Resolved column roles; part of the fingerprint.

    The id column is kept in the output under its own name (``qid``, ``custom_id``, ``id``), typed as in the input,
    beside ``row_id`` (its value as a string, or ``<file>:<index>`` for a row without a usable id): readers join on
    the name they know, and dspine-batch's own bookkeeping (resume, finalize, export) keeps reading ``row_id``. It is
    the first of ``keep`` (``id_kept``), unless the user kept it already or its name is an output column's."""

    prompt: str | None
    messages: str | None
    id: str | None
    keep: tuple[str, ...]
    keep_types: tuple[pa.DataType, ...]  # typed up front: the output schema must not drift between parts
    row_params: tuple[str, ...]
    templates: PromptTemplates | None = None  # the prompt built from columns (``templates``) instead of ``prompt``
    id_kept: bool = False  # keep[0] is the id column, added for the user (not asked for with --keep-columns)

    def read_columns(self) -> list[str]:
        cols = [c for c in (self.prompt, self.messages, self.id) if c]
        cols += list(self.templates.columns) if self.templates else []
        return list(dict.fromkeys(cols + list(self.keep) + list(self.row_params)))

    def keep_schema(self) -> list[pa.Field]:
        return [pa.field(n, t) for n, t in zip(self.keep, self.keep_types, strict=True)]


def resolve_columns(files: list[InputFile], prompt: str | None, messages: str | None, id_column: str | None,
                    keep: Sequence[str], row_params: bool, templates: PromptTemplates | None = None) -> Columns:
    """Decide column roles from flags and the first input's columns; check every input that has a schema."""
    if prompt and messages:
        raise UsageError("--prompt-column and --messages-column are exclusive: pick one")
    if templates is not None and (prompt or messages):
        raise UsageError(f"--prompt-template and {'--prompt-column' if prompt else '--messages-column'} are "
                         "exclusive: the template builds the prompt")
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
    guessed = templates is None and not prompt and not messages  # `prompt`, or `messages`: no flag named either
    if templates is not None:
        pass  # the prompt comes from the template's columns
    elif not prompt and not messages:
        if "messages" in names and "prompt" not in names:
            messages = "messages"
        else:
            prompt = "prompt"
    if id_column is None:
        id_column = "custom_id" if first.kind == "openai" else ("id" if "id" in names else None)
    elif id_column == "":
        id_column = None
    role_cols = [c for c in (prompt, messages, id_column) if c]
    # JSON Lines rows need not share keys (an OpenAI body has only what it sets): every field may appear
    schemaless = all(inp.kind in ("jsonl", "openai") for inp in files)
    params = tuple(p for p in ROW_FIELDS if row_params and (schemaless or p in names) and p not in role_cols)
    keep = tuple(dict.fromkeys(keep))
    id_kept = bool(id_column) and id_column not in keep and id_column not in OUTPUT_NAMES
    if id_kept:
        keep = (id_column, *keep)
    for inp in files:
        sch = schema if inp is first else arrow_schema(inp)
        if sch is not None and not sch.names:
            continue
        have = list(sch.names) if sch is not None else (names if inp is first else None)
        if have is None or (inp.kind == "hf" and not have):
            continue  # JSONL beyond the first file: checked row by row
        for col, flag in [(prompt, "--prompt-column"), (messages, "--messages-column"), (id_column, "--id-column")] + [
                (k, "--keep-columns") for k in keep]:
            if col and col not in have and guessed and col == prompt:
                raise UsageError(_no_prompt(inp.name, have))
            if col and col not in have:
                raise UsageError(f"{inp.name}: no column {col!r} for {flag} (columns: {', '.join(have) or 'none'})")
        if templates is not None and sch is not None:  # JSON Lines: a row without one is that row's error
            for col in templates.columns:
                if col not in have:
                    raise UsageError(f"{inp.name}: no column {col!r} for the template {templates.label_of(col)} "
                                     f"(columns: {', '.join(have) or 'none'})")
    keep_types = tuple(_keep_type(first, schema, sample, k, files) for k in keep)
    return Columns(prompt, messages, id_column, keep, keep_types, params, templates, id_kept)


def _no_prompt(name: str, have: list[str]) -> str:
    """The error for an input with neither a ``prompt`` nor a ``messages`` column when no flag said where the prompt
    is: the three ways to say it, with this input's own first column in the examples."""
    col = have[0] if have else "COLUMN"
    return (f"{name}: no prompt: no column 'prompt' or 'messages' (columns: {', '.join(have) or 'none'}); say where "
            f"it is: --prompt-column {col} (the prompt's text), --messages-column {col} (chat messages), or "
            f"--prompt-template 'Answer: {{{{ {col} }}}}' (built from the row's columns)")


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
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
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
    options: RowOptions | None = None  # tools and how to read the answer (None on error rows)
    span: tuple[str, int, int, int] | None = None  # a first stage's input row: (file, lo, hi, offset), ``watermark``


@dataclass(frozen=True)
class MapSettings:
    columns: Columns
    defaults: Defaults  # the job-wide request (``requests.job_request`` over the job's SamplingParams)
    system_prompt: str | None
    use_chat: bool
    engine: str = "scripted"  # the engine's name, for refusals
    features: frozenset[str] = frozenset()  # what the engine honours (``Engine.features``)


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
    """Maps rows to work items: validation, per-row request fields, prompt rendering, per-sample seeds."""

    def __init__(self, settings: MapSettings, tokenizer: Tokenizer, max_context: int | None,
                 structures: StructureCheck | None = None, warn: Callable[[str], None] | None = None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.ids = RowIds(settings.columns.id)
        self.assign_ids = self.ids.assign_ids
        self.max_context = max_context
        self.structures = structures or StructureCheck()
        self.prompts = PromptRenderer(tokenizer, warn or _warn)
        self._keep_types = [f.type for f in settings.columns.keep_schema()]
        self._has_keep = bool(settings.columns.keep)
        self._row_params = bool(settings.columns.row_params)
        self._stop_cache: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._body_keys = frozenset(ROW_FIELDS) | {"custom_id", "messages", "prompt"}
        self._fields = frozenset(settings.columns.row_params)
        self._seen: dict[tuple, tuple[Any, RowOptions]] = {}  # scalar request fields -> (params, options)

    def build(self, row_id: str, file: InputFile, index: int, row: dict[str, Any] | RowError,
              id_problem: str | None, row_hash: int = 0) -> WorkItem:
        if isinstance(row, RowError):
            return WorkItem(row_id, [], None, str(row), row_hash)
        keep, problem = self._keep(file, index, row) if self._has_keep else (None, None)
        if id_problem or problem:
            return WorkItem(row_id, [], keep, id_problem or self._named(problem, file, index, row_id), row_hash)
        defaults = self.settings.defaults
        params, options = defaults.params, defaults.options
        try:
            if file.kind == "openai" and not self._body_keys.issuperset(row):
                key = next(k for k in row if k not in self._body_keys)
                raise RowError(file.name, index, f"body.{key}", "not a request field dspine-batch supports "
                               "(README, 'Requests', lists them)")
            if self._row_params:
                params, options = self._request(file, index, row)
            ids = self._prompt_ids(file, index, row, options)
            if params.max_new_tokens != defaults.params.max_new_tokens and self.max_context:
                self._check_room(file, index, row, len(ids), params.max_new_tokens)
        except RowError as e:
            return WorkItem(row_id, [], keep, self._named(e, file, index, row_id), row_hash)
        n = options.n
        if params.temperature > 0:  # greedy output does not depend on the seed: skip the hashing
            reqs = [Request(row_id, s, ids, replace(params, seed=derive_seed(params.seed, row_id, s)))
                    for s in range(n)]
        elif n == 1:
            reqs = [Request(row_id, 0, ids, params)]
        else:
            reqs = [Request(row_id, s, ids, params) for s in range(n)]
        return WorkItem(row_id, reqs, keep, None, row_hash, options)

    def _keep(self, file: InputFile, index: int,
              row: dict[str, Any]) -> tuple[tuple[Any, ...] | None, RowError | None]:
        cols = self.settings.columns.keep
        if not cols:
            return None, None
        values = tuple(row.get(c) for c in cols)
        if file.kind in ("parquet", "arrow"):
            return values, None  # already typed by the schema
        for k, (c, v, t) in enumerate(zip(cols, values, self._keep_types, strict=True)):
            if v is not None and not _fits(v, t):
                if k == 0 and self.settings.columns.id_kept:  # JSON Lines ids may mix str and int: row_id has it
                    values = (None, *values[1:])
                    continue
                kept = tuple(x if j == 0 and self.settings.columns.id_kept else None for j, x in enumerate(values))
                return kept, RowError(file.name, index, c, f"expected {t}, got {_type_name(v)}")
        return values, None

    def _check_room(self, file: InputFile, index: int, row: dict[str, Any], prompt: int, asked: int) -> None:
        """A row's own ``max_tokens`` beyond what the context leaves after its prompt is that row's error naming
        the limit, as vLLM's and OpenAI's servers answer such a request — not an answer cut silently where the
        context ends. (The job's ``--max-new-tokens`` is a cap for rows of every prompt length instead: a row
        whose prompt leaves less ends there, ``finish_reason`` "length", as vLLM's offline engine does.)"""
        assert self.max_context is not None
        if prompt + asked <= self.max_context:
            return
        name = next((k for k in ("max_tokens", "max_completion_tokens", "max_new_tokens")
                     if row.get(k) is not None), "max_new_tokens")
        try:
            raw = str(row.get(name, asked))
        except ValueError:  # an integer past Python's 4,300-digit limit for str()
            raw = "an integer of more than 4,300 digits"
        shown = raw if len(raw) <= 20 else f"{raw[:12]}... ({len(raw)} digits)"
        raise RowError(file.name, index, f"body.{name}" if file.kind == "openai" else name,
                       f"{shown} is too large: the model's context is {self.max_context:,} tokens and the prompt "
                       f"has {prompt:,}, which leaves {max(self.max_context - prompt, 0):,}")

    def _named(self, e: RowError | None, file: InputFile, index: int, row_id: str) -> str:
        """The error's one line, naming the row's id when it has one of its own (not ``<file>:<index>``)."""
        assert e is not None
        col = self.settings.columns.id
        return str(e.with_id(col, row_id) if col and row_id != f"{file.name}:{index}" else e)

    def _request(self, file: InputFile, index: int, row: dict[str, Any]) -> tuple[Any, RowOptions]:
        """The row's request fields over the job's: its SamplingParams and options, every field checked, the
        engine's support included."""
        defaults = self.settings.defaults
        fields = self._fields
        if fields.isdisjoint(row):  # most rows of a plain prompt file: no request field at all
            return defaults.params, defaults.options
        values = {k: v for k, v in row.items() if v is not None and k in fields}
        if not values:
            return defaults.params, defaults.options
        try:  # rows of one job mostly repeat the same scalar settings: parse each combination once
            key = (file.kind == "openai", *((k, type(v), v) for k, v in values.items()))
            hit = self._seen.get(key)
        except TypeError:  # a list or an object among them: parsed every time
            key, hit = None, None
        if hit is not None:
            return hit
        params, options = self._parse_request(file, index, values)
        if key is not None:
            if len(self._seen) >= 4096:
                self._seen.clear()
            self._seen[key] = (params, options)
        return params, options

    def _parse_request(self, file: InputFile, index: int, values: dict[str, Any]) -> tuple[Any, RowOptions]:
        defaults = self.settings.defaults

        def fail(label: str, msg: str) -> RowError:
            return RowError(file.name, index, label, msg)

        req = parse_fields(values, (lambda n: f"body.{n}") if file.kind == "openai" else (lambda n: n), fail)
        over, options, labels = merge(defaults, req, fail)
        if not over:
            return defaults.params, options
        if "stop" in over:
            over["stop_token_ids"] = self._stop_ids(over["stop"])
        params = replace(defaults.params, **over)
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if "logit_bias" in over and vocab and params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise fail(labels["logit_bias"], f"token id {params.logit_bias[-1][0]} is not in the model's "
                       f"vocabulary ({vocab} tokens)")
        for feature in params.features():
            if feature not in self.settings.features:
                what = "structure" if feature in STRUCTURE_KINDS else feature
                raise fail(labels.get(what, what), f"not supported by the {self.settings.engine} engine yet")
        structure = params.structure
        if structure is not None and structure != defaults.params.structure:
            problem = self.structures.problem(structure)
            if problem:
                raise fail(labels["structure"], problem)
        return params, options

    def _stop_ids(self, stop: tuple[str, ...]) -> tuple[int, ...]:
        if stop not in self._stop_cache:
            self._stop_cache[stop] = self.tokenizer.stop_token_ids(stop)
        return self._stop_cache[stop]

    def _prompt_ids(self, file: InputFile, index: int, row: dict[str, Any], options: RowOptions) -> list[int]:
        cols = self.settings.columns
        if cols.messages:
            value = row.get(cols.messages, _MISSING)
            label = f"body.{cols.messages}" if file.kind == "openai" else cols.messages  # as the line spells it
            if value is _MISSING:
                raise RowError(file.name, index, label, "missing")
            messages = check_messages(file.name, index, label, value)
            if self.settings.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.settings.system_prompt}, *messages]
            field = cols.messages
        elif cols.templates is not None:
            messages, text, field = self._templated(file, index, row, cols.templates)
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
        if messages is None and (options.tools is not None or options.template_kwargs):
            what = "tools" if options.tools is not None else "chat_template_kwargs"
            raise RowError(file.name, index, f"body.{what}" if file.kind == "openai" else what,
                           "needs a chat template (not --raw)")
        try:
            if messages is None:
                ids = self.tokenizer.encode(text)
            elif not cols.messages and options.tools is None and not options.template_kwargs:
                ids = self.tokenizer.render_chat(messages)  # the common case, without the tools machinery
            else:
                ids = self.prompts.render(messages, options.tools, options.template_kwargs)
        except Exception as e:  # template errors are data errors: the row's content broke the template
            raise RowError(file.name, index, field, f"cannot render the prompt ({str(e)[:200]})") from e
        if self.max_context and len(ids) >= self.max_context:
            raise RowError(file.name, index, field,
                           f"prompt is {len(ids)} tokens; the model's context is {self.max_context}")
        return ids


    def _templated(self, file: InputFile, index: int, row: dict[str, Any],
                   templates: PromptTemplates) -> tuple[list[dict[str, Any]] | None, str, str]:
        """(messages or None for --raw, the user text, the field to name in errors) of a templated row."""
        text = templates.prompt.render(row, file.name, index)
        if not text.strip():
            raise RowError(file.name, index, None, f"the template {templates.prompt.label} rendered an empty prompt")
        if not self.settings.use_chat:
            return None, text, templates.prompt.label
        messages = [{"role": "user", "content": text}]
        system = templates.system.render(row, file.name, index) if templates.system else self.settings.system_prompt
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return messages, text, templates.prompt.label


def _warn(msg: str) -> None:
    print(f"dspine-batch: {msg}", file=sys.stderr, flush=True)


_MISSING = object()


def _fits(v: Any, t: pa.DataType) -> bool:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return isinstance(v, str)
    if pa.types.is_boolean(t):
        return isinstance(v, bool)
    if isinstance(v, bool) or (pa.types.is_integer(t) and not isinstance(v, int)):
        return False
    if pa.types.is_floating(t) and not isinstance(v, (int, float)):
        return False
    try:  # (an integer out of the column's range, e.g. a JSON 10**400, is refused here, not when the part is written)
        pa.scalar(v, type=t)
        return True
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return False


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__
