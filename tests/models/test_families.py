"""The dense families beyond Llama/Qwen3 (``dspine.models.families``) against Hugging Face's own implementations.

Each family's tiny random model (``family_models.FAMILIES``: a few layers, its distinctive options on) is saved by
``transformers`` and loaded by ``load_target``: fp32 logits within 1e-4 of HF over a ragged batched prefill, decode
steps and a speculative verify, on torch's modules and on our CPU kernels; greedy ``generate`` equal to HF's;
suffix proposals and an initialised DSpine draft equal to plain decoding; batch and chunk invariance where the
family claims it, and the claim withdrawn (named) where it cannot hold.
"""

from __future__ import annotations

import pytest
import torch
from family_models import FAMILIES, check_ragged_prefill_decode_verify, check_speculation_equals_plain, save_tiny_family
from helpers import chi2_pvalue, exact_joint3, joint3_counts, random_dspine, teacher_forced_batch, token_prompts

from dspine import generate, load_target
from dspine.models.checkpoint import ModelLoadError
from dspine.models.families import read_spec

NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = save_tiny_family(tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    transformers.logging.set_verbosity_error()
    loaded: dict[str, object] = {}

    def get(path: str):
        if path not in loaded:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # run to max_new_tokens, as dspine does without stops
            model.generation_config.pad_token_id = 0
            loaded[path] = model
        return loaded[path]

    return get


def _kernels_or_skip(mode: str) -> None:
    from dspine.cpu import kernels

    if mode == "kernels" and kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("mode", ["torch", "kernels"])
@pytest.mark.parametrize("family", NAMES)
def test_logits_match_transformers_ragged_prefill_decode_verify(family, mode, family_dir, hf_model):
    """Rows of 5, 19 and 40 tokens (past the tiny sliding windows of 8; the 40-token row past Phi's longrope
    switch at 32) prefilled together, two decode steps, then a 3-token speculative verify of which 1-3 tokens are
    kept, then one more step: every logit within 1e-4 of HF's forward over the row's whole sequence."""
    _kernels_or_skip(mode)
    path = family_dir(family)
    ours, ref = load_target(path, kernels=mode == "kernels"), hf_model(path)
    assert ours.kernel.startswith("dspine-") == (mode == "kernels")
    assert ours.family == family
    check_ragged_prefill_decode_verify(ours, ref, len(family), family)


@pytest.mark.parametrize("family", NAMES)
def test_greedy_generate_equals_transformers(family, family_dir, hf_model):
    path = family_dir(family)
    ours, ref = load_target(path), hf_model(path)
    prompts = token_prompts(2, 256, seed=3, lo=4, hi=20)
    mine = generate(ours, None, prompts, max_new_tokens=16)
    for p, o in zip(prompts, mine):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == hf, family


def _repetitive_prompts(target, n: int, seed: int) -> list[list[int]]:
    base = token_prompts(n, target.vocab_size, seed=seed, lo=3, hi=12)
    first = generate(target, None, base, max_new_tokens=10)
    return [p + o.token_ids + p for p, o in zip(base, first)]


@pytest.mark.parametrize("family", NAMES)
def test_speculative_equals_plain(family, family_dir):
    """Suffix proposals (no draft; greedy and sampled rows) and an initialised DSpine draft: the plain tokens. Phi's
    tiny longrope switches at 32 positions: its rows (16-34 prompt tokens, 20 generated) cross it, one of them in
    its prefill, the others in verifies (``test_longrope.py`` has the rule and its laws)."""
    # Phi's weights larger than the family test's (sharper attention): a key rotated with the wrong factors flips
    # tokens instead of moving logits by 1e-2
    sharp = {"initializer_range": 0.15} if family == "phi3" else {}
    path = save_tiny_family(family_dir(family) + "-sharp", family, **sharp) if sharp else family_dir(family)
    target = load_target(path)
    prompts = _repetitive_prompts(target, 4, seed=7)
    if family == "phi3":
        switch = target.rotary.spec.original_max_position
        assert min(map(len, prompts)) < switch < max(map(len, prompts)) + 20
    check_speculation_equals_plain(target, prompts)


@pytest.mark.parametrize("family", NAMES)
def test_batch_and_chunk_invariance_where_claimed(family, family_dir):
    """On our kernels a row's hidden states (the bits the prefix cache and chunked prefill reuse) are the same alone
    or in a batch, and prefilled whole or in two chunks, for every family without ``invariance_gaps``. A family
    with gaps names them and chunked prefill is off for it (Phi's longrope: a 40-token prompt, past the switch at 32,
    is rotated wholly with the long factors, so its chunks differ from it; a prompt below the switch chunks
    exactly), never silently."""
    from dspine.decoding.prefill import chunking_exact

    _kernels_or_skip("kernels")
    target = load_target(family_dir(family))
    gapped = family == "phi3"
    assert any("longrope" in gap for gap in target.invariance_gaps) if gapped else target.invariance_gaps == ()
    assert chunking_exact(target) == (not gapped)
    g = torch.Generator().manual_seed(5)
    n = 40 if gapped else 23

    def hidden(ids, cache=None):
        return target.forward(ids, target.new_cache(ids.shape[0], 4) if cache is None else cache).hidden

    def chunked(row):
        cache = target.new_cache(1, 4)
        return torch.cat([hidden(row[:, :9], cache)[0], hidden(row[:, 9:], cache)[0]])

    row = torch.randint(3, 256, (1, n), generator=g)
    alone = hidden(row)[0]
    batch = torch.cat([torch.randint(3, 256, (2, n), generator=g), row])
    assert torch.equal(hidden(batch)[2], alone)
    assert torch.equal(chunked(row), alone) != gapped
    if gapped:  # below the switch the rule is per position: chunks are exact there
        short = row[:, :23]
        assert torch.equal(chunked(short), hidden(short)[0])


def test_sliding_window_sampled_speculation_chi2(tmp_path):
    """Sampled speculation on a sliding-window family (Mistral, window 4 < the 13-token prompt): the joint law of
    3 sampled tokens with a random DSpine draft (2 drafted slots per block) is the target's exact law."""
    target = load_target(save_tiny_family(tmp_path / "m16", "mistral", vocab_size=16, num_hidden_layers=2,
                                          sliding_window=4, head_scale=4.0))
    assert set(target.windows) == {4}
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    exact = exact_joint3(target, prompt)
    n = 8000
    outs = generate(target, random_dspine(target, 4, seed=5), [prompt] * n, max_new_tokens=3, temperature=1.0,
                    seed=list(range(n)))
    assert chi2_pvalue(joint3_counts(outs, target.vocab_size), exact) > 1e-3
    assert sum(o.stats.draft_tokens_accepted for o in outs) > 0  # drafted tokens really were kept


def test_unsupported_architecture_lists_families(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as e:
        load_target(tmp_path)
    message = str(e.value)
    assert "\n" not in message
    for word in ("Gemma 3", "SmolLM3", "OLMo 2", "Granite", "Phi-3", "Mistral", "Qwen2", "Qwen3.5"):
        assert word in message


def test_refusals_name_the_option(tmp_path):
    path = save_tiny_family(tmp_path / "g", "gemma3", use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        load_target(path)


def test_dspine_info_says_family_kernels_features_and_taps(family_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from dspine.cli import main

    res = CliRunner().invoke(main, ["info", family_dir("gemma3")])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["family"] == "gemma3" and info["options"]["norms"] == "sandwich"
    assert info["layers_window"] == [8, 8, None, 8] and "linear" in info["layers_rope"][2]
    assert info["features"]["prefix_cache"] is True and info["default_tap_ids"]
    if info["on_our_kernels"]["linears"].startswith("dspine-"):
        assert info["on_our_kernels"]["attention"].startswith("dspine")
    phi = json.loads(CliRunner().invoke(main, ["info", family_dir("phi3")]).output)
    if phi["on_our_kernels"]["linears"].startswith("dspine-"):
        features = phi["features"]
        assert features["prefix_cache"] is False and "longrope" in features["not_batch_invariant_because"][0]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    res = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert res.exit_code == 1 and "unsupported architecture" in res.output and "Gemma 3" in res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("family", ["phi3", pytest.param("gemma3", marks=pytest.mark.slow),
                                    pytest.param("granite", marks=pytest.mark.slow)])
def test_a_draft_trains_for_the_family(family, family_dir):
    """``dspine train``'s step on a family whose logits are scaled, soft-capped or whose projections are fused:
    the draft learns the target's labels (loss falls)."""
    import math

    from helpers import train_stats

    from dspine import init_draft
    from dspine.training.train import TrainConfig

    target = load_target(family_dir(family))
    torch.manual_seed(0)
    draft = init_draft(target, num_layers=1, block_size=4, transfer_rank=16, message_size=32, top_k=4,
                       intermediate_size=96)
    draft.train()
    batch = teacher_forced_batch(target, draft, 32, lo=3)
    cfg = TrainConfig(steps=12, lr=3e-3, anchors_per_seq=32, replacement_probability=0.0, alignment_warmup_steps=3)
    loss = [s["backbone"] + s["refine"] for s in train_stats(draft, target, batch, cfg)]
    assert all(math.isfinite(x) for x in loss)
    assert max(loss[-3:]) < 0.85 * loss[0], loss


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_legacy_config_keys_as_released_checkpoints_have_them(family, family_dir, hf_model, tmp_path):
    """Released checkpoints predate ``rope_parameters``: Gemma 3's ``rope_theta`` + ``rope_local_base_freq`` +
    ``rope_scaling``, Phi's ``rope_scaling: {"type": "longrope", ...}`` with ``partial_rotary_factor`` and
    ``original_max_position_embeddings`` at the top level. Read as the same model."""
    import json
    import shutil

    src = family_dir(family)
    dst = tmp_path / family
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    if family == "gemma3":
        cfg.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling={
            "rope_type": "linear", "factor": rope["full_attention"]["factor"]},
            rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    else:
        cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                   rope_scaling={"type": "longrope", "short_factor": rope["short_factor"],
                                 "long_factor": rope["long_factor"]})
    (dst / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expect = hf_model(src)(ids).logits
    assert (load_target(dst).score(ids) - expect).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "smollm3"])
def test_sliding_layers_without_layer_types_as_hf_picks_them(family, tmp_path):
    """A config with ``use_sliding_window`` and no ``layer_types`` (as transformers 4 wrote them): the layers that
    slide are those HF's own config class picks (Qwen2/Qwen3: from ``max_window_layers`` on, its default 28 when
    absent; SmolLM3: the NoPE layers), and the logits of a 20-token row (past the window of 4) are HF's."""
    import json

    import transformers
    from helpers import save_tiny_hf

    kw = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    if family == "qwen3":
        path = save_tiny_hf(tmp_path / family, "qwen3", layers=4, **kw)
    else:
        path = save_tiny_family(tmp_path / family, family, **kw, **({"no_rope_layer_interval": 2}
                                                                      if family == "smollm3" else {}))
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg.pop("layer_types")
    (tmp_path / family / "config.json").write_text(json.dumps(cfg))
    hf_cls = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "smollm3": "SmolLM3Config"}[family]
    longer = {k: v for k, v in cfg.items() if k not in ("max_window_layers", "no_rope_layers")}
    for variant in (cfg, {**longer, "num_hidden_layers": 30}):  # HF's defaults: 28 windowless layers, every 2nd NoPE
        picked = getattr(transformers, hf_cls)(**variant).layer_types
        assert [w is not None for w in read_spec(variant).windows] == [t == "sliding_attention" for t in picked]
    target = load_target(path)
    assert any(w == 4 for w in target.windows) and None in target.windows
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expect = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    assert (target.score(ids) - expect).abs().max().item() < 1e-4
