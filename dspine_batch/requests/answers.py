"""From an engine's completion to the answer columns: reasoning, tool calls, token log-probabilities.

One step between the scheduler and the sink, the same for every engine (the reference engine needs no SGLang
for it): ``--reasoning-parser`` moves the thinking into ``reasoning_content`` (``reasoning``);
``--tool-call-parser`` moves calls into ``tool_calls`` (``tool_calls``) for rows that have tools and a
``tool_choice`` other than ``none``; a row whose ``tool_choice`` forced a call generated the call's JSON itself
(``requests.forced_tool_structure``), read as one call whatever the parser. A completion that ended by itself
(``stop``) with a call gets ``finish_reason`` ``tool_calls``, as OpenAI reports it; one cut by ``length`` keeps
``length``. Call ids are ``call_`` + a hash of (row id, sample, position): stable across resumes.

Log-probabilities come from engines as ids and numbers (``engines.base.TokenLogprob``); each token gets its
text here (the tokenizer's decoding of that one id, special tokens included; a token holding part of a
multi-byte character decodes to U+FFFD) and its own bytes (``token_bytes``: from the tokenizer's vocabulary, so
a completion's tokens' bytes add up to its UTF-8 even where a character is split across tokens).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from dspine_batch.engines.base import Result, Tokenizer
from dspine_batch.requests.fields import RowOptions
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.requests.reasoning import split_reasoning
from dspine_batch.requests.tool_calls import Call, NotStrictJSON, parse_tool_calls, strict_loads

Finished = tuple[WorkItem, list[Result] | None]


class Answers:
    def __init__(self, tokenizer: Tokenizer, reasoning_parser: str | None, tool_call_parser: str | None,
                 warn: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self.warn = warn
        self._warned = False
        self._warned_strict = False
        self._tokens: dict[int, tuple[str, bytes]] = {}

    def run(self, finished: Iterator[Finished]) -> Iterator[Finished]:
        for item, results in finished:
            self.answer(item, results)
            yield item, results

    def answer(self, item: WorkItem, results: list[Result] | None) -> None:
        """One finished row's results read in place (the runner's per-row step)."""
        tools = item.options is not None and item.options.parse_tools
        reasoning = self.reasoning_parser is not None
        for r in results or ():
            if r.error is None and r.text is not None and (reasoning or tools or r.logprobs is not None):
                self.apply(item.options, r)

    def apply(self, options: RowOptions | None, r: Result) -> None:
        text = r.text or ""
        if self.reasoning_parser:
            r.reasoning_content, text = split_reasoning(text, self.reasoning_parser)
        calls: list[Call] = []
        refused: list[str] = []
        if options is not None and options.parse_tools:
            if options.forced_tool:
                calls = _forced_call(text, refused)
                text = "" if calls else text
            elif self.tool_call_parser:
                text, calls = parse_tool_calls(text, self.tool_call_parser, options.tools, refused)
            elif not self._warned:
                self._warned = True
                self.warn("warning: rows have tools but no --tool-call-parser: their calls stay in `output` "
                          "(hermes reads the format of the tools block given to templates without tools)")
            if refused and not self._warned_strict:
                self._warned_strict = True
                self.warn(f"warning: row {r.row_id!r} (sample {r.sample_index}): {refused[0]} (said once per job)")
        if calls:
            calls = calls[:1] if not options.parallel_tool_calls else calls  # type: ignore[union-attr]
            r.tool_calls = json.dumps([{"id": call_id(r.row_id, r.sample_index, k), "type": "function",
                                        "function": c} for k, c in enumerate(calls)], ensure_ascii=False)
            if r.finish_reason == "stop":
                r.finish_reason = "tool_calls"
        r.text = text
        if r.logprobs is not None:
            r.logprobs = [self._entry(e) for e in r.logprobs[:len(r.token_ids)]]  # type: ignore[misc]

    def _entry(self, e: Any) -> dict[str, Any]:
        """``(token_id, logprob, top)`` -> the ``logprobs`` column's struct, with token texts."""
        tid, lp, top = e
        return {"token_id": tid, **self._token(tid), "logprob": lp,
                "top_logprobs": [{"token_id": t, **self._token(t), "logprob": p} for t, p in top]}

    def _token(self, tid: int) -> dict[str, Any]:
        known = self._tokens.get(tid)
        if known is None:
            known = token_text(self.tokenizer, tid), token_bytes(self.tokenizer, tid)
            if len(self._tokens) < 1 << 20:
                self._tokens[tid] = known
        return {"token": known[0], "bytes": known[1]}


def token_text(tokenizer: Any, tid: int) -> str:
    """One token's text: the tokenizer's own ``token_text`` (special tokens kept) where it has one."""
    fn = getattr(tokenizer, "token_text", None)
    return fn(tid) if fn is not None else tokenizer.decode([tid])


def token_bytes(tokenizer: Any, tid: int) -> bytes:
    """One token's own bytes: the tokenizer's ``token_bytes`` where it has one (``HFTokenizer``), else the UTF-8
    of its text (right for tokenizers whose tokens are whole characters)."""
    fn = getattr(tokenizer, "token_bytes", None)
    return fn(tid) if fn is not None else token_text(tokenizer, tid).encode("utf-8", "surrogatepass")


def call_id(row_id: str, sample_index: int, k: int) -> str:
    digest = hashlib.blake2b(f"{row_id}\x1f{sample_index}\x1f{k}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def _forced_call(text: str, refused: list[str]) -> list[Call]:
    """The output of a forced tool choice: the call's JSON ``{"name", "arguments"}``. Strict JSON only: a schema's
    grammar allows ``1e400``, which Python reads as inf and would write as ``Infinity`` (the reason goes to
    ``refused`` and the call stays text)."""
    try:
        obj = strict_loads(text)
    except NotStrictJSON as e:
        refused.append(f"a tool call's arguments are not strict JSON ({e}); it stays in the text")
        return []
    except ValueError:
        return []
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"),
                                                                                             dict):
        return []
    return [{"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}]
