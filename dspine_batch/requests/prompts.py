"""A row's prompt as token ids: its text or chat messages, the system prompt, tools and template options.

Chat messages are checked here (roles, text content, the assistant's earlier ``tool_calls``, ``tool`` replies)
so a bad conversation is a row error naming the message, not a template exception. ``tools`` and
``chat_template_kwargs`` go to the model's chat template as variables, as transformers' ``apply_chat_template``
passes them. Tools are never dropped silently: a template that does not read ``tools`` (the embedded
SmolLM2's; found once per job by rendering a probe conversation with and without a tool) gets them as a system
prompt block instead, in the Hermes/Qwen tag format that ``--tool-call-parser hermes`` reads back
(``tools_block``), with one warning per job. Earlier turns of such a conversation are rewritten into the same
tags (an assistant's ``tool_calls`` as ``<tool_call>`` blocks, a ``tool`` reply inside ``<tool_response>``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dspine_batch.engines.base import Tokenizer
from dspine_batch.errors import RowError

ROLES = {"system", "user", "assistant", "tool"}
_PROBE_TOOL = [{"type": "function", "function": {"name": "dspine_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]

TOOLS_BLOCK = """# Tools

You can call functions to help with the request. Their signatures, as JSON, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with one JSON object per call, each inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>"""


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that carries ``tools`` to a model whose template does not read them: one JSON
    object per tool inside ``<tools>``, and the ``<tool_call>`` format to answer in."""
    return TOOLS_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def tool_call_text(call: dict[str, Any]) -> str:
    """An assistant's earlier call, as the ``<tool_call>`` block the model would have written."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"


def check_messages(name: str, index: int, field: str, value: Any) -> list[dict[str, Any]]:
    """The row's conversation, checked; text-part lists (``[{"type": "text", "text": ...}]``) joined into one
    string so every template sees plain text."""
    if not isinstance(value, list) or not value:
        raise RowError(name, index, field, f"expected a non-empty list of messages, got {_type_name(value)}")
    out = []
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise RowError(name, index, where, f"expected an object, got {_type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # (an object is unhashable: no set lookup for it)
            raise RowError(name, index, f"{where}.role", f"expected one of {sorted(ROLES)}, got {_short(role)}")
        content = m.get("content")
        if isinstance(content, list):
            content = _join_parts(name, index, f"{where}.content", content)
            m = {**m, "content": content}
        calls = m.get("tool_calls")
        if calls is None and "tool_calls" in m:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise RowError(name, index, f"{where}.tool_calls",
                               "expected an assistant's list of {type, function: {name, arguments}}")
            if content is None:
                m = {**m, "content": ""}
        elif not isinstance(content, str):
            raise RowError(name, index, f"{where}.content", f"expected a string, got {_type_name(content)}")
        out.append(m)
    return out


def _join_parts(name: str, index: int, field: str, parts: list[Any]) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _type_name(part)
            raise RowError(name, index, f"{field}[{j}]", f"only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


class PromptRenderer:
    """Messages -> token ids through the model's chat template, with tools carried in the template's own way or,
    where it has none, as a system block (``tools_block``)."""

    def __init__(self, tokenizer: Tokenizer, warn: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.warn = warn
        self._reads_tools: bool | None = None

    def template_reads_tools(self) -> bool:
        """Whether the template renders ``tools``: a probe conversation with and without one tool."""
        if self._reads_tools is None:
            try:
                with_tool = self.tokenizer.render_chat(_PROBE_MESSAGES, tools=_PROBE_TOOL)
                self._reads_tools = with_tool != self.tokenizer.render_chat(_PROBE_MESSAGES)
            except Exception:  # a template that breaks on tools cannot be given them either
                self._reads_tools = False
            if not self._reads_tools:
                self.warn("warning: the model's chat template ignores `tools`; rows with tools get them as a "
                          "system-prompt block in the Hermes format (read calls back with --tool-call-parser "
                          "hermes; README, 'Requests')")
        return self._reads_tools

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any]) -> list[int]:
        if (tools is None and not any("tool_calls" in m for m in messages)) or self.template_reads_tools():
            extra = {"tools": tools} if tools is not None else {}
            return self.tokenizer.render_chat(messages, **extra, **template_kwargs)
        messages = [_plain(m) for m in messages]
        if tools is not None:
            block = tools_block(tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
            else:
                messages.insert(0, {"role": "system", "content": block})
        return self.tokenizer.render_chat(messages, **template_kwargs)


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    """A message in the tag format, for templates that know nothing of tool calls."""
    if m.get("tool_calls"):
        text = "\n".join([m["content"]] * bool(m["content"]) + [tool_call_text(c) for c in m["tool_calls"]])
        return {"role": m["role"], "content": text}
    if m["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    return m


def _short(v: Any, limit: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__
