"""Gemma 4's text decoder (``dspine/models/gemma4.py``) against Hugging Face's ``Gemma4ForCausalLM``.

A tiny random model from ``Gemma4TextConfig`` (``family_models.GEMMA4``: sliding and full layers with their own
head sizes, keys = values and proportional RoPE on the full layers, per-layer inputs, KV-shared layers with a
double-wide MLP, soft-capping) loaded by ``load_target``: fp32 logits within 1e-4 of HF over a ragged batched
prefill, decode steps and a speculative verify, on torch's linears and on our kernels; greedy ``generate`` equal to
HF's; suffix speculation equal to plain; ``dspine info``; the pieces we do not run refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_models import GEMMA4, check_ragged_prefill_decode_verify, check_speculation_equals_plain, save_tiny_gemma4
from helpers import token_prompts

from dspine import generate, load_target
from dspine.models.checkpoint import ModelLoadError


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return save_tiny_gemma4(tmp_path_factory.mktemp("gemma4"))


@pytest.fixture(scope="module")
def hf(gemma4):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma4, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as dspine does without stops
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("mode", ["torch", "kernels"])
def test_logits_match_transformers_ragged_prefill_decode_verify(mode, gemma4, hf):
    """Rows of 5, 19 and 40 tokens (past the window of 8) prefilled together, two decode steps, a 3-token
    speculative verify of which 1-3 tokens are kept, one more step: every logit within 1e-4 of HF's forward over the
    row's whole sequence (the KV-shared layers read keys their source layer wrote in the same forward)."""
    if mode == "kernels":
        from dspine.cpu import kernels

        if kernels.load() is None:
            pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    ours = load_target(gemma4, kernels=mode == "kernels")
    assert ours.family == "gemma4" and ours.kernel.startswith("dspine-") == (mode == "kernels")
    check_ragged_prefill_decode_verify(ours, hf, 4, "gemma4")


def test_greedy_generate_equals_transformers(gemma4, hf):
    ours = load_target(gemma4)
    prompts = token_prompts(2, 256, seed=3, lo=4, hi=20)
    for p, o in zip(prompts, generate(ours, None, prompts, max_new_tokens=16)):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == theirs


def test_speculation_equals_plain(gemma4):
    """Suffix proposals (no draft; greedy and sampled rows) and an initialised DSpine draft: the plain tokens, with
    suffix steps and verifies really taken."""

    target = load_target(gemma4)
    base = token_prompts(4, 256, seed=7, lo=3, hi=12)
    first = generate(target, None, base, max_new_tokens=10)
    prompts = [p + o.token_ids + p for p, o in zip(base, first)]
    check_speculation_equals_plain(target, prompts)


def test_dspine_info_lists_gemma4(gemma4, tmp_path):
    from click.testing import CliRunner

    from dspine.cli import main

    res = CliRunner().invoke(main, ["info", gemma4])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["family"] == "gemma4" and info["class"] == "Gemma4Target"
    assert info["layers_head_dim"] == [16, 16, 32, 16, 16, 32] and info["options"]["kv_shared_layers"] == [4, 5]
    assert info["layers_window"] == [8, 8, None, 8, 8, None] and "proportional" in info["layers_rope"][2]
    from dspine.cpu import kernels

    on_kernels = kernels.load() is not None  # our fused attention: batch invariant, so the prefix cache runs
    assert info["features"]["prefix_cache"] is on_kernels and info["features"]["chunked_prefill"] is on_kernels
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    res = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert res.exit_code == 1 and "Gemma 4" in res.output and len(res.output.strip().splitlines()) == 1


def test_on_our_kernels_a_row_is_the_same_alone_batched_chunked_and_from_the_prefix_cache(gemma4):
    """Fused attention (value norm before the store, KV-shared layers reading their source's cache): a row's hidden
    states are bit-identical alone, in a batch and prefilled in two chunks across the sliding window; the engine's
    features that reuse those bits (the prefix cache, chunked prefill) change no token of greedy or sampled rows."""
    from dspine.cpu import kernels
    from dspine.decoding.prefix import PrefixCache

    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    target = load_target(gemma4)
    assert target.fused_attention() and target.packs and target.invariance_gaps == ()
    g = torch.Generator().manual_seed(5)
    row = torch.randint(3, 256, (1, 23), generator=g)

    def hidden(ids, cache=None):
        return target.forward(ids, target.new_cache(ids.shape[0], 4) if cache is None else cache).hidden

    alone = hidden(row)[0]
    assert torch.equal(hidden(torch.cat([torch.randint(3, 256, (2, 23), generator=g), row]))[2], alone)
    cache = target.new_cache(1, 4)
    assert torch.equal(torch.cat([hidden(row[:, :9], cache)[0], hidden(row[:, 9:], cache)[0]]), alone)
    head = token_prompts(1, 256, seed=8, lo=20, hi=21)[0]
    prompts = [head + p for p in token_prompts(4, 256, seed=9, lo=2, hi=9)]
    kw = dict(max_new_tokens=10, temperature=[0.0, 0.8, 0.0, 1.0], seed=[1, 2, 3, 4], batch_size=2)
    plain = [o.token_ids for o in generate(target, None, prompts, **kw)]
    tree = PrefixCache()
    shared = generate(target, None, prompts, prefix_cache=tree, prefill_chunk=5, **kw)
    assert [o.token_ids for o in shared] == plain
    assert sum(o.cached_prompt_tokens for o in shared) > 0  # the shared head was read from the tree


def test_moe_and_bidirectional_refused_in_one_line(gemma4, tmp_path):
    cfg = json.loads(open(f"{gemma4}/config.json").read())
    (tmp_path / "model.safetensors").symlink_to(f"{gemma4}/model.safetensors")  # a model folder: config, weights
    for key, value, words in (("enable_moe_block", True, "enable_moe_block"),
                              ("use_bidirectional_attention", "all", "use_bidirectional_attention")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelLoadError, match=words) as e:
            load_target(tmp_path)
        assert "\n" not in str(e.value)


def test_the_multimodal_checkpoint_loads_its_text_decoder(tmp_path):
    """Gemma 4's small models ship as ``Gemma4ForConditionalGeneration`` (``text_config``; the decoder under
    ``model.language_model``, beside the vision tower): the text decoder alone, its logits those of HF's model."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    text = transformers.Gemma4TextConfig(**{**GEMMA4, "initializer_range": 0.08})
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2)
    model = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(str(tmp_path))
    ours = load_target(tmp_path)
    assert ours.family == "gemma4" and ours.num_layers == GEMMA4["num_hidden_layers"]
    ids = torch.randint(3, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # HF in float64: its own fp32 forward is 1e-4 off it on this model, ours ~1e-5
        expect = model.double()(input_ids=ids).logits
    assert (ours.score(ids).double() - expect).abs().max().item() < 1e-4
