"""The KV cache's element type (``Target.kv_dtype`` / ``set_kv_dtype``, ``load_target(kv_dtype=)``): bf16 under the
bf16 policy, fp32 otherwise; a position's keys, values and hidden state under bf16 KV do not depend on the batch,
on how the prompt was cut or on the forward's width; GGUF-block weights under the bf16 policy give the bf16 panels'
bits."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_hf

from dspine import load_target
from dspine.cpu import kernels

needs_bf16 = pytest.mark.skipif(kernels.disabled() or kernels.load() is None or not kernels.bf16dp_ok(),
                                reason="no AVX512-BF16 on this CPU (or the kernels are off)")
# head_dim 32: the grouped attention kernel on AVX-512 (the conftest models' 16 runs the per-query loop)
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("wide"), "llama", **WIDE)


def _q4_1_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """Per 32 columns d * q + m, q in 0..15 (both ends hit), d and m float16: a GGUF Q4_1 weight's values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return (d[..., None] * q + m[..., None]).reshape(n, k)


def _q8_0_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """Per 32 columns d * q, q in -127..127, d float16: a GGUF Q8_0 weight's values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 5] = 127
    d = (torch.rand(n, k // 32, generator=g) * 0.04).half().float()
    return (d[..., None] * q).reshape(n, k)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """The wide model with every decoder linear on a Q4_1 grid and the (tied) embeddings on a Q8_0 grid, as the
    embedded SmolLM2 GGUF converts: the kernels keep such weights as blocks."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_hf(tmp_path_factory.mktemp("gguf"), "llama", **WIDE)
    f = f"{path}/model.safetensors"
    state = load_file(f)
    for i, (name, w) in enumerate(sorted(state.items())):
        if name.endswith("proj.weight"):
            state[name] = _q4_1_grid(*w.shape, seed=i)
        elif name.endswith("embed_tokens.weight"):
            state[name] = _q8_0_grid(*w.shape, seed=i)
    save_file(state, f, metadata={"format": "pt"})
    return path


def test_fp32_policy_keeps_fp32_kv(wide_dir):
    t = load_target(wide_dir)
    assert t.kv_dtype == torch.float32 and t.kernel == f"dspine-{kernels.load()}"
    assert {layer.k.dtype for layer in t.new_cache(2, 8).layers} == {torch.float32}


def test_kv_dtype_needs_our_attention(wide_dir, hybrid_target):
    with pytest.raises(ValueError, match="fused attention"):
        load_target(wide_dir, kernels=False, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fused attention"):
        hybrid_target.set_kv_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        load_target(wide_dir, kv_dtype=torch.float16)
    assert load_target(wide_dir, kernels=False, kv_dtype=torch.float32).kv_dtype == torch.float32  # already so


@needs_bf16
def test_bf16_policy_stores_bf16_kv_and_says_so(wide_dir):
    t = load_target(wide_dir, dtype=torch.bfloat16)
    isa = kernels.bf16_isa()  # avx512+amx where the bf16 family runs on AMX tiles
    assert t.dtype == torch.float32 and t.kv_dtype == torch.bfloat16
    assert t.kernel == f"dspine-{isa}-bf16-kvbf16dp"  # head_dim 32: attention on bf16 dot products
    cache = t.new_cache(2, 8)
    assert {(layer.k.dtype, layer.v.dtype) for layer in cache.layers} == {(torch.bfloat16, torch.bfloat16)}
    wide = load_target(wide_dir, dtype=torch.bfloat16, kv_dtype=torch.float32)  # main's bf16 policy, its name
    assert wide.kernel == f"dspine-{isa}-bf16" and wide.kv_dtype == torch.float32
    ids = torch.randint(0, t.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    a, b = t.score(ids), wide.score(ids)
    assert not torch.equal(a, b)  # the keys and values really were rounded
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    # switching back and forth renames it
    t.set_kv_dtype(torch.float32)
    assert t.kernel == wide.kernel and torch.equal(t.score(ids), b)
    t.set_kv_dtype(torch.bfloat16)
    assert t.kernel.endswith("-kvbf16dp") and torch.equal(t.score(ids), a)


@needs_bf16
def test_bf16_kv_positions_do_not_depend_on_batch_or_cuts(wide_dir):
    """Each row's keys, values and hidden states are bit-identical alone, in a ragged batch, with the prompt read in
    pieces (chunked prefill, a prefix-cache hit continued) and as a verify-shaped forward."""
    t = load_target(wide_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    lens = [5, 23, 40]
    ids = torch.randint(0, t.vocab_size, (3, 40), generator=g)
    with torch.no_grad():
        batch = t.new_cache(3, 48)
        hb = t.forward(ids, batch, n_valid=torch.tensor(lens)).hidden  # right-padded rows
        for b, n in enumerate(lens):
            alone = t.new_cache(1, 48)
            ha = t.forward(ids[b : b + 1, :n], alone).hidden
            assert torch.equal(ha[0], hb[b, :n])
            for la, lb in zip(alone.layers, batch.layers):
                assert torch.equal(la.k[0, :, :n], lb.k[b, :, :n]) and torch.equal(la.v[0, :, :n], lb.v[b, :, :n])
            cut = t.new_cache(1, 48)  # 3 pieces, the last a 4-token "verify" forward
            a = min(n // 2, n - 4)
            pieces = [ids[b : b + 1, :a], ids[b : b + 1, a : n - 4], ids[b : b + 1, n - 4 : n]]
            hs = [t.forward(p, cut).hidden for p in pieces if p.shape[1]]
            assert torch.equal(torch.cat(hs, 1)[0], ha[0])
            for la, lc in zip(alone.layers, cut.layers):
                assert torch.equal(la.k[0, :, :n], lc.k[0, :, :n]) and torch.equal(la.v[0, :, :n], lc.v[0, :, :n])


@needs_bf16
def test_gguf_blocks_under_bf16_give_the_bf16_panels_bits(gguf_dir):
    """The decode-friendly block formats (bf16dp_q4_1/q8_0: 0.75 / 1.125 bytes a weight) compute exactly what the bf16
    panels compute (2 bytes a weight), end to end, at every forward width; fp32 keeps its own block formats."""
    from dspine.cpu.kernels import BF16DP

    blocks = load_target(gguf_dir, dtype=torch.bfloat16)
    layers = blocks.num_layers
    assert kernels.weight_formats(blocks) == {"bf16dp_q4_1": 4 * layers, "bf16dp_q8_0": 1}
    panels = load_target(gguf_dir, kernels=False).use_kernels(formats=(BF16DP,)).set_kv_dtype(torch.bfloat16)
    assert kernels.weight_formats(panels) == {BF16DP: 4 * layers + 1}
    assert panels.kernel == blocks.kernel  # same bits, same name
    assert kernels.weight_formats(load_target(gguf_dir)) == {"q4_1": 4 * layers, "q8_0": 1}
    ids = torch.randint(0, blocks.vocab_size, (3, 37), generator=torch.Generator().manual_seed(2))
    assert torch.equal(blocks.score(ids), panels.score(ids))
    with torch.no_grad():
        for t in (1, 4, 17):  # decode- and verify-shaped forwards over a filled cache
            cb, cp = blocks.new_cache(3, 60), panels.new_cache(3, 60)
            blocks.forward(ids[:, :20], cb)
            panels.forward(ids[:, :20], cp)
            hb = blocks.forward(ids[:, 20 : 20 + t], cb).hidden
            assert torch.equal(blocks.logits(hb), panels.logits(panels.forward(ids[:, 20 : 20 + t], cp).hidden))
