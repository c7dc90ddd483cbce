"""The SGLang worker's suffix proposer (``dspine.sglang.suffix``) on stand-in ``Req`` objects: the rows' text
follows the scheduler's ``output_ids``, finished requests feed the shared index, the source choice per mode and
the per-round log. Needs no SGLang (the end-to-end runs are in test_sglang_e2e.py)."""

from __future__ import annotations

import json
from array import array

import pytest

from dspine.sglang.suffix import SuffixProposer, parse_mode


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
    assert sp.choose([a], [10]) == [None]  # nothing seen yet
    sp.record([0])
    a.output_ids.extend([11, 12, 13, 14, 15])
    a.done = True
    b = FakeReq("b", [1, 2, 3], [10])
    assert sp.choose([b], [10]) == [[11, 12, 13]]  # a's continuation (a left the batch finished)
    sp.record([2])
    assert "a" not in sp.rows and sp.rows["b"].sfx_hits == 2 and sp.rows["b"].sfx_trials == 3
    assert sp.choose([b], [99]) == [None]  # output_ids lag the anchor: the draft's block
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert recs[1] == {"rid": ["b"], "source": ["suffix"], "proposed": [3], "accepted": [2]}
    assert recs[0]["source"] == ["dspine"]


def test_auto_weighs_the_match_against_the_drafts_record():
    sp = SuffixProposer("auto", 3)
    r = FakeReq("r", [5, 6, 7, 8, 5, 6, 7], [8])
    assert sp.choose([r], [8]) == [None]  # a fresh match (one occurrence) loses to the draft's prior
    sp.record([0])  # the draft accepts nothing
    assert sp.choose([r], [8]) == [[5, 6, 7]]
    sp.record([0])  # nor does the match
    assert sp.choose([r], [8]) == [None]
    sp.record([0])
    sp.record([3])  # no round pending: ignored
    assert sp.rows["r"].draft_rounds == 2 and sp.rows["r"].sfx_trials == 1 and sp.rows["r"].sfx_hits == 0


def test_auto_leaves_sampled_rows_to_the_draft():
    sp = SuffixProposer("auto", 3)
    r = FakeReq("r", [5, 6, 7, 8, 5, 6, 7], [8])
    sp.choose([r], [8], [False])
    sp.record([0])
    assert sp.choose([r], [8], [False]) == [None]  # the greedy row of the same record would take the match
    sp.record([0])
    assert sp.choose([r], [8], [True]) == [[5, 6, 7]]
    assert SuffixProposer("suffix", 3).choose([FakeReq("s", [1, 2, 1], [2])], [2], [False]) == [[1, 2, 1]]


def test_a_reset_request_restarts_its_text():
    sp = SuffixProposer("suffix", 2)
    r = FakeReq("r", [1, 2], [3, 4, 5])
    sp.choose([r], [5])
    r.output_ids = array("q", [3])  # retracted and re-run
    sp.choose([r], [3])
    assert sp.src.rows["r"].index.text() == [1, 2, 3]
