"""The one stop-string cut: earliest stop wins, tokens end with the one that completed it, and finding that
token decodes a linear amount of text (not every prefix)."""

from __future__ import annotations

import pytest

from dspine_batch.engines.stop_strings import cut_at_stop


def letters(ids: list[int]) -> str:
    return "".join(chr(96 + t) for t in ids)


def utf8(ids: list[int]) -> str:  # one byte per token: a multi-byte character spans tokens
    return bytes(ids).decode("utf-8", errors="replace")


def brute_force(ids: list[int], s: str, decode) -> int:
    return next(k for k in range(1, len(ids) + 1) if s in decode(ids[:k]))


def test_earliest_stop_wins_and_tokens_end_with_it():
    ids = [1, 2, 3, 4, 5, 6]
    assert cut_at_stop(letters(ids), ids, ["e", "cd"], letters) == ("ab", [1, 2, 3, 4])
    assert cut_at_stop(letters(ids), ids, ["z"], letters) is None
    assert cut_at_stop(letters(ids), ids, [], letters) is None
    assert cut_at_stop(letters(ids), ids, ["a"], letters) == ("", [1])


@pytest.mark.parametrize("text, stop", [("caf\u00e9 au lait", "\u00e9"), ("x\u00e9\u00e9y", "\u00e9y"),
                                        ("\u4e2d\u6587 stop here", "stop"), ("ab\u00e9", "b\u00e9")])
def test_multibyte_characters_split_across_tokens(text, stop):
    ids = list(text.encode())
    got = cut_at_stop(utf8(ids), ids, [stop], utf8)
    assert got is not None
    assert got[0] == text[: text.find(stop)]
    assert len(got[1]) == brute_force(ids, stop, utf8)


def test_the_cut_decodes_a_linear_amount_of_text():
    decoded = {"tokens": 0}

    def counting(ids: list[int]) -> str:
        decoded["tokens"] += len(ids)
        return letters(ids)

    n = 4000
    ids = [1 + i % 20 for i in range(n)] + [25, 26]  # "yz" only at the very end
    text = letters(ids)
    assert cut_at_stop(text, ids, ["yz"], counting) == (text[:n], ids)
    assert decoded["tokens"] <= 3 * len(ids)  # every prefix would be ~n^2/2 = 8,000,000
