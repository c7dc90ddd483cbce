"""A ``Structure`` as an xgrammar grammar: the one translation every engine and the up-front check share.

xgrammar is what SGLang and vLLM use for structured outputs, and it runs on a CPU. Building a grammar needs no
tokenizer (``xgrammar.Grammar.from_json_schema`` / ``from_regex`` / ``from_ebnf``), so the pipeline can check
every distinct structure of a job before the model loads; an engine then compiles the same grammar against its
tokenizer (``GrammarCompiler.compile_grammar``). ``choice`` becomes an EBNF alternation of JSON-escaped string
literals (xgrammar's EBNF string escapes are JSON's), ``json_object`` xgrammar's built-in JSON grammar.

xgrammar is imported on first use only: it costs seconds (it imports torch and transformers).
"""

from __future__ import annotations

import json
import re
from typing import Any

from dspine_batch.engines.base import Structure

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[16:00:19] /project/cpp/regex_converter.cc:83: "


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"`` for the allowed strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(structure: Structure) -> Any:
    """The ``xgrammar.Grammar`` of ``structure``; raises ``ValueError`` with xgrammar's reason, in one line."""
    import xgrammar

    try:
        if structure.kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(structure.spec)
        if structure.kind == "json_object":
            return xgrammar.Grammar.builtin_json_grammar()
        if structure.kind == "regex":
            return xgrammar.Grammar.from_regex(structure.spec)
        if structure.kind == "choice":
            return xgrammar.Grammar.from_ebnf(choice_ebnf(json.loads(structure.spec)))
        return xgrammar.Grammar.from_ebnf(structure.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(short_reason(e)) from e


def short_reason(e: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ file and line), first line only."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = _LOG_PREFIX.sub("", text).removeprefix("Check failed: (error.empty()) is false: ")
    return text if len(text) <= 240 else text[:237] + "..."
