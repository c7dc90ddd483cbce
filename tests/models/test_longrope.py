"""Longrope (Phi-3 / Phi-4-mini) across its switch: which factors rotate which position (``Rotary.needs_long``), and
speculation lossless when a verify crosses ``original_max_position_embeddings``.

A tiny phi3 whose switch is at 32 positions, with weights large enough that a key rotated with the wrong factors
flips tokens. Plain decoding (the prompt's prefill, then a position a step) is the law; a verify over positions
on both sides of the switch must rotate each as the plain step there does. Hugging Face is the oracle where it
computes the same thing: its forward fed as plain decoding feeds ours, and its ``generate`` for rows that never
cross the switch while generating (it re-runs a crossing row's whole sequence with the long factors).
"""

from __future__ import annotations

import pytest
import torch
from family_models import save_tiny_family
from helpers import chi2_pvalue, joint3_counts, random_dspine

from dspine import generate, load_target
from dspine.decoding.cost import CostModel
from dspine.models.layers import RopeSpec, Rotary

SWITCH = 32
SHARP = dict(initializer_range=0.15)  # a key rotated with the wrong factors flips tokens, not 1e-2 of a logit


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    return save_tiny_family(tmp_path_factory.mktemp("phi"), "phi3", **SHARP)


@pytest.fixture(scope="module")
def hf(phi):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(phi, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_the_long_factors_go_where_plain_decoding_puts_them():
    """Per position: past the switch always; below it only in a prefill that reaches past it (a prompt longer than
    the switch is rotated wholly with the long factors, as HF's forward does); without ``prefill`` every row is one
    (HF's whole-forward rule)."""
    spec = RopeSpec(rotary_dim=4, rope_type="longrope", original_max_position=SWITCH, short_factor=(1.0, 1.0),
                    long_factor=(4.0, 4.0))
    rot = Rotary(spec)
    pos = torch.tensor([[30, 31, 32, 33], [0, 1, 2, 3], [36, 37, 38, 39]])
    ends = torch.tensor([34, 40, 40])
    long = rot.needs_long(pos, ends, prefill=torch.tensor([False, True, False]))
    assert long.tolist() == [[False, False, True, True], [True] * 4, [True] * 4]
    assert rot.needs_long(pos[:1], ends[:1]).tolist() == [[True] * 4]  # HF's forward over positions 30..33
    assert rot.needs_long(pos[:1] - 2, torch.tensor([32]), prefill=torch.tensor([True])).tolist() == [[False] * 4]
    cos, _ = rot(pos, torch.float32, ends, torch.tensor([False, True, False]))
    assert torch.equal(cos[0, 0, 1], Rotary(RopeSpec(**{**spec.__dict__, "long_factor": (1.0, 1.0)}))(
        pos[:1, 1:2], torch.float32)[0][0, 0, 0])  # position 31 of a verify: the short factors


@pytest.mark.parametrize("mode", ["torch", "kernels"])
@torch.no_grad()
def test_a_verify_across_the_switch_is_the_plain_steps(phi, hf, mode):
    """Prefill 29 tokens, then 6 more one step at a time (plain) or as one speculative verify over positions 29..34:
    every logit bit-identical (on our kernels; within 1e-4 on torch's), and within 1e-4 of HF's forward fed the
    same way (the prompt whole, then a token a step on its cache)."""
    from dspine.cpu import kernels

    if mode == "kernels" and kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    target = load_target(phi, kernels=mode == "kernels")
    ids = torch.randint(3, 256, (1, 35), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(1, 8)
    first = target.logits(target.forward(ids[:, :29], cache).hidden)[0, -1:]
    one = [target.logits(target.forward(ids[:, i:i + 1], cache).hidden)[0] for i in range(29, 35)]
    steps = torch.cat([first, *one])
    cache = target.new_cache(1, 8)
    target.forward(ids[:, :29], cache)
    verify = torch.cat([first, target.logits(target.forward(ids[:, 29:35], cache, speculative=True).hidden)[0]])
    # bit-identical on our kernels (batch invariant); torch's GEMMs round by shape
    assert torch.equal(verify, steps) if mode == "kernels" else (verify - steps).abs().max().item() < 1e-4
    kw = _cache_kw(hf)
    ref = [hf(ids[:, :29], **kw).logits[0, -1:]]
    ref += [hf(ids[:, i:i + 1], **kw).logits[0] for i in range(29, 35)]
    assert (torch.cat(ref) - steps).abs().max().item() < 1e-4


def _cache_kw(hf) -> dict:
    """A fresh cache for HF's forward, under the keyword the installed transformers takes (``cache`` from 5.25,
    ``past_key_values`` before)."""
    import inspect

    from transformers import DynamicCache

    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return {key: DynamicCache(config=hf.config), "use_cache": True}


def _hf_plain_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's forward as plain decoding feeds it: the prompt whole, then one token a step on its cache."""
    kw, ids, out = _cache_kw(hf), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(ids, **kw).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def test_greedy_across_the_switch_under_the_draft_and_suffix_proposals(phi, hf):
    """Rows of 20-31 prompt tokens generating 16 (every one crosses the switch while generating) and one of 40 (past
    it from the prefill): the draft's and suffix proposals' tokens are plain decoding's, which are HF's forward fed
    as plain decoding feeds it; the 40-token row's are HF ``generate``'s too."""
    target = load_target(phi)
    g = torch.Generator().manual_seed(3)
    period = [torch.randint(3, 256, (7,), generator=g).tolist() for _ in range(4)]
    prompts = [(p * 6)[:n] for p, n in zip(period, (20, 27, 31, 40))]  # periodic: suffix matches propose
    plain = [o.token_ids for o in generate(target, None, prompts, max_new_tokens=16)]
    cheap = CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=0.05)
    suffix = generate(target, None, prompts, max_new_tokens=16, verify="cost", cost=cheap, prices="static",
                      proposers="suffix", batch_size=2)
    assert [o.token_ids for o in suffix] == plain
    assert sum(o.stats.suffix_steps for o in suffix) > 0
    drafted = generate(target, random_dspine(target, 4, seed=2), prompts, max_new_tokens=16)
    assert [o.token_ids for o in drafted] == plain
    assert sum(o.stats.verify_steps for o in drafted) > 0
    assert plain == [_hf_plain_greedy(hf, p, 16) for p in prompts]
    with torch.no_grad():
        assert hf.generate(torch.tensor([prompts[3]]), max_new_tokens=16, do_sample=False)[0, 40:].tolist() == plain[3]


@torch.no_grad()
def _plain_joint3(target, prompt: list[int]) -> torch.Tensor:
    """Exact p(x1, x2, x3 | prompt) at temperature 1 as plain decoding computes it (the prompt's prefill, then one
    position a step: not ``Target.score``, whose one forward is HF's whole-sequence rule)."""
    V = target.vocab_size
    probs = []
    for k in range(3):
        rows = V**k
        cache = target.new_cache(rows, len(prompt) + 3)
        h = target.forward(torch.tensor([prompt] * rows), cache).hidden[:, -1]
        for j in range(k):  # the tokens before, in the order of the flattened joint (x1 slowest)
            col = (torch.arange(rows) // V ** (k - 1 - j)) % V
            h = target.forward(col[:, None], cache).hidden[:, -1]
        probs.append(target.logits(h).softmax(-1))
    p1, p2, p3 = probs
    return (p1[0][:, None, None] * p2[:, :, None] * p3.view(V, V, V)).flatten().double()


@pytest.mark.parametrize("proposer", ["draft", "suffix"])
def test_sampled_law_across_the_switch(tmp_path, proposer):
    """A 31-token prompt: its 3 sampled tokens are predicted at positions 30, 31 (short factors) and 32 (long), and
    every verify after the prefill crosses the switch. Under a random DSpine draft and under suffix proposals (the
    prompt is periodic) the joint law of the 3 tokens is plain decoding's exact law (χ²), with proposals kept."""
    target = load_target(save_tiny_family(tmp_path / "phi16", "phi3", vocab_size=16, num_hidden_layers=2,
                                          head_scale=1.5, **SHARP))
    prompt = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 7] * 4)[:31]
    exact = _plain_joint3(target, prompt)
    n = 6000
    kw = dict(max_new_tokens=3, temperature=1.0, seed=list(range(n)))
    if proposer == "draft":
        outs = generate(target, random_dspine(target, 4, seed=5), [prompt] * n, **kw)
    else:
        cheap = CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=0.05)
        outs = generate(target, None, [prompt] * n, verify="cost", cost=cheap, prices="static", proposers="suffix",
                        batch_size=8, **kw)  # at the default batch the static prices take no suffix proposal
    assert chi2_pvalue(joint3_counts(outs, target.vocab_size), exact) > 1e-3
    kept = sum(o.stats.dspine_accepted if proposer == "draft" else o.stats.suffix_accepted for o in outs)
    assert kept > 0
