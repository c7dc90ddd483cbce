"""The SGLang worker's suffix proposer (``dspine.sglang.suffix``) on stand-in ``Req`` objects: the rows' text
follows the scheduler's ``output_ids``, finished requests feed the shared index, the source choice per mode, the
per-round log, and the device alignment of an offer with the tokens the host has not seen yet (overlap
scheduling). Needs no SGLang (the end-to-end runs are in test_sglang_e2e.py)."""

from __future__ import annotations

import json
from array import array

import pytest
import torch

from dspine.sglang.rounds import Tails, unseen_tokens
from dspine.sglang.suffix import SuffixProposer, align, parse_mode


class FakeReq:
    def __init__(self, rid, prompt, out=()):
        self.rid, self.origin_input_ids, self.output_ids = rid, list(prompt), array("q", out)
        self.done = False

    def finished(self):
        return self.done


def test_modes():
    assert parse_mode(None) == "dspine" and parse_mode(" Auto ") == "auto"
    assert not SuffixProposer("dspine", 3).active and SuffixProposer("suffix", 3).active
    with pytest.raises(ValueError, match="expected one of"):
        parse_mode("ngram")


def test_a_finished_request_feeds_the_next_one_with_the_same_prompt(tmp_path):
    log = tmp_path / "rounds.jsonl"
    sp = SuffixProposer("suffix", 3, log_path=str(log))
    a = FakeReq("a", [1, 2, 3], [10])
    assert sp.choose([a]) == [None]  # nothing seen yet
    sp.record([a], [0], [0])
    a.output_ids.extend([11, 12, 13, 14, 15])
    a.done = True
    b = FakeReq("b", [1, 2, 3], [10])
    assert sp.choose([b]) == [[11, 12, 13, 14, 15]]  # a's continuation (a left the batch finished), up to reach 7
    sp.record([b], [3], [2])
    assert "a" not in sp.rows and sp.rows["b"].sfx_hits == 2 and sp.rows["b"].sfx_trials == 3
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert recs[1] == {"rid": ["b"], "source": ["suffix"], "proposed": [3], "accepted": [2]}
    assert recs[0]["source"] == ["dspine"]
    assert sp.rows["b"].req.customized_info["dspine_source_counts"].pending == {"suffix": [1, 3, 2]}


def test_auto_weighs_the_match_against_the_drafts_record():
    sp = SuffixProposer("auto", 3)
    r = FakeReq("r", [5, 6, 7, 8, 5, 6, 7], [8])
    assert sp.choose([r]) == [None]  # a fresh match (one occurrence) loses to the draft's prior
    sp.record([r], [0], [0])  # the draft accepts nothing
    assert sp.choose([r])[0][:3] == [5, 6, 7]
    sp.record([r], [3], [0])  # nor does the match
    assert sp.choose([r]) == [None]
    sp.record([r], [0], [0])
    assert sp.rows["r"].draft_rounds == 2 and sp.rows["r"].sfx_trials == 1 and sp.rows["r"].sfx_hits == 0


def test_auto_leaves_sampled_rows_to_the_draft():
    sp = SuffixProposer("auto", 3)
    r = FakeReq("r", [5, 6, 7, 8, 5, 6, 7], [8])
    sp.choose([r], [False])
    sp.record([r], [0], [0])
    assert sp.choose([r], [False]) == [None]  # the greedy row of the same record would take the match
    sp.record([r], [0], [0])
    assert sp.choose([r], [True])[0][:3] == [5, 6, 7]
    assert SuffixProposer("suffix", 3).choose([FakeReq("s", [1, 2, 1], [2])], [False])[0][:3] == [1, 2, 1]


def test_a_reset_request_restarts_its_text():
    sp = SuffixProposer("suffix", 2)
    r = FakeReq("r", [1, 2], [3, 4, 5])
    sp.choose([r])
    r.output_ids = array("q", [3])  # retracted and re-run
    sp.choose([r])
    assert sp.src.rows["r"].index.text() == [1, 2, 3]


def _align(offer, known, committed, tail, width=3):
    reach = 2 * width + 1
    offered = torch.tensor([offer + [-1] * (reach - len(offer))])
    tails = Tails(4, width + 1, "cpu")
    pool = torch.tensor([2])
    tails.record(pool, torch.tensor([tail + [0] * (width + 1 - len(tail))]), torch.tensor([len(tail)]))
    t, tl = tails.of(pool)
    m, ok = unseen_tokens(torch.tensor([committed]), torch.tensor([known]), t, tl)
    tokens, n = align(offered, torch.tensor([len(offer)]), m, ok, t, tl, width)
    return tokens[0, : int(n[0])].tolist()


def test_an_offer_is_aligned_on_the_device_with_the_tokens_the_host_has_not_seen():
    """The host offers a continuation of the text it knows; under overlap scheduling the last round's commit (the
    anchor last) is not in it yet. The proposal is what follows those tokens, where the offer starts with them."""
    assert _align([7, 8, 9, 1], known=10, committed=10, tail=[6]) == [7, 8, 9]  # host up to date
    assert _align([7, 8, 9, 1, 2], known=10, committed=12, tail=[3, 7, 8]) == [9, 1, 2]  # 7, 8 unseen: skipped
    assert _align([7, 8, 9], known=10, committed=12, tail=[7, 8]) == [9]  # an offer ending early: what is left
    assert _align([7, 5, 9, 1, 2], known=10, committed=12, tail=[7, 8]) == []  # the unseen tokens differ: no match
    assert _align([7, 8, 9, 1], known=10, committed=14, tail=[7, 8]) == []  # more unseen than recorded: no match
    assert _align([7, 8, 9], known=10, committed=13, tail=[7, 8, 9]) == []  # nothing left after them


def test_a_round_sglang_drops_is_not_counted(tmp_path):
    """Under overlap scheduling a finished (or retracted) row runs one more round whose tokens SGLang drops and
    does not count: neither do the per-source counts and the round log."""
    log = tmp_path / "rounds.jsonl"
    sp = SuffixProposer("suffix", 3, log_path=str(log))
    a, b = FakeReq("a", [1, 2, 3], [10]), FakeReq("b", [4, 5], [6])
    sp.choose([a, b])
    a.done = True
    sp.record([a, b], [0, 0], [2, 1])
    assert json.loads(log.read_text()) == {"rid": ["b"], "source": ["dspine"], "proposed": [3], "accepted": [1]}
    assert sp.rows["b"].draft_rounds == 1 and sp.rows["a"].draft_rounds == 0
