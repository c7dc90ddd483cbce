"""Live prices (``dspine.decoding.prices``): a round's price follows the job's own round times, a wrong calibration
is corrected by the job, stale prices are refreshed by bounded exploration, and no price changes a token."""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest
import torch
from helpers import token_prompts
from test_generate import _random_dspine, _repetitive_prompts

from dspine import generate
from dspine.decoding.cost import CostModel
from dspine.decoding.prices import EXPLORE_EVERY, LivePrices, StaticPrices
from dspine.decoding.schedule import DRAFT, PLAIN, SUFFIX, plan_packed

# calibrated: 10 ms a step, 1 ms per extra token, 2 ms a draft block
CAL = CostModel.flat(target_s=0.010, per_token_s=0.001, draft_s=0.002)


def _machine(R: int, k: int) -> float:
    """The 'real' cost of a round on an imaginary machine: 30 ms base, a verify 6 ms more, 2 ms per token."""
    return 0.030 + (0.006 + 0.002 * k if k else 0.0)


def test_prices_follow_the_job_not_the_calibration():
    prices = LivePrices(CAL, packed=True)
    rng = random.Random(0)
    for i in range(200):
        k = [0, 0, 3, 8, 1][i % 5]
        prices.observe(8, k, _machine(8, k) * rng.uniform(0.97, 1.03))
    for k in (0, 1, 4, 8, 16):
        assert prices.round_s(8, k) == pytest.approx(_machine(8, k), rel=0.06)
    assert prices.round_many(8, np.array([2, 8])).tolist() == pytest.approx([_machine(8, 2), _machine(8, 8)],
                                                                               rel=0.06)
    # a row count never timed starts from the calibration at the job's observed scale (~2x the calibration)
    assert prices.round_s(4, 0) == pytest.approx(CAL.target_s(4, 1) * prices.ratio, rel=1e-6)
    assert 1.2 < prices.ratio < 4.0
    s = prices.summary()["rows"][8]
    assert s["plain_ms"] == pytest.approx(30, rel=0.06) and s["token_ms"] == pytest.approx(2, rel=0.2)


def test_surcharges_never_negative_and_the_machine_getting_busier_moves_prices():
    prices = LivePrices(CAL, packed=True)
    for i in range(100):  # noise that says wider verifies are cheaper: read as no slope at all
        prices.observe(8, [0, 4, 12][i % 3], [0.030, 0.040, 0.035][i % 3])
    assert prices.round_s(8, 40) >= prices.round_s(8, 4) >= prices.round_s(8, 0)
    before = prices.round_s(8, 0)
    for i in range(120):  # a neighbour starts: everything takes twice as long
        prices.observe(8, [0, 4][i % 2], 2 * [0.030, 0.040][i % 2])
    assert prices.round_s(8, 0) == pytest.approx(2 * 0.030, rel=0.1) and prices.round_s(8, 0) > 1.5 * before


def test_a_wrong_calibration_is_corrected_and_exploration_is_bounded():
    slow = CostModel.flat(target_s=2.0, per_token_s=0.5, draft_s=1.0)  # a calibration taken beside a busy neighbour
    prices = LivePrices(slow, packed=True)
    verifies = 0
    for _ in range(4 * EXPLORE_EVERY):  # a planner that always verifies: a plain step is forced every so often
        if prices.plain_due(8):
            prices.observe(8, 0, _machine(8, 0))
        else:
            verifies += 1
            prices.observe(8, 6, _machine(8, 6))
    assert verifies >= 4 * EXPLORE_EVERY - 5
    assert prices.round_s(8, 0) == pytest.approx(_machine(8, 0), rel=0.15)
    assert prices.round_s(8, 6) == pytest.approx(_machine(8, 6), rel=0.15)
    # and the other way round: a verify may be explored once per EXPLORE_EVERY plain rounds, not more
    quiet = LivePrices(CAL, packed=True)
    due = 0
    for _ in range(3 * EXPLORE_EVERY):
        if quiet.explore_due(8):
            due += 1
            quiet.observe(8, 4, _machine(8, 4))
        else:
            quiet.observe(8, 0, _machine(8, 0))
    assert 1 <= due <= 3
    # the draft's price follows its timed proposals
    for _ in range(50):
        prices.observe(8, 4, _machine(8, 4) + 0.004, draft_block=3, draft_seconds=0.004)
    assert prices.draft_s(8, 3) == pytest.approx(0.004, rel=0.1)


def _static(target_s: float, per_token_s: float, draft_s: float = 1e6) -> StaticPrices:
    return StaticPrices(CostModel.flat(target_s=target_s, per_token_s=per_token_s, draft_s=draft_s), packed=True)


def test_packed_plan_each_row_pays_its_own_tokens():
    a = torch.zeros(8, 4)
    a[2] = torch.tensor([0.95, 0.9, 0.85, 0.8])  # one row with a strong suffix proposal, the rest none
    live = torch.ones(8, dtype=torch.bool)
    greedy = torch.ones(8, dtype=torch.bool)
    # each extra token costs 1 % of a step: the strong row verifies its whole proposal, the others step plainly
    pl = plan_packed(None, a, greedy, live, _static(1.0, 0.01))
    assert pl.ell.tolist() == [0, 0, 4, 0, 0, 0, 0, 0]
    assert pl.source.tolist() == [PLAIN, PLAIN, SUFFIX] + [PLAIN] * 5 and pl.draft_block == 0
    # each extra token costs what a row's share of a step costs: a token must be certain to pay, none is
    pl = plan_packed(None, a, greedy, live, _static(1e-9, 1.0))
    assert pl.ell.tolist() == [0] * 8
    # a finished row kept in its slot never verifies, whatever its survival says
    dead = live.clone()
    dead[2] = False
    assert plan_packed(None, a, greedy, dead, _static(1.0, 0.01)).ell.tolist() == [0] * 8


def test_packed_plan_takes_the_draft_for_greedy_rows_only_when_it_pays():
    a_sfx = torch.zeros(4, 3)
    a_draft = torch.full((4, 2), 0.9)
    live = torch.ones(4, dtype=torch.bool)
    greedy = torch.tensor([True, True, False, True])
    pl = plan_packed(a_draft, a_sfx, greedy, live, _static(1.0, 0.01, draft_s=0.05))
    assert pl.source.tolist() == [DRAFT, DRAFT, PLAIN, DRAFT] and pl.draft_block == 3
    assert plan_packed(a_draft, a_sfx, greedy, live, _static(1.0, 0.01, draft_s=5.0)).draft_block == 0


class _RandomPrices(StaticPrices):
    """Prices that say something different every round: a planner reading them chooses at random."""

    def __init__(self, seed: int, packed: bool):
        super().__init__(CostModel.flat(1.0, 0.1, 0.1), packed)
        self.rng = random.Random(seed)

    def round_s(self, R, k):
        return self.rng.uniform(0.5, 2.0) * (1 + 0.01 * k)

    def round_many(self, R, ks):
        return np.array([self.round_s(R, float(k)) for k in np.asarray(ks).tolist()])

    def draft_s(self, R, block):
        return self.rng.uniform(0.0, 1.0) if block > 1 else 0.0


@pytest.mark.parametrize("target_name", ["llama", "hybrid"])
def test_no_price_changes_a_token(target_name, llama_target, hybrid_target):
    """Greedy and sampled rows (and rows joining freed slots) under auto: whatever the prices say — live ones
    timed on this machine, two fixed opposite ones, prices drawn at random every round — every output is plain
    decoding's, token for token: prices only choose between choices whose tokens are identical."""
    target = {"llama": llama_target, "hybrid": hybrid_target}[target_name]
    prompts = _repetitive_prompts(target, 5, seed=12) + token_prompts(3, target.vocab_size, seed=13)
    kw = dict(max_new_tokens=[20, 9, 24, 15, 20, 4, 18, 22], temperature=[0.8, 0.0, 0.0, 1.0, 0.6, 0.0, 0.9, 0.0],
              seed=list(range(30, 38)), top_p=0.95)
    plain = generate(target, None, prompts, **kw)
    want = [p.token_ids for p in plain]
    draft = _random_dspine(target, 4, seed=4)
    cheap, dear = _static(1.0, 0.001, 0.01), _static(1.0, 10.0, 10.0)
    schedules = {}
    for name, prices in [("live", "live"), ("cheap", cheap), ("dear", dear),
                         ("random1", _RandomPrices(1, target.packs)), ("random2", _RandomPrices(2, target.packs))]:
        if isinstance(prices, StaticPrices):
            prices.packed = target.packs
        spec = generate(target, draft, prompts, verify="cost", cost=CAL, proposers="auto", batch_size=3,
                        prices=prices, **kw)
        assert [s.token_ids for s in spec] == want
        assert [s.finish_reason for s in spec] == [p.finish_reason for p in plain]
        schedules[name] = tuple((s.stats.verify_steps, s.stats.draft_tokens_proposed, s.stats.dspine_steps,
                                 s.stats.suffix_steps) for s in spec)
    # not vacuous: proposals were verified under cheap prices, (almost) none under dear ones, and the
    # prices made different schedules of the same tokens
    verified = {name: sum(v for v, *_ in sched) for name, sched in schedules.items()}
    assert verified["cheap"] > 0 and verified["cheap"] > 2 * verified["dear"], verified
    assert len(set(schedules.values())) >= 3


@pytest.mark.parametrize("target_name", ["llama", "hybrid"])
def test_a_draft_that_never_pays_is_retired_and_changes_no_token(target_name, llama_target, hybrid_target,
                                                                  monkeypatch):
    """Priced out round after round, the draft is retired (its context no longer kept, rows admitted afterwards
    prefilled without one); the stream goes on with suffix proposals and plain steps, every output plain
    decoding's, and the decisions say when and why."""
    from dspine.decoding import decode, rounds
    from dspine.decoding.decode import decode_stream
    from dspine.decoding.sampling import SamplingParams

    monkeypatch.setattr(rounds, "RETIRE_ROUNDS", 4)
    # retired mid-stream here, by what its rounds showed (before the prefill: test_auto_quiet)
    monkeypatch.setattr(decode, "draft_cannot_pay", lambda cfg, R: False)
    target = {"llama": llama_target, "hybrid": hybrid_target}[target_name]
    prompts = _repetitive_prompts(target, 4, seed=21) + token_prompts(4, target.vocab_size, seed=22)
    temps = [0.0, 0.7, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0]
    kw = dict(max_new_tokens=[18, 12, 25, 9, 16, 22, 11, 20], temperature=temps, seed=list(range(50, 58)))
    want = [p.token_ids for p in generate(target, None, prompts, **kw)]
    draft = _random_dspine(target, 4, seed=5)
    dear = _static(1.0, 0.5, 50.0)  # a draft block costs 50 plain steps: it never pays
    dear.packed = target.packs
    params = [SamplingParams(n, t, seed=s) for n, t, s in zip(kw["max_new_tokens"], temps, kw["seed"])]
    decisions: dict = {}
    weights = [weakref.ref(t) for t in [*draft.parameters(), *draft.buffers()] if t.numel() > 1000]
    assert weights and not draft.released
    got = dict(decode_stream(target, draft, zip(prompts, params), batch_size=3, verify="cost", cost=CAL,
                             proposers="auto", prices=dear, decisions=decisions, release_retired=True))
    assert [got[i].token_ids for i in range(len(prompts))] == want
    assert decisions["dspine"]["why"].startswith("retired after round"), decisions["dspine"]
    assert decisions["dspine"]["rounds"] == 0
    # retired, its memory goes with its context: every weight freed (shapes kept for the bookkeeping)
    gc.collect()
    assert draft.released and all(ref() is None for ref in weights)
    assert all(t.is_meta for t in [*draft.parameters(), *draft.buffers()])


def test_suffix_estimates_are_calibrated_by_what_the_job_keeps():
    from dspine.decoding.acceptance import CALIBRATION_RANGE, JobAcceptance

    job = JobAcceptance(0.5, 3)
    assert job.suffix_scale() == 1.0
    for _ in range(40):  # estimates that expect 3 tokens kept where 1 is
        job.observe_suffix_estimate(3.0, 1.0)
    assert 0.3 < job.suffix_scale() < 0.4
    for _ in range(400):  # and later twice what they expect: the scale follows, within its bounds
        job.observe_suffix_estimate(1.0, 3.0)
    assert job.suffix_scale() == CALIBRATION_RANGE[1]


def test_quiet_stretches_skip_the_planning_and_change_no_token(llama_target, monkeypatch):
    """Once rounds in a row verify nothing, most rounds are plain steps nobody plans (``rounds._quiet_round``);
    greedy and sampled rows keep plain decoding's tokens."""
    from dspine.decoding import rounds

    calls = []
    quiet = rounds._quiet_round
    monkeypatch.setattr(rounds, "_quiet_round", lambda *a: calls.append(1) or quiet(*a))
    prompts = token_prompts(5, llama_target.vocab_size, seed=31)
    kw = dict(max_new_tokens=[30, 24, 28, 12, 30], temperature=[0.0, 0.8, 0.0, 1.0, 0.0], seed=list(range(5)))
    want = [p.token_ids for p in generate(llama_target, None, prompts, **kw)]
    dear = _static(1.0, 10.0)  # no proposal ever pays
    dear.packed = llama_target.packs
    got = generate(llama_target, None, prompts, verify="cost", cost=CAL, proposers="suffix", batch_size=3,
                   prices=dear, **kw)
    assert [g.token_ids for g in got] == want
    assert len(calls) > 10
