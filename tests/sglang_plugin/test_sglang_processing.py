"""The DSPINE verify's per-slot logits processing (``dspine.sglang.processing``) against a plain step-by-step
reference that does what SGLang's penalizers do in a plain decode step (scatter per generated token, the scaling
penalty, one additive tensor, then ``logit_bias``, ``min_new_tokens`` as ``-inf``), slot by slot with the slot's
own history; and ``rounds.history``. Pure torch, on stand-in ``Req`` objects: needs no SGLang."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
import torch

from dspine.sglang.processing import RowParams, process_block, row_params, stop_ids
from dspine.sglang.rounds import history

V = 64
B = 6


def plain_step(raw: torch.Tensor, prompt: list[int], history: list[int], rp: RowParams,
               bias: torch.Tensor | None) -> torch.Tensor:
    """One plain decode step's processed logits ``[V]`` after ``history`` (the generated tokens), SGLang's way:
    the penalizers' state is cumulated one generated token at a time."""
    x = raw.clone()[None]
    cum_freq = torch.zeros(1, V)
    cum_pres = torch.zeros(1, V)
    scaling = torch.ones(1, V)
    if rp.repetition != 1.0 and rp.prompt:
        scaling[0, torch.tensor(prompt)] = rp.repetition
    for t in history:  # BatchedFrequency/Presence/RepetitionPenalizer._cumulate_output_tokens
        idx = torch.tensor([[t]])
        cum_freq.scatter_add_(1, idx, torch.tensor([[rp.frequency]], dtype=torch.float32))
        cum_pres.scatter_(1, idx, torch.tensor([[rp.presence]], dtype=torch.float32))
        if rp.repetition != 1.0:
            scaling.scatter_(1, idx, torch.tensor([[rp.repetition]], dtype=torch.float32))
    x = torch.where(x < 0, x * scaling, x / scaling)
    additive = torch.zeros(1, V)
    additive -= cum_freq
    additive -= cum_pres
    if len(history) < rp.min_tokens:
        stop = torch.zeros(1, V)
        stop[0, torch.tensor(rp.stop_ids)] = float("-inf")
        additive += stop
    x += additive
    if bias is not None:
        x += bias
    return x[0]


CASES = [
    RowParams(presence=0.5),
    RowParams(frequency=0.1),  # not a dyadic: the frequency term must be summed as SGLang sums it
    RowParams(repetition=1.3),
    RowParams(repetition=0.7, prompt=(1, 2, 3, 60)),
    RowParams(presence=-0.3, frequency=0.37, repetition=1.17, prompt=(5, 9)),
    RowParams(min_tokens=9, stop_ids=(0, 63)),
    RowParams(presence=0.2, frequency=-0.15, repetition=1.05, min_tokens=4, stop_ids=(7,), prompt=(7, 8)),
]


@pytest.mark.parametrize("rp", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_slot_equals_a_plain_step_with_that_slots_history(rp, with_bias):
    rng = random.Random(hash((rp, with_bias)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    prompt = list(rp.prompt) or [rng.randrange(V) for _ in range(5)]
    bias = None
    if with_bias:
        bias = torch.zeros(V)
        bias[torch.tensor([3, 11, 40])] = torch.tensor([2.5, -1.75, 0.3])
    for n_generated in (1, 3, 12):  # the anchor is the last generated token
        generated = [rng.randrange(V // 4) for _ in range(n_generated)]  # small range: repeats
        drafts = [rng.randrange(V // 4) for _ in range(B - 1)]
        drafts[2] = drafts[0]  # a draft repeated within the block
        raw = torch.randn(B, V) * 3
        got = raw.clone()
        process_block(got, generated, drafts, rp, bias)
        for j in range(B):
            want = plain_step(raw[j], prompt, generated + drafts[:j], rp, bias)
            assert torch.equal(got[j], want), (j, n_generated, (got[j] - want).abs().max())


def test_the_reference_really_penalizes():
    """The oracle is not a no-op: a repeated token loses logit with a presence/frequency penalty, and a slot whose
    history has more of it loses more (so process_block's per-slot history is what the equality above checks)."""
    raw = torch.zeros(B, V) + 1.0
    got = raw.clone()
    process_block(got, [5, 5], [5, 6, 7, 8, 9], RowParams(presence=0.5, frequency=0.25), None)
    assert got[0, 5] == 1.0 - 0.5 - 0.5 and got[1, 5] == 1.0 - 0.5 - 0.75
    assert got[0, 6] == 1.0 and got[2, 6] == 1.0 - 0.5 - 0.25 and got[0, 0] == 1.0


def test_min_tokens_holds_stop_ids_back_on_the_early_slots_only():
    raw = torch.zeros(B, V)
    got = raw.clone()
    process_block(got, [1, 2], [3, 4, 5, 6, 7], RowParams(min_tokens=4, stop_ids=(0, 9, V + 5)), None)
    # 2 generated: slots 0 and 1 decide tokens 3 and 4 (fewer than 4 generated before them)
    assert torch.isinf(got[:2, [0, 9]]).all() and (got[2:, [0, 9]] == 0).all()
    assert (got[:, 1:9] == 0).all()  # nothing else moved; ids past the vocabulary ignored


def _req(rid="r", prompt=(1, 2, 3), out=(), **sp):
    params = SimpleNamespace(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
                             stop_token_ids=None)
    for k, v in sp.items():
        setattr(params, k, v)
    req = SimpleNamespace(rid=rid, origin_input_ids=list(prompt), output_ids=array("q", out), sampling_params=params,
                          eos_token_ids={2}, tokenizer=SimpleNamespace(eos_token_id=4, additional_stop_token_ids={6}),
                          done=False)
    req.finished = lambda: req.done
    return req


def test_row_params_of_requests():
    assert row_params(_req(), True) is None  # no processing: no cost
    rp = row_params(_req(repetition_penalty=1.2), True)
    assert rp.repetition == 1.2 and rp.prompt == (1, 2, 3)
    assert row_params(_req(repetition_penalty=1.2), False).prompt == ()  # SGLang's own semantics
    rp = row_params(_req(min_new_tokens=3, stop_token_ids={9}), True)
    assert rp.min_tokens == 3 and rp.stop_ids == (2, 4, 6, 9) == stop_ids(_req(stop_token_ids={9}))


def test_history_completes_what_output_ids_lag_behind_from_the_device_tail():
    """``output_ids`` is exact with the plain loop and a round behind under overlap scheduling: the committed count
    (from the device) says how many tokens it misses, the last ones of the row's recorded tail; never an error."""
    out = array("q", [10, 11, 12, 13])
    assert history(out, 4, [11, 12, 13, 0], 3) == ([10, 11, 12, 13], True)  # up to date
    assert history(out[:1], 4, [11, 12, 13, 0], 3) == ([10, 11, 12, 13], True)  # one round behind
    assert history(array("q"), 1, [10, 0, 0, 0], 1) == ([10], True)  # the first decode round: the prefill's token
    assert history(out, 3, [12, 13, 0, 0], 2) == ([10, 11, 12], True)  # output_ids ahead (a retracted row): cut
    assert history(out[:1], 6, [12, 13, 0, 0], 2) == ([10], False)  # the tail cannot cover five: said, not raised


@pytest.mark.parametrize("rp", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_sglang_verify_and_the_reference_engines_process_agree_in_float32(rp):
    """The two verifiers' processing (one slot-history helper, ``dspine.decoding.history``) give the same
    processed logits for the same row, slot by slot: the reference engine's ``processors.process`` (with the
    prompt counted for repetition, as ``dspine.sglang.sampling`` runs SGLang) against ``process_block``, float32;
    equal up to the order of float32 operations (frequency ``f * count`` there, a sum of ``f`` here)."""
    from dspine.decoding.processors import RowState, process
    from dspine.decoding.sampling import SamplingParams

    rng = random.Random(hash(("agree", rp)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    prompt = list(rp.prompt) or [rng.randrange(V) for _ in range(5)]
    bias = ((3, 2.5), (11, -1.75), (40, 0.3))
    dense_bias = torch.zeros(V)
    dense_bias[torch.tensor([3, 11, 40])] = torch.tensor([2.5, -1.75, 0.3])
    for n_generated in (1, 3, 12):
        generated = [rng.randrange(V // 4) for _ in range(n_generated)]
        drafts = [rng.randrange(V // 4) for _ in range(B - 1)]
        drafts[2] = drafts[0]
        raw = torch.randn(B, V) * 3
        sp = SamplingParams(presence_penalty=rp.presence, frequency_penalty=rp.frequency,
                            repetition_penalty=rp.repetition, min_tokens=rp.min_tokens, stop_token_ids=rp.stop_ids,
                            logit_bias=bias)
        st = RowState.of(sp, prompt if rp.prompt else [], V)
        st.commit(generated)
        ours = process(raw.clone(), [st], [0] * B, list(range(B)), torch.tensor([drafts]))
        theirs = raw.clone()
        process_block(theirs, generated, drafts, rp, dense_bias)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        finite = torch.isfinite(ours)
        assert torch.allclose(ours[finite], theirs[finite], rtol=1e-6, atol=1e-5), (ours - theirs)[finite].abs().max()
        assert not torch.equal(ours, raw)  # the control: the case changed the logits
