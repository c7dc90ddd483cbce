"""Request fields as users write them, per row and job-wide, checked and made canonical in one place.

A row asks for more than a prompt through its fields: a column of that name (JSONL, Parquet), or a key of an
OpenAI batch line's ``body``, under OpenAI's and vLLM's names (``max_tokens``, ``response_format``,
``guided_json``, ``logit_bias``...). The same settings exist job-wide as flags, DSPINE_BATCH_* variables and
job-file keys; a row's field overrides the job's. Every check names what is wrong the way the user wrote it:
``file: row N, field 'body.response_format.json_schema.schema': ...`` for a row, ``--json-schema FILE: ...`` for
a flag, never a bare "unsupported".

Values are made canonical here (a structure as ``engines.base.Structure``, ``logit_bias`` sorted by token id,
tools as plain JSON), so equal requests are equal for the fingerprint and for grammar caches. Object-valued
fields may also be given as JSON text: Parquet struct columns add null members for keys a row lacks, so a
schema or a tool list is best stored as a string column.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspine_batch.engines.base import SamplingParams, Structure
from dspine_batch.errors import UsageError

Fail = Callable[[str, str], Exception]  # (field label, message) -> the exception to raise

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "top_logprobs",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias")
ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}  # OpenAI's names
STRUCTURE_FIELDS = ("response_format", "regex", "choice", "grammar",  # OpenAI, SGLang/vLLM
                    "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older names
PROMPT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
ROW_FIELDS = SAMPLING_FIELDS + tuple(ALIASES) + STRUCTURE_FIELDS + PROMPT_FIELDS + ("n",)
# OpenAI body keys that do not change what is generated offline: accepted and not used
MAX_N = 128  # OpenAI's bound on n
TOOL_CHOICES = ("none", "auto", "required")
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                    "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"})


@dataclass(frozen=True)
class RowOptions:
    """What a row asks beyond sampling: how its prompt is rendered, how its answer is read, how many samples.
    Rows that set none of these share the job's instance."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1

    @property
    def forced_tool(self) -> bool:
        """tool_choice forces a call: the output is the call's JSON, constrained by a schema."""
        return self.tools is not None and self.tool_choice not in ("none", "auto")

    @property
    def parse_tools(self) -> bool:
        return self.tools is not None and self.tool_choice != "none"


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def schema_json(schema: Any) -> str:
    """A JSON schema as compact JSON in the user's key order: the order of ``properties`` is the order the fields
    are generated in (as OpenAI writes them), so it must not be sorted away."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite number that fits a float. JSON integers have no bound (``10**400`` parses), and
    ``math.isfinite`` of one beyond float range raises OverflowError instead of answering: try the conversion."""
    if _is_int(v):
        try:
            float(v)
        except OverflowError:
            return False
        return True
    return isinstance(v, float) and math.isfinite(v)


SEED_RANGE = (-(2**63), 2**64)  # what a 64-bit seed holds (int64 or uint64): engines take the seed as one
# Token counts reach engines as 32-bit integers (SGLang's sampling tensors): a JSON integer has no bound. Beyond
# this, max_tokens means "until the context is full" and top_k "every token", which is what these are made.
INT32_MAX = 2**31 - 1


def check_param(name: str, value: Any, fail: Callable[[str], Exception]) -> Any:
    """One sampling setting, checked and canonical; ``fail(msg)`` builds the exception to raise."""
    if name == "max_new_tokens":
        if not _is_int(value) or value < 1:
            raise fail(f"expected an integer >= 1, got {_show(value)}")
        value = min(value, INT32_MAX)
    elif name == "temperature":
        if not _is_num(value) or value < 0:
            raise fail(f"expected a number >= 0, got {_show(value)}")
        value = float(value)
    elif name == "top_p":
        if not _is_num(value) or not 0 < value <= 1:
            raise fail(f"expected a number in (0, 1], got {_show(value)}")
        value = float(value)
    elif name == "top_k":
        if not _is_int(value) or value < -1:
            raise fail(f"expected an integer >= 0 (0 or -1: off), got {_show(value)}")
        value = max(value, 0) if value <= INT32_MAX else 0
    elif name == "seed":
        if not _is_int(value) or not SEED_RANGE[0] <= value < SEED_RANGE[1]:
            raise fail(f"expected a 64-bit integer, got {_show(value)}")
    elif name == "stop":
        if isinstance(value, str) and value:  # ("": a stop found at once, which would cut every answer to nothing)
            value = (value,)
        elif isinstance(value, list | tuple) and all(isinstance(s, str) and s for s in value):
            value = tuple(value)
        else:
            raise fail(f"expected a non-empty string or a list of non-empty strings, got {_show(value)}")
    elif name == "logprobs":
        if not isinstance(value, bool):
            raise fail(f"expected true or false, got {_show(value)}")
    elif name == "top_logprobs":
        if not _is_int(value) or not 0 <= value <= 20:
            raise fail(f"expected an integer in 0..20, got {_show(value)}")
    elif name in ("presence_penalty", "frequency_penalty"):
        if not _is_num(value) or not -2 <= value <= 2:
            raise fail(f"expected a number in [-2, 2], got {_show(value)}")
        value = float(value)
    elif name == "repetition_penalty":
        if not _is_num(value) or value <= 0:
            raise fail(f"expected a number > 0 (1 = off), got {_show(value)}")
        value = float(value)
    elif name == "min_tokens":
        if not _is_int(value) or value < 0:
            raise fail(f"expected an integer >= 0, got {_show(value)}")
        if value > INT32_MAX:
            raise fail(f"expected at most {INT32_MAX}, got {_show(value)}")
    elif name == "logit_bias":
        value = _logit_bias(value, fail)
    elif name == "n":
        if not _is_int(value) or not 1 <= value <= MAX_N:
            raise fail(f"expected an integer in 1..{MAX_N}, got {_show(value)}")
    return value


def _logit_bias(value: Any, fail: Callable[[str], Exception]) -> tuple[tuple[int, float], ...]:
    """``{"50256": -100}`` (OpenAI: token ids as JSON keys), a list of ``[id, bias]`` pairs (a Parquet map) or
    JSON text of either -> ``((id, bias), ...)`` sorted by id."""
    value = _json_value(value, fail, (dict, list))
    pairs = list(value.items()) if isinstance(value, dict) else value
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise fail(f"expected {{token id: bias}}, got {_show(pair)}")
        key, bias = pair
        tid = _token_id(key)
        if tid is None:
            raise fail(f"token id {_show(key)}: expected an integer >= 0")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise fail(f"token {tid}: expected a bias in [-100, 100], got {_show(bias)}")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


def _token_id(key: Any) -> int | None:
    """A ``logit_bias`` key as a token id, None when it is not one. Only ASCII digits: ``str.isdigit`` also
    accepts ``"²"``, which ``int`` refuses, and ``"٣"``, which ``int`` reads as 3; ``int`` refuses more than 4,300
    digits (a ValueError, caught). Ids beyond the vocabulary are the mapper's to refuse."""
    if isinstance(key, str):
        text = key.strip()
        if not (text.isascii() and text.isdigit()):
            return None
        try:
            return int(text)
        except ValueError:
            return None
    return key if _is_int(key) and key >= 0 else None


def _show(value: Any, limit: int = 80) -> str:
    """A value as a message quotes it: its repr, cut (an integer of 400 digits, a whole document)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_value(value: Any, fail: Callable[[str], Exception], kinds: tuple[type, ...]) -> Any:
    """An object-valued field, given as the value or as JSON text of it (too deep nesting is a RecursionError
    in ``json.loads``, not a ValueError: it is bad JSON all the same)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise fail(f"not valid JSON ({str(e)[:200]})") from e
    if not isinstance(value, kinds):
        want = " or ".join({"dict": "an object", "list": "a list"}[k.__name__] for k in kinds)
        raise fail(f"expected {want}, got {_type(value)}")
    return value


def _type(v: Any) -> str:
    return "null" if v is None else {"dict": "an object", "list": "a list", "str": "a string"}.get(
        type(v).__name__, type(v).__name__)


# -- structures -----------------------------------------------------------------------------------------------------
def structure_of(name: str, value: Any, fail: Fail, label: str) -> Structure | None:
    """The constraint a structure field asks for; None for ``response_format`` ``{"type": "text"}`` (which
    turns a job-wide structure off for that row)."""
    if name == "response_format":
        rf = _json_value(value, lambda m: fail(label, m), (dict,))
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return Structure("json_object", "")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise fail(f"{label}.json_schema", f"expected an object {{name, schema, strict}}, got {_type(js)}")
            if "strict" in js and not isinstance(js["strict"], bool | type(None)):
                raise fail(f"{label}.json_schema.strict", f"expected true or false, got {js['strict']!r}")
            return _schema(js.get("schema"), fail, f"{label}.json_schema.schema")
        raise fail(f"{label}.type", f"expected text, json_object or json_schema, got {_show(kind)}")
    if name == "guided_json":
        return _schema(value, fail, label)
    if name in ("regex", "guided_regex", "grammar", "guided_grammar"):
        if not isinstance(value, str) or not value.strip():
            raise fail(label, f"expected a non-empty string, got {_show(value)}")
        return Structure("regex" if "regex" in name else "grammar", value)
    if name in ("choice", "guided_choice"):
        if not isinstance(value, list | tuple) or not value or not all(isinstance(c, str) and c for c in value):
            raise fail(label, f"expected a non-empty list of non-empty strings, got {_show(value)}")
        return Structure("choice", canonical_json(list(dict.fromkeys(value))))
    raise AssertionError(name)  # pragma: no cover - STRUCTURE_FIELDS only


def _schema(value: Any, fail: Fail, label: str) -> Structure:
    schema = _json_value(value, lambda m: fail(label, m), (dict,))
    return Structure("json_schema", schema_json(schema))


# -- tools ------------------------------------------------------------------------------------------------------------
def check_tools(value: Any, fail: Fail, label: str) -> list[dict[str, Any]]:
    """OpenAI's ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``."""
    tools = _json_value(value, lambda m: fail(label, m), (list,))
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{label}[{i}]"
        if not isinstance(tool, dict):
            raise fail(where, f"expected an object, got {_type(tool)}")
        if tool.get("type", "function") != "function":
            raise fail(f"{where}.type", f"only \"function\" tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise fail(f"{where}.function", f"expected an object {{name, description, parameters}}, got {_type(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise fail(f"{where}.function.name", f"expected a non-empty string, got {name!r}")
        if name in names:
            raise fail(f"{where}.function.name", f"{name!r} is given twice")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise fail(f"{where}.function.parameters", f"expected a JSON schema object, got {_type(fn['parameters'])}")
    return [{"type": "function", "function": t["function"]} for t in tools]


def check_tool_choice(value: Any, fail: Fail, label: str) -> Any:
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return {"type": "function", "function": {"name": value["function"]["name"]}}
    raise fail(label, 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
                      f"got {_show(value)}")


def forced_tool_structure(tools: list[dict[str, Any]], choice: Any, fail: Fail, label: str) -> Structure:
    """A ``tool_choice`` that forces a call, as a JSON schema over ``{"name", "arguments"}``: the output is then
    the call itself (``answers`` reads it as one), constrained like any schema row. ``required``: any of the
    tools; ``{"type": "function", ...}``: that one."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in by_name:
            raise fail(f"{label}.function.name", f"{name!r} is not one of the tools ({', '.join(by_name)})")
        picks = [by_name[name]]
    else:
        picks = list(by_name.values())
    options = [{"type": "object", "properties": {"name": {"const": fn["name"]},
                                                 "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for fn in picks]
    return Structure("json_schema", schema_json(options[0] if len(options) == 1 else {"anyOf": options}))


def check_template_kwargs(value: Any, fail: Fail, label: str) -> dict[str, Any]:
    kw = _json_value(value, lambda m: fail(label, m), (dict,))
    for key in kw:
        if not isinstance(key, str) or not key.isidentifier():
            raise fail(f"{label}.{key}", "expected a template variable name")
        if key in RESERVED_TEMPLATE_VARS:
            raise fail(f"{label}.{key}", "set by dspine-batch itself; it cannot be passed to the template")
    return kw


# -- one row ----------------------------------------------------------------------------------------------------------
@dataclass
class RowRequest:
    """A row's fields, parsed: SamplingParams overrides, the structure (``unset`` when the row has none),
    prompt/answer options, and the label of each feature's field (for refusals that name it)."""

    params: dict[str, Any] = field(default_factory=dict)
    structure: Structure | None | str = "unset"
    options: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def parse_fields(values: dict[str, Any], label: Callable[[str], str], fail: Fail) -> RowRequest:
    """Parse the request fields present (not None) in ``values``; ``label(name)`` is how the field is named in a
    message (``body.top_p`` for an OpenAI line, ``top_p`` for a column, ``--top-p`` for a flag)."""
    req = RowRequest()
    structure_from: str | None = None
    for name, value in values.items():
        if value is None:
            continue
        where = label(name)
        target = ALIASES.get(name, name)
        if target in SAMPLING_FIELDS or name == "n":
            v = check_param(target, value, lambda m, w=where: fail(w, m))
            if target in req.params and req.params[target] != v:
                raise fail(where, f"disagrees with {req.labels[target]} ({req.params[target]!r})")
            (req.options if name == "n" else req.params)[target] = v
            req.labels[target] = where
        elif name in STRUCTURE_FIELDS:
            if structure_from is not None:
                raise fail(where, f"only one structure per request (also given: {structure_from})")
            req.structure, structure_from = structure_of(name, value, fail, where), where
            req.labels["structure"] = where
        elif name == "tools":
            req.options["tools"] = check_tools(value, fail, where)
        elif name == "tool_choice":
            req.options["tool_choice"] = check_tool_choice(value, fail, where)
            req.labels["tool_choice"] = where
        elif name == "parallel_tool_calls":
            if not isinstance(value, bool):
                raise fail(where, f"expected true or false, got {_show(value)}")
            req.options["parallel_tool_calls"] = value
        elif name == "chat_template_kwargs":
            req.options["template_kwargs"] = check_template_kwargs(value, fail, where)
    return req


# -- a row over the job's defaults --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Defaults:
    """The job-wide request: its SamplingParams (structure included), options, and each set field's flag."""

    params: SamplingParams
    options: RowOptions
    labels: dict[str, str]


def merge(job: Defaults, row: RowRequest, fail: Fail) -> tuple[dict[str, Any], RowOptions, dict[str, str]]:
    """A row's fields over the job's: SamplingParams overrides (relative to ``job.params``), the row's options,
    and the label of each setting's field (the row's where it set one, else the job's flag)."""
    over = dict(row.params)
    labels = {**job.labels, **row.labels}
    options = RowOptions(**{**job.options.__dict__, **row.options}) if row.options else job.options
    if row.structure != "unset":
        over["structure"] = row.structure
    if options.tool_choice not in ("auto", "none") and options.tools is None and (
            "tool_choice" in row.labels or row.options):
        raise fail(labels["tool_choice"], "needs tools")
    if job.options.forced_tool and not options.forced_tool and row.structure == "unset":
        over["structure"] = None  # the job's structure was its forced tool call, which this row turned off
    if options.forced_tool and (row.options or row.structure != "unset"):
        if row.structure not in ("unset", None):
            raise fail(labels["tool_choice"], f"a forced tool call cannot be combined with {labels['structure']}")
        over["structure"] = forced_tool_structure(options.tools or [], options.tool_choice, fail,
                                                  labels["tool_choice"])
        labels["structure"] = labels["tool_choice"]
    if over.get("top_logprobs", job.params.top_logprobs) and not over.get("logprobs", job.params.logprobs):
        if "top_logprobs" not in row.params:  # the row turned logprobs off: no alternatives either
            over["top_logprobs"] = 0
        else:
            raise fail(labels["top_logprobs"], "needs logprobs: true")
    low, high = over.get("min_tokens", job.params.min_tokens), over.get("max_new_tokens", job.params.max_new_tokens)
    if low > high and ("min_tokens" in over or "max_new_tokens" in over):
        raise fail(labels.get("min_tokens") or labels["max_new_tokens"], f"min_tokens {low} is more than "
                   f"max_new_tokens {high}")
    structure = over.get("structure", job.params.structure)
    if low and structure is not None and ("min_tokens" in over or "structure" in over):
        raise fail(labels.get("min_tokens") or flag("min_tokens"), f"cannot be combined with "
                   f"{labels.get('structure') or 'a structure'}: {MIN_TOKENS_WITH_GRAMMAR}")
    return over, options, labels


# Why ``min_tokens`` and a structure are refused together (issue 43): a grammar decides where its output ends, and
# where it allows nothing but a stop before ``min_tokens`` tokens the two cannot both hold. The reference engine
# would let the grammar end the row (``dspine.decoding.processors.grammar_wins``); SGLang masks the stops after its
# penalizers and leaves no token at all. Refusing the pair keeps both engines in agreement and no row half-honoured.
MIN_TOKENS_WITH_GRAMMAR = ("a structured output ends where its grammar ends; use max_tokens, or a schema that "
                           "asks for the length (minLength, minItems)")


# -- the job's flags --------------------------------------------------------------------------------------------------
FILE_FLAGS = {"guided_json": "--json-schema", "grammar": "--grammar", "tools": "--tools"}


def flag(name: str) -> str:
    return FILE_FLAGS.get(name) or "--" + name.replace("_", "-")


def _file_or_inline(path: str, name: str, as_json: bool) -> Any:
    """A file option's value: the file's text (parsed when ``as_json``), or inline JSON given in its place."""
    if as_json and path.lstrip().startswith(("{", "[")):
        text = path
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{flag(name)} {path}: {getattr(e, 'strerror', None) or e}") from e
    if not as_json:
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"{flag(name)} {path}: not valid JSON ({str(e)[:200]})") from e


def _file_label(flag_name: str, value: str) -> str:
    return flag_name if value.lstrip().startswith(("{", "[")) else f"{flag_name} {value}"


def job_request(settings: dict[str, Any]) -> RowRequest:
    """The job-wide request fields from the resolved settings (``GenerateConfig``), checked before the model
    loads; a problem is a ``UsageError`` naming the flag (and file)."""
    values: dict[str, Any] = {name: settings.get(name) for name in SAMPLING_FIELDS if name != "stop"}
    labels = {name: flag(name) for name in values}
    if settings.get("logit_bias"):
        try:
            values["logit_bias"] = {str(k): float(v) for k, v in dict(settings["logit_bias"]).items()}
        except ValueError as e:
            raise UsageError(f"--logit-bias: expected TOKEN_ID=BIAS with a number as BIAS ({e})") from e
    values["logprobs"] = bool(settings.get("logprobs")) or bool(settings.get("top_logprobs"))
    if settings.get("response_format"):
        values["response_format"] = settings["response_format"]
    if settings.get("json_schema"):
        values["guided_json"] = _file_or_inline(settings["json_schema"], "guided_json", True)
        labels["guided_json"] = _file_label("--json-schema", settings["json_schema"])
    for name in ("regex", "choice"):
        if settings.get(name):
            values[name] = list(settings[name]) if name == "choice" else settings[name]
    if settings.get("grammar"):
        values["grammar"] = _file_or_inline(settings["grammar"], "grammar", False)
        labels["grammar"] = f"--grammar {settings['grammar']}"
    if settings.get("tools"):
        values["tools"] = _file_or_inline(settings["tools"], "tools", True)
        labels["tools"] = _file_label("--tools", settings["tools"])
    choice = settings.get("tool_choice") or "auto"
    values["tool_choice"] = choice if choice in TOOL_CHOICES else {"type": "function", "function": {"name": choice}}
    if settings.get("chat_template_kwargs"):
        values["chat_template_kwargs"] = settings["chat_template_kwargs"]

    def fail(label: str, msg: str) -> Exception:
        return UsageError(f"{label}: {msg}")

    return parse_fields(values, lambda name: labels.get(name) or flag(name), fail)


def identity(req: RowRequest) -> dict[str, Any]:
    """The job-wide request as it enters the run's fingerprint: canonical values, files by content."""
    out: dict[str, Any] = {k: (list(map(list, v)) if k == "logit_bias" else v) for k, v in sorted(req.params.items())
                           if k not in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")}  # in the config
    s = req.structure if isinstance(req.structure, Structure) else None
    out["structure"] = {"kind": s.kind, "digest": s.digest} if s else None
    opts = req.options
    tools = opts.get("tools")
    out["tools"] = hashlib.sha256(canonical_json(tools).encode()).hexdigest()[:24] if tools is not None else None
    out["tool_choice"] = opts.get("tool_choice", "auto")
    out["chat_template_kwargs"] = canonical_json(opts.get("template_kwargs") or {})
    return out
