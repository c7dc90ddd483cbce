"""The processed target distribution (temperature, top-k, top-p) and inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch

from dspine.decoding.sampling import SamplingParams, per_request, sample_from, target_probs


def test_top_k_top_p_reference():
    logits = torch.tensor([[[2.0, 1.0, 0.5, 0.0, -1.0]]])
    p = target_probs(logits, [SamplingParams(temperature=1.0, top_k=3)])[0, 0]
    assert (p[3:] == 0).all() and torch.allclose(p[:3], logits[0, 0, :3].softmax(-1))
    full = logits[0, 0].softmax(-1)  # [0.56, 0.21, 0.13, 0.08, 0.03]
    p = target_probs(logits, [SamplingParams(temperature=1.0, top_p=0.75)])[0, 0]
    assert (p[2:] == 0).all() and torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = target_probs(logits, [SamplingParams(temperature=1.0, top_p=0.5)])[0, 0]  # the top token always stays
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    p = target_probs(logits, [SamplingParams(temperature=0.5)])[0, 0]
    assert torch.allclose(p, (logits[0, 0] / 0.5).softmax(-1))
    p = target_probs(logits, [SamplingParams(temperature=0.0)])[0, 0]
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_sample_from_never_picks_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    u = torch.tensor([0.0, 0.25, 0.4999999, 0.5, 0.75, 0.9999999])
    out = sample_from(probs.expand(len(u), -1), u)
    assert set(out.tolist()) <= {1, 3}
    assert out.tolist()[:3] == [1, 1, 1] and out.tolist()[3:] == [3, 3, 3]


def test_per_request_expansion_and_validation():
    ps = per_request(2, temperature=[0.0, 0.7], top_p=1.0, top_k=0, seed=5, max_new_tokens=[1, 2], stop_token_ids=[7])
    assert ps[1].temperature == 0.7 and ps[0].stop_token_ids == ps[1].stop_token_ids == (7,)
    ps = per_request(2, stop_token_ids=[[1], [2, 3]])
    assert ps[1].stop_token_ids == (2, 3)
    with pytest.raises(ValueError, match="temperature: got 3 values for 2 prompts"):
        per_request(2, temperature=[0.1, 0.2, 0.3])
    for bad, why in [(dict(top_p=0.0), "top_p must be in"), (dict(temperature=-1.0), "temperature must be"),
                     (dict(temperature=float("inf")), "temperature must be finite"),
                     (dict(temperature=float("nan")), "temperature must be"), (dict(top_k=-1), "top_k must be"),
                     (dict(max_new_tokens=-1), "max_new_tokens must be"),
                     (dict(repetition_penalty=float("inf")), "repetition_penalty must be finite"),
                     (dict(presence_penalty=float("nan")), "presence_penalty must be finite"),
                     (dict(frequency_penalty=-float("inf")), "frequency_penalty must be finite"),
                     (dict(logit_bias=((3, float("inf")),)), "logit_bias values must be finite"),
                     (dict(min_tokens=-2), "min_tokens must be"), (dict(logprobs=21), "logprobs must be 0..20")]:
        with pytest.raises(ValueError, match=why):
            SamplingParams(**bad)
    for good in (dict(top_p=1.0), dict(temperature=0.0), dict(temperature=1e30), dict(top_k=0), dict(logprobs=0)):
        SamplingParams(**good)  # the edges that are allowed
