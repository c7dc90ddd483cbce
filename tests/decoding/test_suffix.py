"""dspine.decoding.suffix: the n-gram index, its continuation, the stream's corpora, the cap."""

from __future__ import annotations

import random

import pytest

from dspine.decoding.suffix import MAX_SIBLINGS, PROMPT_TAIL, SuffixIndex, SuffixSource


def test_longest_match_wins_and_proposes_what_followed():
    ix = SuffixIndex(orders=(2, 4))
    ix.add([1, 2, 3, 9, 9])  # "2 3" -> 9
    ix.add([7, 1, 2, 3, 4, 5])  # "1 2 3" is not an order; "7 1 2 3"? no: the 4-gram "1 2 3 4"...
    s = ix.suggest([0, 7, 1, 2, 3], max_len=8)
    assert s is not None and s.match == 4 and s.tokens == [4, 5]  # stops at the document's end
    s = ix.suggest([5, 5, 2, 3], max_len=8)
    assert s.match == 2 and s.tokens == [4, 5]  # the most recent "2 3" is in the second document


def test_no_match_and_no_room():
    ix = SuffixIndex()
    ix.add([1, 2, 3])
    assert ix.suggest([4, 5]) is None
    assert ix.suggest([1, 2], max_len=0) is None
    assert SuffixIndex().suggest([1, 2, 3]) is None


def test_agreement_counts_repeated_continuations():
    ix = SuffixIndex(orders=(2,))
    for _ in range(3):
        ix.add([5, 6, 7])
    ix.add([5, 6, 8])
    s = ix.suggest([5, 6], max_len=1)
    assert s.tokens == [8]  # the most recent continuation
    assert s.counts == [4] and s.sames == [2]  # 4 occurrences, the next token repeated the previous twice


def test_open_document_continues_a_repetition_past_its_end():
    ix = SuffixIndex(orders=(2, 3))
    ix.open([4, 1, 2, 1, 2])
    s = ix.suggest(ix.text(), max_len=5, overlap=True)
    assert s.tokens == [1, 2, 1, 2, 1]  # the period copied forward, not one token
    ix.extend([1])
    assert ix.suggest(ix.text(), max_len=3, overlap=True).tokens == [2, 1, 2]
    assert ix.suggest([1, 2, 1], max_len=3).tokens == [2, 1]  # another row's context: the text ends here


def test_documents_never_run_into_each_other():
    ix = SuffixIndex(orders=(2,))
    ix.add([1, 2])
    ix.add([3, 4])
    assert ix.suggest([1, 2]) is None  # "1 2" ended its document: nothing followed it
    assert ix.suggest([9, 3]) is None


def test_cap_keeps_the_newest_documents():
    ix = SuffixIndex(orders=(2,), cap_tokens=100)
    for d in range(50):
        ix.add([1000 + d, 1000 + d, d])
    assert len(ix) <= 100
    assert ix.suggest([1049, 1049]).tokens == [49]  # newest kept
    assert ix.suggest([1000, 1000]) is None  # oldest dropped


def test_index_matches_a_brute_force_search():
    rng = random.Random(0)
    docs = [[rng.randrange(6) for _ in range(rng.randrange(3, 30))] for _ in range(20)]
    ix = SuffixIndex(orders=(2, 3, 4))
    for d in docs:
        ix.add(d)
    for _ in range(200):
        ctx = [rng.randrange(6) for _ in range(6)]
        s = ix.suggest(ctx, max_len=3)
        best = None  # (n, doc index, position): longest n, then the most recent occurrence
        for n in (4, 3, 2):
            for di, d in enumerate(docs):
                for p in range(n, len(d)):
                    if d[p - n : p] == ctx[-n:]:
                        best = (n, di, p)
            if best:
                break
        if best is None:
            assert s is None
        else:
            n, di, p = best
            assert s.match == n and s.tokens == docs[di][p : p + 3]


def test_source_reads_own_text_siblings_and_finished_rows():
    src = SuffixSource(cap_tokens=1000, max_len=4)
    prompt = [50, 51, 52, 53]
    src.start(0, prompt + [1, 2, 3, 4, 5])
    src.extend(0, [1, 2])
    assert src.suggest(0).tokens == [3, 4, 5, 1]  # quotes its prompt
    src.start(1, [60, 61])
    src.extend(1, [7, 7, 8, 9])
    src.start(2, [60, 61])  # a sibling of row 1
    src.extend(2, [7, 7])
    assert src.suggest(2).tokens == [8, 9]
    src.finish(1)
    src.finish(2)
    src.start(3, [99, 60, 61])  # another row ending with the same prompt tail: finished answers start alike
    assert src.suggest(3).tokens[:2] == [7, 7]
    assert src.memory()["finished_tokens"] > 0
    assert 1 not in src.rows and 2 not in src.rows


def test_siblings_read_are_bounded():
    src = SuffixSource()
    for k in range(MAX_SIBLINGS + 5):
        src.start(k, [1, 2, 3])
    src.extend(0, [7, 8, 9])  # the oldest sibling: beyond the MAX_SIBLINGS most recent ones a row reads
    src.extend(MAX_SIBLINGS + 4, [7])
    assert src.suggest(MAX_SIBLINGS + 4) is None
    src.extend(MAX_SIBLINGS, [7, 8, 6])  # a recent sibling
    assert src.suggest(MAX_SIBLINGS + 4).tokens == [8, 6]


def test_finished_index_keeps_the_prompt_tail_only():
    src = SuffixSource()
    src.start(0, list(range(100, 100 + 3 * PROMPT_TAIL)))
    src.extend(0, [1, 2, 3])
    src.finish(0)
    assert len(src.finished) == PROMPT_TAIL + 3


@pytest.mark.parametrize("orders", [(), (0, 2)])
def test_orders_are_positive(orders):
    with pytest.raises(ValueError):
        SuffixIndex(orders)
