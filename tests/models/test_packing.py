"""Packed ragged forwards: with ``n_valid`` on the CPU kernels a dense target computes only the valid tokens
(``layers.Packing``). Each valid token's hidden state, taps and cache entries must be bit-identical to the padded
forward's, and to the row run alone, in fp32 and under the bf16 policy; padded slots come back as zeros."""

from __future__ import annotations

import pytest
import torch
from family_models import save_tiny_gemma4
from helpers import save_tiny_hf

from dspine import load_target
from dspine.cpu import kernels

pytestmark = pytest.mark.skipif(kernels.disabled() or kernels.load() is None, reason="no CPU kernels here")


@pytest.fixture(scope="module", params=["llama-fp32", "qwen3-fp32", "llama-bf16", "gemma4-fp32", "gemma4-bf16"])
def target(request, tmp_path_factory):
    family, dtype = request.param.split("-")
    if dtype == "bf16" and not kernels.bf16dp_ok():
        pytest.skip("no AVX512-BF16 here")
    where = tmp_path_factory.mktemp(request.param)
    if family == "gemma4":  # per-layer inputs, KV-shared layers, keys = values on the full layers (``GEMMA4``)
        path = save_tiny_gemma4(where)
    else:
        path = save_tiny_hf(where, family, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    t = load_target(path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert t.fused_attention()
    return t


def _context(target, lens, seed):
    g = torch.Generator().manual_seed(seed)
    cache = target.new_cache(len(lens), 64)
    ids = torch.randint(1, target.vocab_size, (len(lens), max(lens)), generator=g)
    target.forward(ids, cache, n_valid=torch.tensor(lens))
    return cache, ids


@pytest.mark.parametrize("speculative", [True, False])
def test_packed_tokens_equal_padded_and_alone(target, speculative):
    lens, n_new = [5, 9, 3, 7], [4, 1, 0, 6]  # row 2 computes nothing (a finished row kept in the batch)
    T = max(n_new)
    new = torch.randint(1, target.vocab_size, (4, T), generator=torch.Generator().manual_seed(3))
    taps = (0, 1)
    cache, _ = _context(target, lens, seed=1)
    packed = target.forward(new, cache, n_valid=torch.tensor(n_new), speculative=speculative, taps=taps)
    assert cache.lengths.tolist() == (lens if speculative else [a + b for a, b in zip(lens, n_new)])
    # the padded forward: every row T tokens, no n_valid (nothing packed)
    cache_pad, _ = _context(target, lens, seed=1)
    padded = target.forward(new, cache_pad, speculative=True, taps=taps)
    for b, n in enumerate(n_new):
        assert torch.equal(packed.hidden[b, :n], padded.hidden[b, :n])
        assert torch.equal(packed.taps[b, :n], padded.taps[b, :n])
        assert not packed.hidden[b, n:].any()  # padded slots are zeros
        # a row with nothing to compute reads and writes slot 0 only (``DenseTarget.forward``): a finished row's
        # slot, overwritten whole before it is read again
        lo = 1 if n == 0 else 0
        for x, y in zip(cache.layers, cache_pad.layers):
            end = lens[b] + n
            assert torch.equal(x.k[b, :, lo:end], y.k[b, :, lo:end])
            assert torch.equal(x.v[b, :, lo:end], y.v[b, :, lo:end])
        if n:  # the same row on its own, one row in the forward
            # the context row was prefilled beside others: rebuild it alone from the same ids
            ctx_ids = torch.randint(1, target.vocab_size, (4, max(lens)), generator=torch.Generator().manual_seed(1))
            alone = target.new_cache(1, 64)
            target.forward(ctx_ids[b : b + 1, : lens[b]], alone)
            one = target.forward(new[b : b + 1, :n], alone, speculative=True, taps=taps)
            assert torch.equal(one.hidden[0], packed.hidden[b, :n])


def test_padded_queries_skip_attention():
    """``Positions.queries``: a packed forward's padded slots read position -1, which the attention kernels skip
    (zeros, no key read); valid slots keep their positions, and an unpacked forward reads ``pos`` itself."""
    from dspine.models.layers import Packing, Positions

    pos = torch.tensor([[5, 6, 7], [2, 3, 4]])
    packed = Packing.of(torch.tensor([3, 1]), 2, 3)
    at = Positions.of(pos)
    assert at.queries(None) is pos
    assert at.queries(packed).tolist() == [[5, 6, 7], [2, -1, -1]]
    B, T, H, D = 2, 3, 2, 32
    q = torch.randn(B, T, H, D)
    kc, vc = torch.randn(B, 1, 16, D), torch.randn(B, 1, 16, D)
    full = kernels.attend_cache(q, kc, vc, pos, None, 0.2).view(B, T, H, D)
    skipped = kernels.attend_cache(q, kc, vc, at.queries(packed), None, 0.2).view(B, T, H, D)
    assert torch.equal(skipped[0], full[0]) and torch.equal(skipped[1, 0], full[1, 0])  # the valid queries' bits
    assert not skipped[1, 1:].any() and full[1, 1:].abs().sum() > 0  # padded: not computed
