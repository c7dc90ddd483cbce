"""``Grammars`` keeps a bounded number of compiled grammars (least recently used dropped first): a job with a
schema or a forced tool call per row compiles one grammar per row, and an engine lives for the whole job."""

from __future__ import annotations

import xgrammar

from dspine.decoding import grammar
from dspine.decoding.grammar import Grammars


def _byte_grammars() -> Grammars:
    """Id i is byte i, id 0 the stop token (the tiny test models' vocabulary)."""
    words = ["</s>"] + [bytes([i]).decode("latin-1") for i in range(1, 256)]
    info = xgrammar.TokenizerInfo(words, vocab_type=xgrammar.VocabType.RAW, vocab_size=256, stop_token_ids=[0])
    return Grammars(info, lambda s: list(s.encode("latin-1")), 256)


def _accepts(g: Grammars, kind: str, spec: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and may end there."""
    m = g.get(kind, spec).matcher()
    return all(m.accept_token(b) for b in text.encode("latin-1")) and m.accept_token(0) and m.is_terminated()


def test_the_cache_stays_bounded_keeps_what_is_used_and_still_answers(monkeypatch):
    g = _byte_grammars()
    g.max_cached = 3
    compiled: list[str] = []
    real = g._compile
    monkeypatch.setattr(g, "_compile", lambda kind, spec: (compiled.append(spec), real(kind, spec))[1])
    specs = [f"a{i}[b-c]+" for i in range(12)]
    first = g.get("regex", specs[0])
    for spec in specs[1:]:
        g.get("regex", spec)
        assert len(g.cache) <= 3
        g.get("regex", specs[0])  # used again and again: the least recently used others go first
    assert g.get("regex", specs[0]) is first and compiled.count(specs[0]) == 1
    assert list(g.cache) == [("regex", specs[-2]), ("regex", specs[-1]), ("regex", specs[0])]
    # an evicted grammar is compiled again when asked for, and answers as before
    assert _accepts(g, "regex", specs[1], "a1bcb") and not _accepts(g, "regex", specs[1], "a2bcb")
    assert compiled.count(specs[1]) == 2 and len(g.cache) == 3
    assert _accepts(g, "choice", '["yes","no"]', "no") and not _accepts(g, "choice", '["yes","no"]', "maybe")


def test_the_default_bound_is_a_few_hundred():
    g = _byte_grammars()
    assert g.max_cached == grammar.MAX_CACHED_GRAMMARS and 64 <= g.max_cached <= 4096
