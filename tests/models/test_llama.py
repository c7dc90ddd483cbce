"""Dense targets (Llama, Qwen3) against Hugging Face transformers' own implementations (the oracle)."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_hf

from dspine import load_target


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("mode", ["torch", "torch_fused", "kernels"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("length", [1, 7, 33, 100])
def test_logits_match_transformers(family, length, mode, llama_dir, qwen3_dir):
    """torch's modules, with fused projections, and our CPU kernels (dspine.cpu.kernels; the default, which fuses)."""
    from dspine.cpu import kernels

    if mode == "kernels" and kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    path = {"llama": llama_dir, "qwen3": qwen3_dir}[family]
    ours, ref = load_target(path, fuse=mode == "torch_fused", kernels=mode == "kernels"), _hf(path)
    assert (ours.layers[0].self_attn.qkv_proj is not None) == (mode != "torch")
    assert ours.kernel.startswith("dspine-") == (mode == "kernels")
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expect = ref(ids).logits
    assert (ours.score(ids) - expect).abs().max().item() < 1e-4


def test_llama3_rope_scaling_and_untied_head(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = save_tiny_hf(tmp_path, "llama", rope_scaling=scaling, tie_word_embeddings=False)
    ours, ref = load_target(path), _hf(path)
    assert ours.lm_head is not None
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = ref(ids).logits
    assert (ours.score(ids) - expect).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_incremental_ragged_batch_equals_score(family, llama_target, qwen3_target):
    t = {"llama": llama_target, "qwen3": qwen3_target}[family]
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (5, 17, 30)]
    lens = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(3, 30, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    cache = t.new_cache(3, 8)  # grows on demand
    out = t.forward(ids, cache, n_valid=lens)
    assert cache.lengths.tolist() == [5, 17, 30]
    nxt = torch.randint(0, 256, (3, 4), generator=g)
    step = t.forward(nxt, cache, speculative=True)  # verify-style: nothing committed yet
    assert cache.lengths.tolist() == [5, 17, 30]
    t.commit(cache, torch.tensor([1, 4, 2]))
    assert cache.lengths.tolist() == [6, 21, 32]
    for b, s in enumerate(seqs):
        full = t.score(torch.cat([s, nxt[b]])[None])[0]
        assert torch.allclose(t.logits(out.hidden[b, : len(s)]), full[: len(s)], atol=1e-4)
        assert torch.allclose(t.logits(step.hidden[b]), full[len(s) :], atol=1e-4)
    # after a partial commit, the next token continues from the committed prefix only
    last = torch.randint(0, 256, (3, 1), generator=g)
    cont = t.forward(last, cache)
    for b, (s, n) in enumerate(zip(seqs, [1, 4, 2])):
        full = t.score(torch.cat([s, nxt[b, :n], last[b]])[None])[0, -1]
        assert torch.allclose(t.logits(cont.hidden[b, 0]), full, atol=1e-4)


def test_taps_are_layer_outputs(llama_dir, llama_target):
    ref = _hf(llama_dir)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    # HF's last entry is after the final norm, so compare inner layers (taps never include the last layer)
    out = llama_target.forward(ids, llama_target.new_cache(1, 12), taps=(1, 0))
    assert torch.allclose(out.taps[..., :64], hs[2], atol=1e-5)
    assert torch.allclose(out.taps[..., 64:], hs[1], atol=1e-5)


def test_cache_select_and_concat(llama_target):
    from dspine.models.cache import ModelCache

    t = llama_target
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 256, (2, 6), generator=g), torch.randint(0, 256, (1, 9), generator=g)
    ca, cb = t.new_cache(2, 6), t.new_cache(1, 40)
    t.forward(a, ca)
    t.forward(b, cb)
    merged = ModelCache.concat([ca.select([1]), cb])
    nxt = torch.randint(0, 256, (2, 1), generator=g)
    out = t.logits(t.forward(nxt, merged).hidden)[:, 0]
    assert torch.allclose(out[0], t.score(torch.cat([a[1], nxt[0]])[None])[0, -1], atol=1e-4)
    assert torch.allclose(out[1], t.score(torch.cat([b[0], nxt[1]])[None])[0, -1], atol=1e-4)
