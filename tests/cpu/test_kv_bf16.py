"""bf16 KV caches in our fused ops (csrc/ops.cpp): ``rope_store`` rotates in fp32 and rounds only as it stores,
the ``attend_cache`` op over a bf16 cache is bit-identical to the same call over that cache converted to fp32 (what
runs where the bf16 dot-product attention does not: test_attention_bf16.py), for every
code path (the grouped kernel for head_dim 32/64/128, the per-query loop otherwise) and whatever queries share the
call; the fp32 caches' results are unchanged by the templating (the reference loop and the grouped kernel agree)."""

from __future__ import annotations

import pytest
import torch
from helpers import cache_attention
from test_kernels import _usable

from dspine.cpu import kernels

pytestmark = pytest.mark.skipif(not _usable(), reason="CPU kernels switched off or no C++ compiler")

# (B, T, Hq, Hkv, D, window): D = 16 runs the per-query loop on AVX-512 (D / 16 not in {2, 4, 8}), 32/64/128 the
# grouped kernel (and 16 and 64 keys, so the 16-key score blocks and the remainder both run); 48 is the loop too
SHAPES = [(2, 37, 9, 3, 64, 0), (1, 5, 4, 4, 32, 0), (2, 9, 8, 2, 128, 6), (1, 4, 6, 2, 48, 0),
          (3, 1, 9, 3, 64, 0), (2, 3, 4, 2, 16, 0), (2, 6, 4, 2, 16, 5)]


def _rope_inputs(B: int, T: int, Hq: int, Hkv: int, D: int, g: torch.Generator, start: torch.Tensor):
    pos = start[:B, None] + torch.arange(T)
    theta = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos.float()[..., None] * theta] * 2, -1)
    return (torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hkv, D, generator=g),
            torch.randn(B, T, Hkv, D, generator=g), emb.cos(), emb.sin(), pos)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"D{s[4]}T{s[1]}" for s in SHAPES])
def test_rope_store_into_bf16_rounds_the_fp32_result(shape):
    B, T, Hq, Hkv, D, _ = shape
    g = torch.Generator().manual_seed(D + T)
    q, k, v, cos, sin, pos = _rope_inputs(B, T, Hq, Hkv, D, g, torch.tensor([3, 20, 0]))
    cap = int(pos.max()) + 5
    old_k, old_v = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)
    kc32, vc32 = old_k.clone(), old_v.clone()
    q32 = kernels.rope_store(q.clone(), k, v, cos, sin, kc32, vc32, pos)
    kc16, vc16 = old_k.bfloat16(), old_v.bfloat16()
    q16 = kernels.rope_store(q.clone(), k, v, cos, sin, kc16, vc16, pos)
    assert torch.equal(q16, q32)  # q never touches the cache's type
    assert torch.equal(kc16.view(torch.int16), kc32.bfloat16().view(torch.int16))  # torch's rounding, bit for bit
    assert torch.equal(vc16.view(torch.int16), vc32.bfloat16().view(torch.int16))
    # slots not written keep their old values
    untouched = torch.ones(B, cap, dtype=torch.bool)
    untouched[torch.arange(B)[:, None], pos] = False
    assert torch.equal(kc16.transpose(1, 2)[untouched], old_k.bfloat16().transpose(1, 2)[untouched])


@pytest.mark.parametrize("shape", SHAPES, ids=[f"D{s[4]}T{s[1]}W{s[5]}" for s in SHAPES])
def test_attend_over_bf16_is_attend_over_its_fp32_values(shape):
    B, T, Hq, Hkv, D, window = shape
    g = torch.Generator().manual_seed(7 * D + T)
    cap = 64
    kc, vc = torch.randn(B, Hkv, cap, D, generator=g).bfloat16(), torch.randn(B, Hkv, cap, D, generator=g).bfloat16()
    q = torch.randn(B, T, Hq, D, generator=g)
    pos = torch.tensor([3, 20, 0])[:B, None] + torch.arange(T)
    args = (pos, window, D**-0.5)
    attend = torch.ops.dspine_cpu.attend_cache  # the fp32-order op (kernels.attend_cache may pick bf16 dots)
    got = attend(q, kc, vc, *args)
    assert got.dtype == torch.float32
    assert torch.equal(got, attend(q, kc.float(), vc.float(), *args))
    ref = torch.ops.dspine_cpu.attend_cache_ref
    assert torch.equal(ref(q, kc, vc, *args), ref(q, kc.float(), vc.float(), *args))
    assert torch.equal(got, ref(q, kc, vc, *args))  # the grouped kernel keeps the loop's order over bf16 too
    for t in {0, T // 2, T - 1}:  # a query alone gives its bits inside the many-query call
        alone = attend(q[:, t : t + 1], kc, vc, pos[:, t : t + 1], window, D**-0.5)
        assert torch.equal(alone[:, 0], got[:, t])
    # and it is attention: close to the fp32 torch computation over the same (bf16) values
    torch.testing.assert_close(got, cache_attention(q, kc, vc, pos, window), rtol=1e-5, atol=1e-5)


def test_mixed_or_other_cache_dtypes_are_refused():
    q = torch.randn(1, 2, 4, 32)
    kc = torch.zeros(1, 2, 8, 32)
    pos = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.attend_cache(q, kc, kc.bfloat16(), pos, 0, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.attend_cache(q, kc.half(), kc.half(), pos, 0, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rope_store(q.clone(), torch.zeros(1, 2, 2, 32), torch.zeros(1, 2, 2, 32), torch.ones(1, 2, 32),
                           torch.zeros(1, 2, 32), kc.half(), kc.half(), pos)
