"""``--reasoning-parser``: a reasoning model's thinking split out of its answer (``reasoning_content``).

Both parsers read the ``<think>...</think>`` block; they differ in where the block may start, as the models'
chat templates do (the same behaviour as SGLang's and vLLM's parsers of these names, written from the formats):

* ``qwen3``: Qwen3 writes ``<think>`` itself (its template puts an empty block in the prompt when
  ``enable_thinking`` is false); the Qwen3 "thinking" models' templates put ``<think>`` in the prompt, so their
  output holds only the closing tag. A closing tag, or an opening one, means a reasoning block; text with
  neither is all answer.
* ``deepseek-r1``: the template opens the block in the prompt, so everything up to ``</think>`` is reasoning
  whether or not ``<think>`` appears; with no closing tag, all of it is (the answer never started).

A block cut by ``max_new_tokens`` is all reasoning and an empty answer. Both texts are stripped of surrounding
whitespace; an empty block gives ``reasoning_content`` null.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """``(reasoning_content, answer)`` of a completion."""
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r} (choose from {', '.join(PARSERS)})")
    if parser == "qwen3" and START not in text and END not in text:
        return None, text
    head = text.lstrip()
    if head.startswith(START):
        head = head[len(START):]
    reasoning, closed, answer = head.partition(END)
    if not closed:
        return reasoning.strip() or None, ""
    return reasoning.strip() or None, answer.strip()
