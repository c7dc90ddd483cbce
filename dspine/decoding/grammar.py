"""Structured outputs: a row's grammar (xgrammar, as SGLang and vLLM use it), its token masks, and the tokens it
forces.

A ``Constraint`` is a compiled grammar (JSON schema, regex, choice or EBNF; compiled once per job per distinct
grammar by the caller, who owns the tokenizer) plus the canonical tokenization of text; each row makes its own
``GrammarMatcher`` from it. The target distribution of a constrained row is the grammar-masked processed
distribution (``processors.py``): every slot a round reads — a plain step, each verify slot — is masked by the
matcher's state after the row's committed tokens *and the proposed tokens before that slot*. So a verify sees what
plain decoding would see at each position, and proposals are verified against exactly that.

The walk (``walk``): before the forward, each constrained row's matcher is advanced through its proposal, one
mask per slot; a proposed token the grammar refuses ends the row's verify there (the target could never accept
it, so its slot is not computed), and the matcher is rolled back. After the verdict only the committed tokens are
accepted into the matcher (``Row.push``): the grammar state never runs ahead of the text.

Forced tokens (``forced``): where the grammar leaves one continuation — its jump-forward string (JSON keys, quotes,
braces, the rest of an enum value once its first token is chosen), tokenized canonically, and then any run of
single allowed tokens — those tokens are proposed for free, verified like any proposal (point masses: a row's
tokens are plain decoding's whatever was proposed). A token that is the only one the mask allows is accepted
with probability one; a forced string's canonical tokens are accepted unless the model would split the same text
differently.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled grammar a row's output must follow. ``encode``: the canonical tokenization of a text (for
    forced strings); ``vocab_size``: the model's (the mask covers every id the model can produce)."""

    compiled: Any  # xgrammar.CompiledGrammar
    encode: Callable[[str], list[int]]
    vocab_size: int
    name: str = ""  # what the grammar is, for messages ("json_schema", "regex", ...)

    def matcher(self) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)


def new_bitmask(n: int, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V / 32)] int32, every token allowed (-1: all bits set)."""
    return torch.full((n, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of ``logits[rows]`` to -inf, in place (``bitmask[i]`` is the mask of ``logits[rows[i]]``)."""
    if not rows:
        return
    import xgrammar

    full = new_bitmask(logits.shape[0], logits.shape[-1])
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, full, indices=rows)


def allowed_count(bitmask_row: torch.Tensor, vocab_size: int) -> tuple[int, int]:
    """(tokens allowed, the lowest allowed id or -1) of one mask row."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    n = int(bits.sum())
    return n, (int(np.argmax(bits)) if n else -1)


def walk(matcher: Any, proposal: list[int], vocab_size: int,
         head: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """The masks of slots 0..ℓ of a verify of ``proposal`` [ℓ + 1, words] and ℓ, how many proposed tokens the
    grammar allows in a row (a refused token ends the verify before it: fewer masks then). After a token that ends
    the grammar the next slot's mask allows everything (the row stops at that token; the slot is never used).
    The matcher is left as it was. ``head``: the mask at the matcher's state, already filled this round
    (``processors.RowState.head``): slot 0 is copied from it, not filled again."""
    masks = new_bitmask(len(proposal) + 1, vocab_size)
    taken = 0
    if head is not None:
        masks[0] = head()[0]
    elif not matcher.is_terminated():
        matcher.fill_next_token_bitmask(masks, 0)
    for t in proposal:
        if matcher.is_terminated() or not matcher.accept_token(int(t)):
            break
        taken += 1
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(masks, taken)
    if taken:
        matcher.rollback(taken)
    return masks[: taken + 1], taken


def forced(matcher: Any, encode: Callable[[str], list[int]], vocab_size: int, limit: int,
           head: Callable[[], torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Tokens the grammar forces from the matcher's state, up to ``limit``: the jump-forward string's canonical
    tokens (as far as the grammar accepts them), then single allowed tokens. Returns (tokens, how many of them are
    single allowed tokens: the tail, certain). The matcher is left as it was. ``head``: the mask at the matcher's
    state (``walk``), used for the first single-token step when no string was forced."""
    out: list[int] = []
    text = matcher.find_jump_forward_string() if limit > 0 else ""
    if text:
        for t in encode(text)[:limit]:
            if not matcher.accept_token(int(t)):
                break
            out.append(int(t))
    lead = len(out)
    mask = new_bitmask(1, vocab_size)
    while len(out) < limit and not matcher.is_terminated():
        if not out and head is not None:
            now = head()  # the state's own mask, filled once a round (read here, never written)
        else:
            matcher.fill_next_token_bitmask(mask, 0)
            now = mask
        n, t = allowed_count(now[0], vocab_size)
        if n != 1 or not matcher.accept_token(t):
            break
        out.append(t)
    if out:
        matcher.rollback(len(out))
    return out, len(out) - lead


KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Compiled grammars a ``Grammars`` keeps (least recently used dropped first). Each holds xgrammar's token-mask
# cache (up to megabytes for a large vocabulary); jobs usually share a handful, and a job with one per row reuses
# none of them, so a few hundred cover the first kind without letting the second grow for the engine's life.
MAX_CACHED_GRAMMARS = 256


class Grammars:
    """Compiles each distinct grammar of a job once (thousands of rows usually share a handful), for one
    tokenizer: ``get(kind, spec)`` -> ``Constraint``. JSON comes out in xgrammar's compact layout (``", "`` and
    ``": "`` between items, no other whitespace): where any whitespace is allowed a model can pad a record with
    newlines until its token budget runs out (seen with small models; vLLM's ``disable_any_whitespace`` exists for
    the same reason). ``kind``: ``json_schema`` (``spec`` the schema's JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (``spec`` a JSON list of strings: exactly one of
    them), ``grammar`` (EBNF / GBNF text, rule ``root``). An invalid or unsupported grammar raises ValueError
    with xgrammar's first line."""

    def __init__(self, info: Any, encode: Callable[[str], list[int]], vocab_size: int, info_key: str | None = None):
        import xgrammar

        self.info, self.info_key = info, info_key  # info_key: compiled grammars kept on disk (``grammar_cache``)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.encode = encode
        self.vocab_size = vocab_size
        # most recently used last; bounded, since a job with a schema (or a forced tool call) per row compiles one
        # grammar per row and an engine lives for the whole job. A row keeps its own Constraint while it decodes,
        # so an eviction only costs a recompile for a later row that asks for the same grammar.
        self.cache: OrderedDict[tuple[str, str], Constraint] = OrderedDict()
        self.max_cached = MAX_CACHED_GRAMMARS

    @staticmethod
    def for_hf_dir(path: str, vocab_size: int, stop_ids: list[int], encode: Callable[[str], list[int]]) -> Grammars:
        """For a HF tokenizer dir (transformers reads it; xgrammar takes its vocabulary and kind from there), the
        tokenizer's info and every compiled grammar kept in the per-machine cache (``grammar_cache``)."""
        from dspine.decoding.grammar_cache import tokenizer_info

        info, key = tokenizer_info(path, vocab_size, list(stop_ids))
        return Grammars(info, encode, vocab_size, key)

    def get(self, kind: str, spec: str) -> Constraint:
        key = (kind, spec)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        constraint = Constraint(self._compile(kind, spec), self.encode, self.vocab_size, kind)
        self.cache[key] = constraint
        while len(self.cache) > self.max_cached:
            self.cache.popitem(last=False)
        return constraint

    def _compile(self, kind: str, spec: str) -> Any:
        def compile() -> Any:
            grammar = grammar_of(kind, spec)
            try:
                return self.compiler.compile_grammar(grammar)
            except (RuntimeError, ValueError, TypeError) as e:
                raise ValueError(f"invalid {kind}: {short_reason(e)}") from e

        if self.info_key is None:
            return compile()
        from dspine.decoding.grammar_cache import compiled_grammar

        return compiled_grammar(self.info, self.info_key, kind, spec, compile)


def grammar_of(kind: str, spec: str) -> Any:
    """The ``xgrammar.Grammar`` of a structure (no tokenizer needed: a batch tool checks every distinct one before
    the model loads). ``json_schema`` / ``json_object`` in the compact layout (see ``Grammars``); ``choice`` an EBNF
    alternation of JSON-escaped string literals (xgrammar's EBNF escapes are JSON's). Raises ValueError with
    xgrammar's reason in one line."""
    import json

    import xgrammar

    try:
        if kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(spec)
        if kind == "choice":
            options = json.loads(spec)
            if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
                raise ValueError("expected a non-empty list of strings")
            return xgrammar.Grammar.from_ebnf(choice_ebnf(options))
        if kind == "grammar":
            return xgrammar.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(short_reason(e)) from e
    raise ValueError(f"unknown grammar kind {kind!r} (expected one of {', '.join(KINDS)})")


def choice_ebnf(options: list[str]) -> str:
    """The EBNF of "exactly one of these strings": an alternation of JSON-escaped string literals (xgrammar's EBNF
    escapes are JSON's). Shared with engines that take EBNF text (SGLang's ``ebnf`` sampling parameter)."""
    import json

    return "root ::= " + " | ".join(json.dumps(o) for o in options)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[16:00:19] /project/cpp/regex_converter.cc:83: "


def short_reason(e: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ file and line), first line only."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = _LOG_PREFIX.sub("", text).removeprefix("Check failed: (error.empty()) is false: ")
    return text if len(text) <= 240 else text[:237] + "..."
