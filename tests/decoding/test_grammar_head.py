"""One bitmask fill per grammar row and round (issue 44): the forced-token look-ahead (``grammar.forced``) and the
verify's slot-0 mask (``grammar.walk``) read the same matcher state, so the row fills that state's mask once
(``RowState.head``), kept until the row commits. The masks are the ones a fresh fill gives, at every state."""

from __future__ import annotations

import json

import torch
from test_structured import SCHEMA, byte_grammars

from dspine.decoding.grammar import forced, walk
from dspine.decoding.processors import RowState
from dspine.decoding.sampling import SamplingParams


class CountingMatcher:
    """An xgrammar matcher, counting its bitmask fills."""

    def __init__(self, inner) -> None:
        self.inner, self.fills = inner, 0

    def fill_next_token_bitmask(self, *a, **k):
        self.fills += 1
        return self.inner.fill_next_token_bitmask(*a, **k)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_one_fill_per_state_and_the_same_masks_as_fresh_fills():
    grammars = byte_grammars()
    g = grammars.get("json_schema", json.dumps(SCHEMA))
    sp = SamplingParams(grammar=g)
    st = RowState.of(sp, [1, 2, 3], 256)
    st.matcher = CountingMatcher(st.matcher)
    ref = CountingMatcher(g.matcher())  # the same text, every mask filled fresh (no head)
    text = list(json.dumps({"kind": "beta", "ok": True, "tags": ["x"]}, separators=(", ", ": ")).encode())
    saved = []
    for k, t in enumerate(text):
        limit = 0 if k % 3 == 0 else 4
        before, ref_before = st.matcher.fills, ref.fills
        toks, _ = forced(st.matcher, g.encode, 256, limit, st.head)
        masks, taken = walk(st.matcher, [t], 256, st.head)
        ref_toks, _ = forced(ref, g.encode, 256, limit)
        ref_masks, ref_taken = walk(ref, [t], 256)
        assert (toks, taken) == (ref_toks, ref_taken) and torch.equal(masks, ref_masks), k  # the same masks
        saved.append((ref.fills - ref_before) - (st.matcher.fills - before))
        assert saved[-1] in (0, 1), k  # at most the one shared state's fill, never an extra one
        fills = st.matcher.fills
        st.head()  # no second fill at the same state
        assert st.matcher.fills == fills
        st.commit([t])
        assert ref.accept_token(t)
    assert sum(saved) >= 3  # where nothing is forced as a string, a look-ahead and a verify share one fill
    # a walk alone (no look-ahead this round) fills the head once, and a second walk at the state does not
    st2 = RowState.of(sp, [1], 256)
    st2.matcher = CountingMatcher(st2.matcher)
    walk(st2.matcher, [], 256, st2.head)
    walk(st2.matcher, [], 256, st2.head)
    assert st2.matcher.fills == 1


def test_a_greedy_slot_whose_argmax_the_grammar_allows_is_not_masked_and_decides_the_same():
    """``processors.needs_mask``: greedy slots feed an argmax only, so where the unmasked argmax is allowed the
    mask is skipped (same token); a greedy slot whose argmax the grammar refuses, and every sampled slot, are masked
    exactly as a full mask would; ties at the maximum resolve to the same (first) id either way."""
    from dspine.decoding import processors
    from dspine.decoding.grammar import apply_masks

    g = byte_grammars().get("json_schema", json.dumps(SCHEMA))
    greedy, sampled = SamplingParams(grammar=g), SamplingParams(temperature=0.8, grammar=g)
    gen = torch.Generator().manual_seed(3)
    allowed_first = ord("{")  # the only byte a JSON object may start with
    for trial in range(40):
        states = [RowState.of(sp, [1, 2], 256) for sp in (greedy, greedy, sampled)]
        logits = torch.randn(3, 256, generator=gen)
        if trial % 2:
            logits[0, allowed_first] = logits[0].max() + 1  # row 0's argmax allowed: skipped
        if trial % 4 == 1:
            logits[0, 7] = logits[0, allowed_first]  # a refused tie at a lower id: the argmax refused, masked
        want = logits.clone()
        masks = torch.stack([walk(st.matcher, [], 256, st.head)[0][0] for st in states])
        apply_masks(want, masks, [0, 1, 2])
        got = processors.process(logits.clone(), states, [0, 1, 2], [0, 0, 0], None)
        assert torch.equal(got.argmax(-1)[:2], want.argmax(-1)[:2]), trial  # greedy: the same token
        assert torch.equal(got[2], want[2]), trial  # sampled: the whole masked distribution
        need = processors.needs_mask(logits, masks, [0, 1, 2], [True, True, False])
        skipped = {0, 1, 2} - set(need.tolist() if need is not None else [])
        for i in skipped:  # a skipped slot is one whose unmasked argmax the grammar allows, left untouched
            assert int(logits[i].argmax()) == allowed_first and torch.equal(got[i], logits[i])
        assert 2 not in skipped
        assert (0 in skipped) == (trial % 4 == 3), trial
