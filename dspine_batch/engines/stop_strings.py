"""Stop strings, applied after generation (engines stop on token ids; a string may span tokens).

One cut for every engine: the text ends before the earliest stop string, and the token ids end with the
token that completed it (the tokens the engine really generated). Finding that token must not decode every
prefix (quadratic in the output length): the pieces of single tokens give a position estimate in one linear
pass, and a joint decode of the prefix confirms it (moving a token at a time where joint decoding merges bytes
that single tokens cannot show, e.g. a multi-byte character split across tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]


def cut_at_stop(text: str, token_ids: list[int], stop: Sequence[str],
                decode: Decode) -> tuple[str, list[int]] | None:
    """``(text, token_ids)`` cut at the earliest stop string, or None when no stop string occurs."""
    hits = [(at, s) for s in stop if (at := text.find(s)) >= 0]
    if not hits:
        return None
    at, s = min(hits)
    return text[:at], token_ids[:_tokens_through(token_ids, s, at + len(s), decode)]


def _tokens_through(token_ids: list[int], s: str, end: int, decode: Decode) -> int:
    """The smallest k such that ``decode(token_ids[:k])`` contains ``s``, whose first occurrence in the full
    text ends at character ``end``."""
    n, k, length = len(token_ids), len(token_ids), 0
    for i, t in enumerate(token_ids, 1):  # one pass of single-token pieces: the estimate
        length += len(decode([t]))
        if length >= end:
            k = i
            break
    while k < n and s not in decode(token_ids[:k]):  # joint decodes confirm it (usually no step at all)
        k += 1
    while k > 1 and s in decode(token_ids[:k - 1]):
        k -= 1
    return k
