"""Attention over a bf16 KV cache on bf16 dot products (csrc/attention_bf16.cpp), the bf16 policy's attention.

Batch invariance by construction: a query's bits depend on its q, its position (and window) and the cache rows it
sees, never on the other queries of the call, their number, order or row. Checked here query by query against
the same query alone, in chunks of other sizes, in another batch row, with other rows beside it; and it is
attention: close to fp32 softmax attention over the same bf16 keys and values (the query and the softmax weights
are rounded to bf16, so to bf16's precision, not fp32's).
"""

from __future__ import annotations

import pytest
import torch
from helpers import cache_attention
from test_kernels import _usable

from dspine.cpu import kernels

pytestmark = pytest.mark.skipif(not (_usable() and kernels.load() == "avx512" and kernels.bf16dp_ok()),
                                reason="needs the avx512 kernels on a CPU with AVX512-BF16")



def attend(q, kc, vc, pos, window, scale):
    return torch.ops.dspine_cpu.attend_cache_bf16dp(q, kc, vc, pos, window, scale)


# (B, T, Hq, Hkv, D, window, cap): every head_dim it has tiles for, 1-4 query heads a KV head, odd and even key
# counts, windows, more than 16 keys (the 16-key score blocks) and fewer
SHAPES = [(2, 37, 9, 3, 64, 0, 64), (1, 21, 4, 4, 32, 0, 40), (2, 9, 8, 2, 128, 6, 48), (3, 1, 9, 3, 64, 0, 64),
          (2, 19, 4, 1, 64, 5, 64), (1, 40, 6, 2, 32, 0, 48)]


def _inputs(B, T, Hq, Hkv, D, cap, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g)
    kc = torch.randn(B, Hkv, cap, D, generator=g).bfloat16()
    vc = torch.randn(B, Hkv, cap, D, generator=g).bfloat16()
    pos = torch.tensor([3, 0, 7])[:B, None] + torch.arange(T)
    return q, kc, vc, pos


@pytest.mark.parametrize("shape", SHAPES, ids=[f"D{s[4]}T{s[1]}H{s[2]}/{s[3]}W{s[5]}" for s in SHAPES])
def test_every_query_has_its_own_bits_whatever_shares_the_call(shape):
    B, T, Hq, Hkv, D, window, cap = shape
    q, kc, vc, pos = _inputs(B, T, Hq, Hkv, D, cap, seed=D + T)
    sc = D**-0.5
    got = attend(q, kc, vc, pos, window, sc)
    assert got.shape == (B, T, Hq * D) and got.dtype == torch.float32
    for t in range(T):  # alone
        assert torch.equal(attend(q[:, t : t + 1], kc, vc, pos[:, t : t + 1], window, sc)[:, 0], got[:, t]), t
    for size in (3, 8, 16):  # in chunks of other sizes
        parts = [attend(q[:, s : s + size], kc, vc, pos[:, s : s + size], window, sc) for s in range(0, T, size)]
        assert torch.equal(torch.cat(parts, 1), got)
    if B > 1:  # in another batch row, beside other rows, queries reversed
        flip = [B - 1 - b for b in range(B)]
        rev = attend(q[flip].flip(1), kc[flip], vc[flip], pos[flip].flip(1), window, sc)
        assert torch.equal(rev[flip].flip(1), got)
    for b in range(B):  # a row alone
        one = attend(q[b : b + 1], kc[b : b + 1], vc[b : b + 1], pos[b : b + 1], window, sc)
        assert torch.equal(one, got[b : b + 1])


@pytest.mark.parametrize("shape", SHAPES, ids=[f"D{s[4]}T{s[1]}W{s[5]}" for s in SHAPES])
def test_it_is_attention_to_bf16_precision(shape):
    B, T, Hq, Hkv, D, window, cap = shape
    q, kc, vc, pos = _inputs(B, T, Hq, Hkv, D, cap, seed=3 * D + T)
    got = attend(q, kc, vc, pos, window, D**-0.5)
    want = cache_attention(q, kc, vc, pos, window)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    assert (got - want).norm() / want.norm() < 0.01
    # and the fp32-order op over the same cache is the fp32 answer, the bf16 one differs only in low bits
    fp32_order = torch.ops.dspine_cpu.attend_cache(q, kc, vc, pos, window, D**-0.5)
    torch.testing.assert_close(fp32_order, want, rtol=1e-5, atol=1e-5)


def test_slots_past_a_query_are_never_read():
    """The odd last key pairs with a zero row and a zero weight: a NaN or inf in the next (unwritten or
    rolled-back) slot must not reach the output, nor any slot past the query's position."""
    q, kc, vc, pos = _inputs(1, 5, 4, 2, 64, 16, seed=11)
    pos = torch.tensor([[0, 2, 4, 6, 8]])
    clean = attend(q, kc, vc, pos, 0, 0.125)
    kc[:, :, 9:], vc[:, :, 9:] = float("nan"), float("inf")
    dirty = attend(q, kc, vc, pos, 0, 0.125)
    assert torch.equal(dirty, clean) and torch.isfinite(dirty).all()
    # slot 1 poisoned: query 0 (sees slot 0 alone: an odd count) is unaffected, the others see it
    kc2, vc2 = kc.clone(), vc.clone()
    vc2[:, :, 1] = float("inf")
    poisoned = attend(q, kc2, vc2, pos, 0, 0.125)
    assert torch.equal(poisoned[:, 0], clean[:, 0]) and not torch.isfinite(poisoned[:, 1:]).all()


def test_kernels_attend_cache_picks_it_for_bf16_caches_only():
    q, kc, vc, pos = _inputs(1, 6, 4, 2, 64, 16, seed=2)
    assert kernels.bf16_attention(64) and not kernels.bf16_attention(16)
    assert torch.equal(kernels.attend_cache(q, kc, vc, pos, 0, 0.125), attend(q, kc, vc, pos, 0, 0.125))
    f32 = kernels.attend_cache(q, kc.float(), vc.float(), pos, 0, 0.125)
    assert torch.equal(f32, torch.ops.dspine_cpu.attend_cache(q, kc.float(), vc.float(), pos, 0, 0.125))
    with pytest.raises(RuntimeError, match="head_dim 32, 64 or 128"):
        attend(torch.randn(1, 2, 4, 16), kc[..., :16].contiguous(), vc[..., :16].contiguous(), pos[:, :2], 0, 1.0)
