"""Cost-aware choice of ℓ: stopping-time form, the sampled rows' rule is a function of the row alone, history."""

from __future__ import annotations

import torch

from dspine.decoding.cost import CostModel, Grid
from dspine.decoding.prices import StaticPrices
from dspine.decoding.schedule import DRAFT, PLAIN, SUFFIX, History, plan, plan_sources, row_rule

# target: 1 s + 0.2 s per extra verified token, whatever the rows; draft 0.2 s
ROWLESS = CostModel(Grid((1, 2), (1, 4), ((1.0, 1.6), (1.0, 1.6))), Grid((1, 2), (2, 4), ((0.2, 0.2), (0.2, 0.2))))


def test_row_rule_stops_at_the_first_non_improvement():
    a = torch.tensor([[0.9, 0.81, 0.729], [0.1, 0.01, 0.001], [0.9, 0.05, 0.9]])
    ell = row_rule(a, ROWLESS, nominal_rows=4)
    # high survival: verify all; low: plain step; a dip: stop before it even though a later slot looks good
    assert ell.tolist() == [3, 0, 1]


def test_sampled_rows_choice_ignores_the_other_rows():
    a = torch.tensor([[0.7, 0.4, 0.1], [0.95, 0.9, 0.85], [0.05, 0.0, 0.0]])
    greedy = torch.tensor([False, True, True])
    alone = plan(a[:1], greedy[:1], ROWLESS, nominal_rows=4)
    for others in ([1], [2], [1, 2]):
        idx = [0, *others]
        assert plan(a[idx], greedy[idx], ROWLESS, nominal_rows=4)[0] == alone[0]


def test_greedy_rows_share_the_widest_worthwhile_block():
    greedy = torch.tensor([True, True])
    hi = torch.tensor([[0.95, 0.9, 0.85], [0.9, 0.8, 0.7]])
    lo = torch.tensor([[0.1, 0.01, 0.001], [0.05, 0.0, 0.0]])
    assert plan(hi, greedy, ROWLESS, 4).tolist() == [3, 3]
    assert plan(lo, greedy, ROWLESS, 4).tolist() == [0, 0]
    cap = torch.tensor([1, 3])  # a row cannot verify more than it has
    assert plan(hi, greedy, ROWLESS, 4, cap=cap).tolist() == [1, 3]
    # a draft that costs more than it can return is never run
    dear = CostModel(ROWLESS.target, Grid((1, 2), (2, 4), ((50.0, 50.0), (50.0, 50.0))))
    assert plan(hi, greedy, dear, 4).tolist() == [0, 0]


def test_history_learns_forgets_and_follows_rows():
    h = History.empty(2, 3)
    prior = h.survival()[0].clone()
    for _ in range(10):
        h.update(torch.tensor([3, 3]), torch.tensor([3, 0]))  # row 0 accepts everything, row 1 nothing
    s = h.survival()
    assert (s[0] > prior).all() and (s[1] < prior).all()
    assert float(s[1, 0]) < 0.3
    low = float(s[1, 0])
    for _ in range(20):
        h.update(torch.tensor([0, 0]), torch.tensor([0, 0]))  # plain steps: the evidence fades toward the prior
    assert low < float(h.survival()[1, 0]) <= float(prior[0])
    sel = h.select([1])
    assert torch.equal(sel.trials, h.trials[1:])
    h.assign([0], History.empty(1, 3))
    assert torch.allclose(h.survival()[0], prior)


def test_sampled_rows_pay_their_own_draft_block_not_the_batch_widest():
    """After drafting, a sampled row's ℓ uses the block it chose itself, so a wider neighbour cannot move it."""
    # draft time grows with the block: 0.1 s at 2, 0.7 s at 4
    cost = CostModel(ROWLESS.target, Grid((1, 2), (2, 4), ((0.1, 0.7), (0.1, 0.7))))
    a = torch.tensor([[0.15, 0.05, 0.01], [0.99, 0.98, 0.97]])
    mine = plan(a[:1], torch.tensor([False]), cost, 4, cap=torch.tensor([1]), sunk_block=2,
                row_blocks=torch.tensor([2]))
    both = plan(a, torch.tensor([False, True]), cost, 4, cap=torch.tensor([1, 3]), sunk_block=4,
                row_blocks=torch.tensor([2, 4]))
    assert both.tolist() == [int(mine[0]), 3]
    # the sunk draft time does matter: had the row itself drafted a block of 4, one check would pay
    assert mine.tolist() == [0]
    assert plan(a[:1], torch.tensor([False]), cost, 4, cap=torch.tensor([1]), row_blocks=torch.tensor([4])) == 1


def test_history_prior_is_the_rate_before_evidence_and_survives_select_and_concat():
    h = History.empty(2, 3, prior=0.2)
    assert torch.allclose(h.survival(), torch.tensor([0.2, 0.04, 0.008]).expand(2, 3))
    assert History.empty(1, 3).prior == 0.6  # the library default when a draft ships none
    joined = History.concat([h.select([0]), History.empty(1, 3, prior=0.2)])
    assert joined.prior == 0.2 and joined.trials.shape == (2, 3)
    # evidence moves the estimate away from the prior: 3 hits in 3 trials of slot 0
    joined.update(torch.tensor([1, 0]), torch.tensor([1, 0]))
    joined.update(torch.tensor([1, 0]), torch.tensor([1, 0]))
    joined.update(torch.tensor([1, 0]), torch.tensor([1, 0]))
    a = joined.survival()
    assert a[0, 0] > 0.5 and abs(float(a[1, 0]) - 0.2) < 1e-6


def test_decode_json_accept_prior_is_checked(tmp_path):
    import json

    import pytest

    from dspine.draft.io import read_decode_defaults
    from dspine.models.checkpoint import ModelLoadError

    (tmp_path / "decode.json").write_text(json.dumps({"accept_prior": 0.35, "block_size": 3}))
    assert read_decode_defaults(tmp_path) == {"accept_prior": 0.35, "block_size": 3}
    (tmp_path / "decode.json").write_text(json.dumps({"accept_prior": 1.5}))
    with pytest.raises(ModelLoadError, match="accept_prior must be a number in"):
        read_decode_defaults(tmp_path)


def _suffix_only(rows_secs: tuple[float, float]) -> CostModel:
    """1 and 8 rows; a verify of 1 token costs rows_secs[0], of 4 tokens rows_secs[1] (seconds, whatever the rows)."""
    t = Grid((1, 8), (1, 4), (rows_secs, rows_secs))
    return CostModel(t, Grid((1, 8), (2, 4), ((0.2, 0.2), (0.2, 0.2))))


def test_sampled_rows_width_is_paid_by_the_whole_batch():
    # 8 sampled rows (--num-samples siblings); one holds a strong suffix proposal, the others none
    a = torch.zeros(8, 3)
    a[0] = torch.tensor([0.9, 0.8, 0.7])
    sampled = torch.zeros(8, dtype=torch.bool)
    # a 4-token verify costs 2x a step for all 8 rows: 8 + 2.4 tokens in 2 s is worse than 8 tokens in 1 s
    pl = plan_sources(None, a, sampled, StaticPrices(_suffix_only((1.0, 2.0))))
    assert pl.ell.tolist() == [0] * 8 and pl.source.tolist() == [PLAIN] * 8
    # a nearly free width pays: the proposing row verifies it, the others take their plain token in the same forward
    pl = plan_sources(None, a, sampled, StaticPrices(_suffix_only((1.0, 1.1))))
    assert pl.ell.tolist() == [3] + [0] * 7 and pl.source.tolist() == [SUFFIX] + [PLAIN] * 7


def test_sampled_rows_never_take_the_draft_and_nothing_to_propose_is_a_plain_step():
    a_sfx = torch.zeros(2, 3)
    a_draft = torch.full((2, 3), 0.95)
    greedy = torch.tensor([True, False])
    pl = plan_sources(a_draft, a_sfx, greedy, StaticPrices(_suffix_only((1.0, 1.1))))
    assert pl.source.tolist() == [DRAFT, PLAIN] and pl.ell[1] == 0 and pl.draft_block > 0
    pl = plan_sources(a_draft, a_sfx, torch.tensor([False, False]), StaticPrices(_suffix_only((1.0, 1.1))))
    assert pl.ell.tolist() == [0, 0] and pl.draft_block == 0
