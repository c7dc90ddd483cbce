"""Decoding loop: greedy speculative == greedy AR, sampled speculative ~ AR ~ exact target, stats, seeds."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    JoiningScriptedDraft,
    LookaheadDraft,
    RandomDraft,
    ScriptedDraft,
    random_mistakes,
    token_prompts,
)
from helpers import chi2_pvalue as _chi2_pvalue  # the names the decoding tests import from here
from helpers import exact_joint3 as _exact_joint3
from helpers import random_dspine as _random_dspine

from dspine import generate
from dspine.decoding.cost import CostModel, Grid

# Synthetic cost models (seconds): drafting nearly free (speculate whenever acceptance is plausible), drafting
# dearer than a target step (speculate only when acceptance is high), drafting never worth it.
CHEAP = CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=0.05)
MID = CostModel.flat(target_s=1.0, per_token_s=0.05, draft_s=0.6)
NEVER = CostModel.flat(target_s=1.0, per_token_s=0.0, draft_s=1e6)
# Each verified token costs a fifth of a step whatever the batch: the sampled rows' own rule then cuts blocks
# at different lengths depending on the confidence along each drafted path.
ROWLESS = CostModel(Grid((1, 2), (1, 4), ((1.0, 1.6), (1.0, 1.6))), Grid((1, 2), (2, 4), ((0.2, 0.2), (0.2, 0.2))))


@pytest.fixture(params=["llama", "qwen3", "hybrid"])
def target(request, llama_target, qwen3_target, hybrid_target):
    return {"llama": llama_target, "qwen3": qwen3_target, "hybrid": hybrid_target}[request.param]


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("bs", [2, 4, 8, 16])
def test_greedy_speculative_equals_ar(target, batch, bs):
    prompts = token_prompts(batch, target.vocab_size, seed=batch * 100 + bs)
    ar = generate(target, None, prompts, max_new_tokens=24)
    script = [o.token_ids for o in ar]
    for rate, dyn in [(0.0, None), (0.3, None), (0.3, 0.5), (1.0, None)]:
        draft = ScriptedDraft(prompts, script, block_size=bs, mistake=random_mistakes(bs, rate))
        spec = generate(target, draft, prompts, max_new_tokens=24, dynamic_threshold=dyn)
        for a, s in zip(ar, spec):
            assert s.token_ids == a.token_ids
            assert s.finish_reason == a.finish_reason
            assert sum(s.stats.accept_histogram) == s.stats.verify_steps
            if rate == 0.0 and dyn is None:  # a perfect draft commits a whole block per round
                assert s.stats.verify_steps == -(-(len(a.token_ids) - 1) // bs)
            if rate == 1.0:
                assert s.stats.draft_tokens_accepted == 0


@pytest.mark.parametrize("cost", [CHEAP, MID, NEVER], ids=["cheap", "mid", "never"])
@pytest.mark.parametrize("batch_size", [2, 8])
def test_greedy_cost_aware_continuous_equals_ar(target, cost, batch_size):
    """Cost-aware ℓ (ℓ = 0 rounds included) and rows joining freed slots: still exactly the plain output."""
    prompts = token_prompts(7, target.vocab_size, seed=batch_size)
    budgets = [3, 17, 9, 24, 1, 12, 20]
    ar = generate(target, None, prompts, max_new_tokens=budgets)
    script = [o.token_ids for o in ar]
    for rate, dyn in [(0.0, None), (0.3, 0.5), (1.0, None)]:
        draft = JoiningScriptedDraft(prompts, script, block_size=4, mistake=random_mistakes(7, rate))
        spec = generate(target, draft, prompts, max_new_tokens=budgets, dynamic_threshold=dyn, verify="cost",
                        cost=cost, batch_size=batch_size)
        assert [s.token_ids for s in spec] == script
        for s, a in zip(spec, ar):
            st = s.stats
            assert s.finish_reason == a.finish_reason
            assert sum(st.accept_histogram) == st.verify_steps
            assert st.round_tokens + st.plain_steps == len(s.token_ids) - 1  # every token after the first
            assert st.round_tokens >= st.verify_steps
        if cost is NEVER:  # drafting never pays: every round is a plain step and the draft never runs
            assert draft.calls == 0 and all(s.stats.verify_steps == 0 for s in spec)
        if cost is CHEAP and rate == 0.0:  # a perfect draft that costs nothing is used
            assert all(s.stats.verify_steps > 0 for s in spec if len(s.token_ids) > 2)


def test_plain_steps_equal_plain_sampling(llama_target):
    """ℓ = 0 everywhere draws exactly the plain decoder's uniforms: same sampled tokens, not just same law."""
    prompts = token_prompts(5, 256, seed=8)
    kw = dict(max_new_tokens=15, temperature=0.9, top_p=0.95, top_k=50, seed=[21, 22, 23, 24, 25])
    plain = generate(llama_target, None, prompts, **kw)
    draft = JoiningScriptedDraft(prompts, [o.token_ids for o in plain], block_size=4)
    spec = generate(llama_target, draft, prompts, verify="cost", cost=NEVER, batch_size=2, **kw)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert draft.calls == 0


def test_continuous_batching_hands_rows_back_as_they_finish(llama_target):
    """decode_stream yields a short request before a long one that started with it, and pulls lazily."""
    from dspine.decoding.decode import decode_stream
    from dspine.decoding.sampling import SamplingParams

    prompts = token_prompts(5, 256, seed=9)
    budgets = [30, 2, 30, 3, 4]
    pulled = []

    def feed():
        for i, p in enumerate(prompts):
            pulled.append(i)
            yield p, SamplingParams(max_new_tokens=budgets[i])

    order = []
    for i, out in decode_stream(llama_target, None, feed(), batch_size=2):
        order.append(i)
        assert len(out.token_ids) == budgets[i]
        assert len(pulled) <= len(order) + 2  # at most batch_size requests open beyond those handed back
    # 1 leaves after its 2 tokens and 2 takes its slot; 3 and 4 take the slots 0 and then 3 leave
    assert order == [1, 0, 2, 3, 4]
    ref = generate(llama_target, None, prompts, max_new_tokens=budgets)
    again = generate(llama_target, None, prompts, max_new_tokens=budgets, batch_size=2)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]


def test_oracle_tau_equals_block_size(llama_target):
    prompts = token_prompts(4, 256, seed=3)
    ar = generate(llama_target, None, prompts, max_new_tokens=33)
    spec = generate(llama_target, ScriptedDraft(prompts, [o.token_ids for o in ar], 8), prompts, max_new_tokens=33)
    for s in spec:  # 1 prefill token + 4 full rounds of 8
        assert s.stats.verify_steps == 4 and s.stats.accept_length == 8.0
        assert s.stats.accept_histogram == [0] * 7 + [4, 0]
        assert s.stats.draft_tokens_proposed == 28 and s.stats.draft_tokens_accepted == 28


def test_random_draft_tau_about_one(qwen3_target):
    prompts = token_prompts(4, 256, seed=4)
    spec = generate(qwen3_target, RandomDraft(256, 8, stochastic=False), prompts, max_new_tokens=20)
    ar = generate(qwen3_target, None, prompts, max_new_tokens=20)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    assert all(s.stats.accept_length < 1.5 for s in spec)


def test_stop_tokens_and_length_mid_block(llama_target):
    prompts = token_prompts(6, 256, seed=5)
    ar = generate(llama_target, None, prompts, max_new_tokens=30)
    # stop on a token that appears mid-way in each row's greedy output
    stops = [[o.token_ids[len(o.token_ids) // 2]] for o in ar]
    ar_s = generate(llama_target, None, prompts, max_new_tokens=30, stop_token_ids=stops)
    draft = ScriptedDraft(prompts, [o.token_ids for o in ar], 8, mistake=random_mistakes(1, 0.1))
    sp_s = generate(llama_target, draft, prompts, max_new_tokens=30, stop_token_ids=stops)
    for a, s, st in zip(ar_s, sp_s, stops):
        assert s.token_ids == a.token_ids and s.finish_reason == a.finish_reason == "stop"
        assert s.token_ids[-1] == st[0] and st[0] not in s.token_ids[:-1]
    for n in (1, 2, 5, 11):
        sp = generate(llama_target, ScriptedDraft(prompts, [o.token_ids for o in ar], 8), prompts, max_new_tokens=n)
        assert all(len(s.token_ids) == n and s.finish_reason == "length" for s in sp)
        assert [s.token_ids for s in sp] == [o.token_ids[:n] for o in ar]


def test_per_request_params_and_zero_tokens(llama_target):
    prompts = token_prompts(3, 256, seed=6)
    outs = generate(llama_target, None, prompts, max_new_tokens=[0, 3, 5], temperature=[0.0, 1.0, 0.7], seed=[1, 2, 3])
    assert [len(o.token_ids) for o in outs] == [0, 3, 5]
    with pytest.raises(ValueError, match="prompt 1"):
        generate(llama_target, None, [[1, 2], []])
    with pytest.raises(ValueError, match="context"):
        generate(llama_target, None, [[1] * 1000], max_new_tokens=100)


@pytest.mark.parametrize("spec", [False, True])
def test_sampled_output_independent_of_batch(llama_target, spec):
    prompts = token_prompts(5, 256, seed=7)
    draft = RandomDraft(256, 4) if spec else None
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=[11, 12, 13, 14, 15])
    together = generate(llama_target, draft, prompts, **kw)
    for i, p in enumerate(prompts):
        alone = generate(llama_target, draft, [p], **{**kw, "seed": kw["seed"][i]})
        assert alone[0].token_ids == together[i].token_ids


def _exact_joint(target, prompt, temperature):
    """Exact p(x1, x2 | prompt) of the target at ``temperature`` (small vocab: enumerate x1)."""
    V = target.vocab_size
    p1 = (target.score(torch.tensor([prompt]))[0, -1] / temperature).softmax(-1)
    ids = torch.tensor([prompt + [x] for x in range(V)])
    p2 = (target.score(ids)[:, -1] / temperature).softmax(-1)  # [V, V]
    return (p1[:, None] * p2).flatten().double()


def _joint_counts(target, draft, prompt, n, temperature, **kw):
    outs = generate(target, draft, [prompt] * n, max_new_tokens=2, temperature=temperature, seed=list(range(n)), **kw)
    V = target.vocab_size
    counts = torch.zeros(V * V, dtype=torch.long)
    for o in outs:
        counts[o.token_ids[0] * V + o.token_ids[1]] += 1
    return counts


@pytest.mark.parametrize(
    "name,draft_fn",
    [
        ("ar", lambda: None),
        ("one-hot q", lambda: RandomDraft(16, 4, stochastic=False)),
        ("stochastic q", lambda: RandomDraft(16, 4, sharp=1.0)),
        ("dynamic stop", lambda: RandomDraft(16, 4, sharp=1.0, dynamic=True)),
    ],
)
def test_sampled_speculative_matches_target_distribution(small_vocab_target, name, draft_fn):
    prompt = [3, 1, 4, 1, 5]
    exact = _exact_joint(small_vocab_target, prompt, 1.0)
    counts = _joint_counts(small_vocab_target, draft_fn(), prompt, 12000, 1.0)
    assert _chi2_pvalue(counts, exact) > 1e-3, name


def test_lookahead_truncation_is_detected(small_vocab_target):
    """Negative control: a stopping rule that peeks at later samples biases the output, and the test sees it."""
    prompt = [3, 1, 4, 1, 5]
    exact = _exact_joint(small_vocab_target, prompt, 1.0)
    counts = _joint_counts(small_vocab_target, LookaheadDraft(16, 4, sharp=3.0), prompt, 12000, 1.0)
    assert _chi2_pvalue(counts, exact) < 1e-3


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("dyn", [None, 0.5])
def test_dspine_draft_greedy_equals_ar(target, bs, dyn):
    prompts = token_prompts(5, target.vocab_size, seed=bs)
    ar = generate(target, None, prompts, max_new_tokens=20)
    spec = generate(target, _random_dspine(target, bs, seed=1), prompts, max_new_tokens=20, dynamic_threshold=dyn)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    if dyn is not None:  # the confidence head really truncated some blocks
        assert sum(s.stats.draft_tokens_proposed for s in spec) < sum(s.stats.verify_steps for s in spec) * (bs - 1)


def test_dspine_draft_sampled_matches_target_distribution(small_vocab_target):
    prompt = [3, 1, 4, 1, 5]
    exact = _exact_joint(small_vocab_target, prompt, 1.0)
    counts = _joint_counts(small_vocab_target, _random_dspine(small_vocab_target, 4, seed=2), prompt, 8000, 1.0)
    assert _chi2_pvalue(counts, exact) > 1e-3


def _vocab_dspine(target, bs: int, seed: int, vocab: list[int]):
    """``_random_dspine`` proposing from a subset of the target's ids (q is zero off the subset)."""
    from dspine import init_draft

    d = init_draft(target, num_layers=2, block_size=bs, seed=seed, intermediate_size=64, top_k=4, draft_vocab=vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "injection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return d


def test_draft_vocab_greedy_equals_ar(target):
    prompts = token_prompts(4, target.vocab_size, seed=3)
    ar = generate(target, None, prompts, max_new_tokens=20)
    d = _vocab_dspine(target, 8, seed=1, vocab=list(range(0, target.vocab_size, 2)))
    spec = generate(target, d, prompts, max_new_tokens=20)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]


def test_draft_vocab_sampled_matches_target_distribution(small_vocab_target):
    """Half the vocabulary can never be proposed: those tokens must still come out at the target's rate."""
    prompt = [3, 1, 4, 1, 5]
    exact = _exact_joint(small_vocab_target, prompt, 1.0)
    d = _vocab_dspine(small_vocab_target, 4, seed=2, vocab=[0, 2, 5, 7, 8, 11, 13, 14])
    counts = _joint_counts(small_vocab_target, d, prompt, 8000, 1.0)
    assert _chi2_pvalue(counts, exact) > 1e-3


def _joint3_counts(target, draft, prompt, n, **kw):
    outs = generate(target, draft, [prompt] * n, max_new_tokens=3, temperature=1.0, seed=list(range(n)), **kw)
    V = target.vocab_size
    counts = torch.zeros(V**3, dtype=torch.long)
    for o in outs:
        a, b, c = o.token_ids
        counts[(a * V + b) * V + c] += 1
    return counts, outs


@pytest.mark.parametrize(
    "name,bs,kw",
    [
        ("fixed block 4", 4, dict(verify="fixed")),
        ("fixed block 8, confidence stop", 8, dict(verify="fixed", dynamic_threshold=0.5)),
        ("cost-aware, confidence", 4, dict(verify="cost", cost=ROWLESS)),
        ("cost-aware, history only", 4, dict(verify="cost", cost=ROWLESS, history=True)),
        ("cost-aware, continuous batching", 4, dict(verify="cost", cost=ROWLESS, batch_size=97)),
    ],
)
def test_sampled_joint_of_three_tokens_matches_target(small_vocab_target, name, bs, kw):
    """The joint law of 3 sampled tokens (2 of them drafted: slot 2's q depends on slot 1's sample) is exact
    with the real draft, whole or truncated blocks, the cost-aware stop and rows joining a running batch."""
    kw = dict(kw)
    d = _random_dspine(small_vocab_target, bs, seed=5)
    if kw.pop("history", False):
        d.confidence_trained = False  # ℓ from each row's own acceptance history
    prompt = [3, 1, 4, 1, 5]
    exact = _exact_joint3(small_vocab_target, prompt)
    counts, outs = _joint3_counts(small_vocab_target, d, prompt, 16000, **kw)
    assert _chi2_pvalue(counts, exact) > 1e-3, name
    steps = sum(o.stats.verify_steps for o in outs)
    proposed = sum(o.stats.draft_tokens_proposed for o in outs)
    assert steps > 0  # drafted tokens were really verified
    if kw.get("verify") == "cost" or "dynamic_threshold" in kw:  # ... and really cut short in some rounds
        assert proposed < steps * (bs - 1)


# the draft's time grows with its block: a greedy neighbour that drafts wide must not move a sampled row's ℓ
STEEP = CostModel(ROWLESS.target, Grid((1, 2), (2, 4), ((0.1, 0.7), (0.1, 0.7))))


@pytest.mark.parametrize("verify,cost", [("fixed", None), ("cost", ROWLESS), ("cost", STEEP)],
                         ids=["fixed", "cost-rowless", "cost-steep"])
def test_sampled_rows_independent_of_batch_and_join_time(llama_target, verify, cost):
    """Same seed -> same tokens: alone, in a batch (with greedy neighbours), or joining a running batch late."""
    d = _random_dspine(llama_target, 4, seed=3)
    prompts = token_prompts(6, 256, seed=10)
    budgets, seeds = [12, 3, 9, 14, 5, 10], [31, 32, 33, 34, 35, 36]
    temps = [0.9, 0.0, 0.9, 0.0, 0.9, 0.9]
    kw = dict(top_k=50, verify=verify, cost=cost, batch_size=3)
    together = generate(llama_target, d, prompts, max_new_tokens=budgets, seed=seeds, temperature=temps, **kw)
    backwards = generate(llama_target, d, prompts[::-1], max_new_tokens=budgets[::-1], seed=seeds[::-1],
                         temperature=temps[::-1], **kw)
    assert [o.token_ids for o in backwards[::-1]] == [o.token_ids for o in together]
    for i, p in enumerate(prompts):
        alone = generate(llama_target, d, [p], max_new_tokens=budgets[i], seed=seeds[i], temperature=temps[i], **kw)
        assert alone[0].token_ids == together[i].token_ids
    assert sum(o.stats.verify_steps for o in together) > 0


@pytest.mark.parametrize("cost", [CHEAP, MID], ids=["cheap", "mid"])
def test_dspine_draft_cost_aware_continuous_greedy_equals_ar(target, cost):
    prompts = token_prompts(5, target.vocab_size, seed=11)
    budgets = [20, 4, 13, 20, 7]
    ar = generate(target, None, prompts, max_new_tokens=budgets)
    spec = generate(target, _random_dspine(target, 4, seed=1), prompts, max_new_tokens=budgets, verify="cost",
                    cost=cost, batch_size=2)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]


# -- suffix proposals (dspine.decoding.suffix) beside the draft ------------------------------------------------


# A verify costs about the same at any width and batch: rows verify any suffix proposal with a fair chance.
WIDE = CostModel(Grid((1, 2), (1, 17), ((1.0, 1.1), (1.0, 1.1))), CHEAP.draft)


def _repetitive_prompts(target, n: int, seed: int) -> list[list[int]]:
    """Prompts that quote what the target writes after them (``p + AR(p) + p``), so suffix matches exist and
    some are right, whatever the target's own habits (the tiny hybrid's greedy text rarely repeats itself)."""
    base = token_prompts(n, target.vocab_size, seed=seed)
    first = generate(target, None, base, max_new_tokens=12)
    return [p + o.token_ids + p for p, o in zip(base, first)]


@pytest.mark.parametrize("proposers", ["suffix", "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_suffix_greedy_equals_ar(target, proposers, batch):
    prompts = _repetitive_prompts(target, 5, seed=7)
    ar = generate(target, None, prompts, max_new_tokens=30)
    d = _random_dspine(target, 4, seed=1) if proposers == "auto" else None
    spec = generate(target, d, prompts, max_new_tokens=30, verify="cost", cost=CHEAP, prices="static",
                    proposers=proposers, batch_size=batch)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    st = [s.stats for s in spec]
    assert sum(s.suffix_accepted for s in st) > 0  # suffix proposals were really verified and accepted
    assert all(s.verify_steps == s.suffix_steps + s.dspine_steps for s in st)
    assert all(s.draft_tokens_accepted == s.suffix_accepted + s.dspine_accepted for s in st)
    if proposers == "suffix":
        assert all(s.dspine_steps == 0 for s in st)


def test_auto_mixes_draft_and_suffix_rounds(llama_target):
    """With a draft nearly free, rows without a suffix match take the draft's block in the same run (and batch)."""
    prompts = _repetitive_prompts(llama_target, 3, seed=8) + token_prompts(3, 256, seed=9)
    ar = generate(llama_target, None, prompts, max_new_tokens=16)
    spec = generate(llama_target, _random_dspine(llama_target, 4, seed=2), prompts, max_new_tokens=16,
                    verify="cost", cost=CHEAP, prices="static", proposers="auto")
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    assert sum(s.stats.dspine_steps for s in spec) > 0 and sum(s.stats.suffix_steps for s in spec) > 0


@pytest.mark.parametrize("proposers", ["suffix", "auto"])
def test_suffix_sampled_rows_are_plain_decoding_token_for_token(llama_target, proposers):
    """A suffix row's committed tokens are the ones plain decoding samples with the same keyed uniforms: the
    output for a seed does not depend on what was proposed, the batch, or the other rows of the job."""
    prompts = _repetitive_prompts(llama_target, 6, seed=11)
    kw = dict(max_new_tokens=24, temperature=[0.7, 0.0, 0.7, 1.0, 0.0, 0.5], seed=[1, 2, 3, 4, 5, 6], top_k=40)
    plain = generate(llama_target, None, prompts, **kw)
    d = _random_dspine(llama_target, 4, seed=3) if proposers == "auto" else None
    for batch in (1, 4):
        spec = generate(llama_target, d, prompts, verify="cost", cost=CHEAP, prices="static", proposers=proposers,
                        batch_size=batch, **kw)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    sampled = [s.stats for s, t in zip(spec, kw["temperature"]) if t > 0]
    assert sum(s.suffix_steps for s in sampled) > 0
    assert all(s.dspine_steps == 0 for s in sampled)  # sampled rows never take the draft under auto


@pytest.mark.parametrize("proposers,bs,batch", [("suffix", 4, 97), ("auto", 8, 13)],
                         ids=["suffix-continuous", "mixed-continuous"])
def test_suffix_sampled_joint_of_three_tokens_matches_target(small_vocab_target, proposers, bs, batch):
    """The joint law of 3 sampled tokens with suffix proposals (the row's prompt, its siblings, finished rows), in
    rounds where greedy neighbours verify the draft's block or their own suffix: exact."""
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1, 4]
    exact = _exact_joint3(small_vocab_target, prompt)
    n, k = 12000, 2000
    d = _random_dspine(small_vocab_target, bs, seed=5) if proposers == "auto" else None
    outs = generate(small_vocab_target, d, [prompt] * (n + k), max_new_tokens=3,
                    temperature=[1.0] * n + [0.0] * k, seed=list(range(n + k)), verify="cost", cost=WIDE,
                    prices="static", proposers=proposers, batch_size=batch)
    V = small_vocab_target.vocab_size
    counts = torch.zeros(V**3, dtype=torch.long)
    for o in outs[:n]:
        a, b, c = o.token_ids
        counts[(a * V + b) * V + c] += 1
    assert _chi2_pvalue(counts, exact) > 1e-3
    assert sum(o.stats.suffix_steps for o in outs[:n]) > n // 10  # suffix rounds really happened
    if proposers == "auto":
        assert sum(o.stats.dspine_steps for o in outs[n:]) > 0  # ... beside draft rounds of greedy rows


def test_suffix_needs_cost_aware_verification(llama_target):
    with pytest.raises(ValueError, match="verify='cost'"):
        generate(llama_target, None, [[1, 2, 3]], max_new_tokens=4, proposers="suffix")
    with pytest.raises(ValueError, match="proposers must be one of"):
        generate(llama_target, None, [[1, 2, 3]], max_new_tokens=4, verify="cost", cost=CHEAP, proposers="ngram")
