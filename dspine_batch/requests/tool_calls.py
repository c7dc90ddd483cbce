"""``--tool-call-parser``: tool calls read out of a completion's text, in OpenAI's shape.

Two formats, as the models write them (parsers of the same names exist in SGLang and vLLM; ours are written
from the formats):

* ``hermes`` (Hermes, Qwen2.5, Qwen3, and the system block ``prompts.tools_block`` gives templates without
  tools): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
* ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>``, values as raw text, typed by the tool's JSON schema (integer, number, boolean,
  object/array as JSON; anything else, or an unknown parameter, stays a string).

A call is kept when it parses and names one of the row's tools; it is then cut from the text, and what remains
(stripped) is the answer's content. A block that does not parse (cut by ``max_new_tokens``, broken JSON) or
names an unknown function stays in the text, so nothing the model wrote is lost. ``arguments`` is a JSON string,
as in OpenAI's responses, and always strict JSON: Python's ``json`` reads ``NaN``, ``Infinity`` and ``1e400``
(as inf) and would write them back as ``NaN``/``Infinity``, which no strict parser (nor OpenAI's client) takes,
so a Hermes call holding one stays in the text, its reason given to ``refused``; a ``qwen3_coder`` number that is
not finite stays a string, like any value that does not read as its type.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

PARSERS = ("hermes", "qwen3_coder")
Call = dict[str, str]  # {"name", "arguments" (JSON text)}

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class NotStrictJSON(ValueError):
    """JSON that only Python reads: ``NaN``, ``Infinity``, or a number beyond float range."""


def _no_constant(name: str) -> Any:
    raise NotStrictJSON(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotStrictJSON(f"{text} is beyond a double's range")
    return value


def strict_loads(text: str) -> Any:
    """``json.loads`` refusing what strict JSON has not (``NotStrictJSON``, a ValueError), so that what is read can
    be written back as JSON any parser takes. Nesting deeper than the interpreter's stack (a model can write a
    thousand ``[``) is a ValueError too, not a RecursionError that would end the job."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError as e:
        raise ValueError("nested too deeply") from e


def parse_tool_calls(text: str, parser: str, tools: list[dict[str, Any]] | None,
                     refused: list[str] | None = None) -> tuple[str, list[Call]]:
    """``(content, calls)``: the text without the calls that parsed, and those calls in order. ``refused`` gets
    the reason of each call that parsed only as non-strict JSON (it stays in the text)."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r} (choose from {', '.join(PARSERS)})")
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    calls: list[Call] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        try:
            call = _hermes(m.group(1)) if parser == "hermes" else _coder(m.group(1), schemas)
        except NotStrictJSON as e:
            if refused is not None:
                refused.append(f"a tool call's arguments are not strict JSON ({e}); it stays in the text")
            continue
        if call is None or (tools is not None and call["name"] not in schemas):
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _hermes(body: str) -> Call | None:
    """The call in a Hermes block; raises ``NotStrictJSON`` for one that is JSON only to Python."""
    try:
        obj = strict_loads(body)
    except NotStrictJSON:
        raise
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = strict_loads(args)
        except NotStrictJSON:
            raise
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _coder(body: str, schemas: dict[str, Any]) -> Call | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    props = (schemas.get(name) or {}).get("properties") or {}
    args = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key = p.group(1).strip()
        args[key] = _typed(_unwrap(p.group(2)), (props.get(key) or {}).get("type"))
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _unwrap(value: str) -> str:
    """The value without the one newline the format puts on each side of it."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _typed(value: str, kind: Any) -> Any:
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), None)
    text = value.strip()
    if text.lower() == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            if re.fullmatch(r"-?\d+", text):
                return int(text)
            return _finite(text)  # (float() also reads "nan", "inf" and 1e400: those stay strings)
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            return strict_loads(text)
    except ValueError:
        pass
    return value
