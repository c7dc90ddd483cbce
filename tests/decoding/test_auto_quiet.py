"""``auto`` when it does not speculate (issue 44, item 1): a row that proposes nothing runs the plain round plain
decoding runs (same forwards, same sampling path), suffix lookups are made only for rows whose text could match
(and skipping the others changes no token), the suffix index is fed only where a lookup will read it, and the time
spent looking is priced apart from the forward."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import random_dspine, token_prompts
from test_generate import _repetitive_prompts

from dspine import generate
from dspine.decoding import commit, prefill, rounds
from dspine.decoding import decode as decode_mod
from dspine.decoding.acceptance import AGREEMENT_WEIGHT, row_suffix_rate, suffix_survival
from dspine.decoding.cost import CostModel
from dspine.decoding.decode import decode_stream
from dspine.decoding.prefix import PrefixCache
from dspine.decoding.prices import LivePrices, StaticPrices
from dspine.decoding.rows import Row
from dspine.decoding.sampling import SamplingParams
from dspine.decoding.suffix import SuffixSource

CAL = CostModel.flat(target_s=0.010, per_token_s=0.001, draft_s=0.002)


def _dear(target) -> StaticPrices:
    """Prices under which no proposal ever pays: a round costs its tokens and nothing else, so a verified token pays
    only if it is surely kept (survival 1), and then only level with a plain step, which a tie keeps."""
    return StaticPrices(CostModel.flat(target_s=0.0, per_token_s=10.0, draft_s=1e6), packed=target.packs)


class _Recorder:
    """What the rounds ask of the target and the sampling head: per forward (ids shape, whether rows are packed,
    speculative, taps), per head call the hidden shape, per first-token sampling the rows and their params."""

    def __init__(self, target, monkeypatch):
        self.calls: list[tuple] = []
        fwd, logits, first = target.forward, target.logits, commit.sample_first

        def forward(ids, cache, n_valid=None, speculative=False, taps=()):
            self.calls.append(("forward", tuple(ids.shape), n_valid is None, speculative, tuple(taps)))
            return fwd(ids, cache, n_valid=n_valid, speculative=speculative, taps=taps)

        def head(hidden):
            self.calls.append(("logits", tuple(hidden.shape)))
            return logits(hidden)

        def sample_first(t, hidden, rows):
            self.calls.append(("sample_first", tuple(hidden.shape), tuple((r.sp.temperature, r.sp.seed) for r in rows)))
            return first(t, hidden, rows)

        monkeypatch.setattr(target, "forward", forward)
        monkeypatch.setattr(target, "logits", head)
        monkeypatch.setattr(commit, "sample_first", sample_first)
        monkeypatch.setattr(rounds, "sample_first", sample_first)
        monkeypatch.setattr(prefill, "sample_first", sample_first)


KW = dict(max_new_tokens=[40, 24, 36, 12, 40, 30], temperature=[0.0, 0.8, 0.0, 1.0, 0.0, 0.0],
          seed=list(range(6)))


def test_a_row_that_never_proposes_runs_the_plain_round_of_none(llama_target, monkeypatch):
    """Rows that never propose (no proposal pays) under ``proposers="suffix"``: every forward, head call and
    first-token sampling equals plain decoding's, call for call and shape for shape, from the first round."""
    prompts = token_prompts(6, llama_target.vocab_size, seed=41)
    rec = _Recorder(llama_target, monkeypatch)
    want = [o.token_ids for o in generate(llama_target, None, prompts, batch_size=4, **KW)]
    plain = rec.calls
    rec.calls = []
    got = generate(llama_target, None, prompts, batch_size=4, verify="cost", cost=CAL, proposers="suffix",
                   prices=_dear(llama_target), **KW)
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.verify_steps for o in got) == 0
    assert rec.calls == plain


def test_a_draft_that_cannot_pay_at_the_first_rows_is_retired_before_the_prefill(llama_target, monkeypatch):
    """``proposers="auto"`` where the draft is out of the running at the rows admitted first
    (``rounds.draft_cannot_pay``): the stream is plain decoding's call for call from its
    first forward (no taps, no prompt run through the draft), the prefix tree keeps no taps, no token changes, and
    the decisions say why. Where a block could pay, the draft's context is kept from the prefill on."""
    prompts = token_prompts(4, llama_target.vocab_size, seed=45)
    kw = dict(max_new_tokens=30, temperature=0.0)
    rec = _Recorder(llama_target, monkeypatch)
    want = [o.token_ids for o in generate(llama_target, None, prompts, **kw)]
    plain = rec.calls
    draft = random_dspine(llama_target, 4, seed=6)
    runs = []
    extend = type(draft).extend_context

    def counted(self, *a, **k):
        runs.append(1)
        return extend(self, *a, **k)

    monkeypatch.setattr(type(draft), "extend_context", counted)
    assert rounds.draft_cannot_pay.__module__ == "dspine.decoding.rounds"
    for prices, retired in ((_dear(llama_target), True), (StaticPrices(CAL, packed=llama_target.packs), False)):
        rec.calls, runs[:] = [], []
        tree = PrefixCache(64 << 20)
        decisions: dict = {}
        got = sorted(decode_stream(llama_target, draft, [(p, SamplingParams(**kw)) for p in prompts], 4,
                                   verify="cost", cost=CAL, proposers="auto", prices=prices, prefix_cache=tree,
                                   decisions=decisions))
        assert [o.token_ids for _, o in got] == want
        why = decisions["dspine"]["why"] or ""
        if retired:
            assert rec.calls == plain and not runs
            assert tree._layout[1] == 0
            assert why.startswith("retired before the first prefill: at 4 rows"), why
            assert decisions["dspine"]["rounds"] == 0
            # the next stream that retires it too keeps the tree: its prompts are served from it
            served = tree.served
            again = sorted(decode_stream(llama_target, draft, [(p, SamplingParams(**kw)) for p in prompts], 4,
                                         verify="cost", cost=CAL, proposers="auto", prices=prices, prefix_cache=tree))
            assert [o.token_ids for _, o in again] == want
            assert tree.served > served
        else:
            assert rec.calls[0][0] == "forward" and rec.calls[0][4]  # the prefill computed the draft's taps
            assert runs and not why.startswith("retired before")


def test_draft_cannot_pay_reads_the_prices_at_the_rows_admitted():
    """Before any round: out where no block pays even with every token accepted (a round of each block ``b`` costs
    ``b`` plain steps or more), or where the prior's expected tau is below ``RETIRE_MARGIN`` of what a round needs
    (``retire_draft``'s own test with no evidence); kept where the prior expects it to pay."""
    from dspine.decoding.acceptance import JobAcceptance
    from dspine.decoding.config import StreamConfig

    def cfg(draft_s: float, prior: float) -> StreamConfig:
        c = StreamConfig(object(), 4, None, "cost", None, 8, (1,))
        c.prices = StaticPrices(CostModel.flat(target_s=1.0, per_token_s=0.0, draft_s=draft_s), packed=True)
        c.job = JobAcceptance(prior, 3)
        return c

    assert not rounds.draft_cannot_pay(cfg(0.0, 0.5), 8)  # free: a block of 2 needs tau 1, the prior expects 1.5
    assert rounds.draft_cannot_pay(cfg(4.0, 0.95), 8)  # a block of 4 costs 5 steps: not even a perfect draft pays
    assert not rounds.draft_cannot_pay(cfg(2.5, 0.95), 8)  # block 4 costs 3.5 steps; the prior expects tau 3.71
    assert rounds.draft_cannot_pay(cfg(2.5, 0.5), 8)  # ... where this prior expects 1.875 (< 0.8 x 3.5)
    c = cfg(4.0, 0.95)
    c.draft_retired = 3
    assert not rounds.draft_cannot_pay(c, 8)  # retired already: nothing to decide
    assert not rounds.draft_cannot_pay(cfg(4.0, 0.95), 0)


def test_with_a_draft_that_never_pays_auto_ends_on_the_plain_round_of_none(llama_target, monkeypatch):
    """``proposers="auto"`` with a draft that never pays (its block could, were every token accepted): once the
    draft is retired (``rounds.RETIRE_ROUNDS`` rounds without it) the rounds are plain decoding's, no taps and no
    draft context kept, call for call."""
    monkeypatch.setattr(decode_mod, "draft_cannot_pay", lambda cfg, R: False)
    prompts = token_prompts(4, llama_target.vocab_size, seed=43)
    kw = dict(max_new_tokens=60, temperature=0.0)
    rec = _Recorder(llama_target, monkeypatch)
    want = [o.token_ids for o in generate(llama_target, None, prompts, **kw)]
    plain = rec.calls
    rec.calls = []
    draft = random_dspine(llama_target, 4, seed=3)
    got = sorted(decode_stream(llama_target, draft, [(p, SamplingParams(**kw)) for p in prompts], 4, verify="cost",
                               cost=CAL, proposers="auto", prices=_dear(llama_target)))
    assert [o.token_ids for _, o in got] == want
    auto = rec.calls
    assert len(auto) == len(plain)  # one forward per round either way: nothing extra ran
    tail = 2 * rounds.RETIRE_ROUNDS * 3  # forward, head, sampling per round: past the retirement
    assert any(c[0] == "forward" and c[4] for c in auto[:tail])  # the draft was kept up before
    assert auto[tail:] == plain[tail:]


def _reference_survival(rows, src, width, prior):
    """The per-row, token-by-token survival this module replaced (no skipping): the oracle."""
    a = np.zeros((len(rows), width), dtype=np.float32)
    props = []
    for b, r in enumerate(rows):
        if r is None:
            props.append([])
            continue
        room = r.sp.max_new_tokens - len(r.tokens) - 1
        sug = src.suggest(r.index, min(width, room)) if room > 0 and r.finish is None else None
        if sug is None:
            props.append([])
            continue
        rate = row_suffix_rate(r, prior)
        surv, out = 1.0, []
        for j, (count, same) in enumerate(zip(sug.counts, sug.sames)):
            agree = (same + AGREEMENT_WEIGHT * rate) / (max(count - 1, 0) + AGREEMENT_WEIGHT)
            surv *= min(agree, rate + (1.0 - rate) * agree)
            a[b, j] = surv
            out.append(sug.tokens[j])
        props.append(out)
    return torch.from_numpy(a), props


def _random_source(seed: int, vocab: int = 12):
    """A source with running rows (some siblings) and finished outputs over a small vocabulary: matches of every
    order, and rows whose last n-gram occurs nowhere."""
    rng = random.Random(seed)
    src = SuffixSource(cap_tokens=400, max_len=8)
    rows = []
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    for i in range(14):
        p = prompts[rng.randrange(len(prompts))] if rng.random() < 0.5 else [rng.randrange(vocab)
                                                                          for _ in range(rng.randint(1, 12))]
        r = Row(i, p, SamplingParams(max_new_tokens=rng.randint(2, 40)), 9)
        src.start(i, p)
        n = rng.randint(0, r.sp.max_new_tokens - 1)
        r.tokens = [rng.randrange(vocab) if rng.random() < 0.6 else (r.tokens or p)[-1] for _ in range(n)]
        src.extend(i, r.tokens)
        r.fed = len(r.tokens)
        r.sfx_trials, r.sfx_hits = rng.uniform(0, 5), rng.uniform(0, 3)
        if rng.random() < 0.3:
            src.finish(i)
        else:
            rows.append(r)
    return src, rows


@pytest.mark.parametrize("seed", range(8))
def test_could_match_is_never_wrong_and_survival_is_unchanged(seed):
    """``could_match`` false => ``suggest`` finds nothing (a brute check over random corpora), it is false for
    some rows (lookups are really skipped), and the survival and proposals equal the per-row oracle's bit for bit."""
    src, rows = _random_source(seed, vocab=6 + seed)
    skipped = 0
    for r in rows:
        if not src.could_match(r.index):
            skipped += 1
            assert src.suggest(r.index) is None
    a, props = suffix_survival(rows, src, 8, 0.55)
    want_a, want_props = _reference_survival(rows, src, 8, 0.55)
    assert props == want_props and torch.equal(a, want_a)
    if seed >= 4:  # larger vocabularies: some rows' last bigram occurs in no corpus they read
        assert skipped > 0


def test_skipped_lookups_change_no_token(llama_target, monkeypatch):
    """The same job with every row looked up (``could_match`` forced true) and with the cheap test: greedy and
    sampled outputs identical, and the test skipped lookups."""
    prompts = _repetitive_prompts(llama_target, 3, seed=12) + token_prompts(3, llama_target.vocab_size, seed=13)
    cheap = StaticPrices(CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=1e6), packed=llama_target.packs)
    counts = {"suggest": 0}
    suggest = SuffixSource.suggest

    def counted(self, *a, **k):
        counts["suggest"] += 1
        return suggest(self, *a, **k)

    monkeypatch.setattr(SuffixSource, "suggest", counted)
    kw = dict(max_new_tokens=30, temperature=[0.0, 0.9, 0.0, 0.0, 0.7, 0.0], seed=list(range(6)), verify="cost",
              cost=CAL, proposers="suffix", batch_size=4, prices=cheap)
    got = generate(llama_target, None, prompts, **kw)
    with_test = counts["suggest"]
    counts["suggest"] = 0
    monkeypatch.setattr(SuffixSource, "could_match", lambda self, key: True)
    every = generate(llama_target, None, prompts, **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in every]
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(llama_target, None, prompts, max_new_tokens=30,
                                                                      temperature=kw["temperature"], seed=kw["seed"])]
    assert sum(o.stats.suffix_accepted for o in got) > 0  # proposals were made and kept
    assert with_test < counts["suggest"]


def test_quiet_rounds_feed_no_index(llama_target, monkeypatch):
    """Rounds that do not look for proposals (``rounds._quiet_round``) feed no suffix index: their tokens go in
    with the next round that looks (or when the row finishes), so the index is fed in fewer, longer calls."""
    extends = []
    extend = SuffixSource.extend
    monkeypatch.setattr(SuffixSource, "extend", lambda self, key, toks: extends.append(len(toks)) or extend(self, key,
                                                                                                             toks))
    quiet = []
    q = rounds._quiet_round
    monkeypatch.setattr(rounds, "_quiet_round", lambda *a: quiet.append(1) or q(*a))
    prompts = token_prompts(4, llama_target.vocab_size, seed=17)
    got = generate(llama_target, None, prompts, max_new_tokens=40, verify="cost", cost=CAL, proposers="suffix",
                   prices=_dear(llama_target))
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(llama_target, None, prompts,
                                                                         max_new_tokens=40)]
    assert len(quiet) > 10
    assert sum(extends) == sum(len(o.token_ids) for o in got)  # every committed token indexed once
    assert max(extends) > 1  # quiet rounds' tokens went in together


def test_looking_is_priced_apart_from_the_forward():
    """A job whose plain steps are half quiet (no looking) and half looking (5 ms more), verifies always looking:
    with the looking observed apart, a plain step is priced at its forward (30 ms) and a verify at its forward's
    surcharge (6 ms + 2 ms a token) plus the looking it keeps going (5 ms). Fitted with the looking inside the
    round's seconds (as before), the quiet steps left part of the looking in the plain step's base."""
    apart, inside = LivePrices(CAL, packed=True), LivePrices(CAL, packed=True)
    for i in range(300):
        k = [0, 0, 4, 0, 8][i % 5]
        look = 0.0 if k == 0 and i % 2 else 0.005
        seconds = 0.030 + (0.006 + 0.002 * k if k else 0.0)
        apart.observe(8, k, seconds, look_seconds=look)
        inside.observe(8, k, seconds + look)
    assert apart.round_s(8, 0) == pytest.approx(0.030, rel=0.02)
    assert apart.round_s(8, 4) - apart.round_s(8, 0) == pytest.approx(0.005 + 0.006 + 0.008, rel=0.05)
    assert inside.round_s(8, 0) > 0.032 and inside.round_s(8, 4) - inside.round_s(8, 0) < 0.0175
    assert apart.summary()["rows"][8]["look_ms"] == pytest.approx(5.0, rel=0.02)


@pytest.mark.parametrize("last_k", [0, 4])
def test_a_verify_a_hair_above_a_plain_step_does_not_start_speculation(last_k):
    """Hysteresis (``LivePrices.hurdle``): a verify priced 1.5 % above a plain step runs while the stream is
    verifying (the last round at this row count verified) but does not start one after a plain step; one priced
    well above it starts at once. Static prices keep no hysteresis."""
    from dspine.decoding.prices import ENTER_MARGIN
    from dspine.decoding.schedule import SUFFIX, plan_packed

    prices = LivePrices(CAL, packed=True)
    for i in range(60):
        k = [0, 4][i % 2]
        prices.observe(8, k, 0.030 + 0.0001 * k)
    prices.observe(8, last_k, 0.030 + 0.0001 * last_k)
    live, greedy = torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)

    def plan_at(gain: float):
        a = gain * 8 * prices.round_s(8, 1) / prices.round_s(8, 0) - 8  # one token whose verify is priced at gain
        assert 0 < a < 1
        surv = torch.zeros(8, 4)
        surv[0, 0] = a
        return plan_packed(None, surv, greedy, live, prices)

    small = plan_at(1 + ENTER_MARGIN / 2)
    assert small.ell.tolist() == ([1] + [0] * 7 if last_k else [0] * 8)
    big = plan_at(1 + 2 * ENTER_MARGIN)
    assert big.ell.tolist() == [1] + [0] * 7 and big.source[0] == SUFFIX
    assert StaticPrices(CAL, packed=True).hurdle(8) == 1.0


def test_verifies_priced_as_paying_that_did_not_raise_the_hurdle_fast():
    """The decision checked against what it gave (``LivePrices.outcome``): verify rounds that realise 70 % of their
    priced rate raise the hurdle within a few of them, enough that a verify priced 20 % above a plain step no
    longer runs; verifies that realise what they were priced at leave it at the hysteresis margin, and so do
    verifies that do better (the outcome check never lowers it)."""
    from dspine.decoding.prices import ENTER_MARGIN
    from dspine.decoding.schedule import plan_packed

    def job(realised: float) -> LivePrices:
        prices = LivePrices(CAL, packed=True)
        for _ in range(40):
            prices.observe(8, 0, 0.030)
        for _ in range(6):  # verify rounds priced at 400 tok/s: 0.030 s for 12 tokens
            prices.observe(8, 4, 0.030, priced_rate=400.0, committed=round(12 * realised))
        prices.observe(8, 0, 0.030)  # the last round a plain step: the entry margin applies
        return prices

    assert job(1.0).hurdle(8) == pytest.approx(1 + ENTER_MARGIN)
    assert job(1.5).hurdle(8) == pytest.approx(1 + ENTER_MARGIN)
    bad = job(0.7)
    assert bad.hurdle(8) > 1.2 and bad.outcome(8) < 0.83
    live, greedy = torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)
    for prices, runs in ((job(1.0), True), (bad, False)):
        a = 1.2 * 8 * prices.round_s(8, 1) / prices.round_s(8, 0) - 8  # one token priced 20 % above plain
        surv = torch.zeros(8, 4)
        surv[0, 0] = min(a, 0.999)
        assert bool(plan_packed(None, surv, greedy, live, prices).ell.any()) == runs


def test_a_draft_the_plan_never_takes_is_retired_whatever_its_outlook(llama_target, monkeypatch):
    """A draft whose outlook says it would pay (expected tau at what a round needs) but which the plan never takes
    is retired after ``RETIRE_IDLE`` rounds in a row without it: its upkeep (taps, context) stops, no token
    changes, and the decisions say why."""
    monkeypatch.setattr(rounds, "RETIRE_ROUNDS", 4)
    monkeypatch.setattr(rounds, "RETIRE_IDLE", 12)
    monkeypatch.setattr(rounds, "draft_outlook", lambda job, prices, R: (2.0, 2.0, 4))
    monkeypatch.setattr(decode_mod, "draft_cannot_pay", lambda cfg, R: False)  # the outlook above says it could
    prompts = token_prompts(4, llama_target.vocab_size, seed=44)
    kw = dict(max_new_tokens=40, temperature=0.0)
    want = [o.token_ids for o in generate(llama_target, None, prompts, **kw)]
    decisions: dict = {}
    got = sorted(decode_stream(llama_target, random_dspine(llama_target, 4, seed=4),
                               [(p, SamplingParams(**kw)) for p in prompts], 4, verify="cost", cost=CAL,
                               proposers="auto", prices=_dear(llama_target), decisions=decisions))
    assert [o.token_ids for _, o in got] == want
    assert decisions["dspine"]["why"].startswith("retired after round 12"), decisions["dspine"]


def test_a_quiet_stream_looks_less_often_the_longer_nothing_is_found():
    """Every 4th round after 8 fruitless looks, every 8th after 16, every 16th after 24 (``rounds.quiet_every``)."""
    assert [rounds.quiet_every(q) for q in (8, 15, 16, 23, 24, 1000)] == [4, 4, 8, 8, 16, 16]
