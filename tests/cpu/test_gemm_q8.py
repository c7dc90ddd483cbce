"""The integer families of linears (quant=q8 / q16, csrc/gemm_q8.cpp): GGUF Q4_1/Q8_0 blocks times input rows
quantised per block of 32 to one or two int8 parts, integer dot products. What they compute (against the same
quantisation done in torch), that a row's bits never depend on the row count, its place, the tile or the chunk that
computed it, and that every integer dot product this CPU can run (AVX512-VNNI, AVX2, the AVX2 and portable builds)
gives the same bits (issue 34)."""

from __future__ import annotations

import pytest
import torch
from test_gemm import HEAD, _mismatches
from test_kernels import _in_subprocess, _q4_1_grid, _q8_0_grid, _usable

from dspine.cpu import kernels

pytestmark = pytest.mark.skipif(not _usable(), reason="CPU kernels switched off or no C++ compiler")

Q8 = {kernels.Q8DP_Q4_1: (_q4_1_grid, 0.625, 1), kernels.Q8DP_Q8_0: (_q8_0_grid, 1.0625, 1),  # maker, bytes a weight,
      kernels.Q16DP_Q4_1: (_q4_1_grid, 0.625, 2), kernels.Q16DP_Q8_0: (_q8_0_grid, 1.0625, 2)}  # int8 parts
EVERY_M = (*range(1, 41), 63, 64, 65, 191, 192, 193, 200, 1390)  # every decode / verify height, the static split's
# edge, the prompt path's row chunks


def quantised_reference(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """x's rows quantised per block of 32 the kernel's way (t = x 127 / max|x|, q = t rounded to nearest even; two
    parts: q2 = 256 (t - q) rounded, x = max|x| / 127 (q + q2 / 256)), times w, in float64: the kernel's products are
    exact, so it differs from this by its fp32 sums only."""
    m, k = x.shape
    q, q2, amax = _quantised(x)
    if parts == 2:
        q = q.double() + q2.double() / 256
    return ((q.double() * (amax / 127.0).double()).reshape(m, k) @ w.double().T).float()


def _quantised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's rows per block of 32 as the kernel quantises them: q, q2 [m, k / 32, 32] and max|x| [m, k / 32, 1]."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    t = blocks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(t)
    return q, torch.round((t - q) * 256).clamp(-127, 127), amax


def _inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[3] *= 1e-3  # small and large rows, and a block of zeros (scale 0)
    x[5] *= 1e3
    x[7, :32] = 0
    return x


@pytest.mark.parametrize("fmt", list(Q8))
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 49), (96, 200)])
def test_q8_rows_are_bit_identical_whatever_the_row_count(fmt, k, n):
    """N that is no multiple of the 16-column panel included; every height 1-40 (the register tiles, balanced), the
    static/pulled and row-chunk edges, and rows at other offsets and alone."""
    make, per_weight, parts = Q8[fmt]
    w = make(n, k, 11)
    lin = kernels.PackedLinear(w, formats=(fmt,))
    assert lin.format == fmt
    assert lin.packed.nbytes == -(-n // 16) * 16 * k * per_weight  # GGUF's bytes, float16 scales
    x = _inputs(max(EVERY_M), k, k + n)
    full = lin(x)
    for m in EVERY_M:
        assert torch.equal(lin(x[:m]), full[:m]), m
    assert _mismatches(lin, x) == []
    want = quantised_reference(x[:97], w, parts)
    torch.testing.assert_close(full[:97], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("policy", list(kernels.INT_FORMATS))
def test_q8_head_rows_are_bit_identical(policy):
    k, n = HEAD
    lin = kernels.PackedLinear(_q8_0_grid(n, k, 12), formats=kernels.INT_FORMATS[policy])
    assert lin.format == kernels.INT_FORMATS[policy][1]  # Q4_1 tried first: not a Q4_1 grid
    x = _inputs(300, k, 3)
    assert _mismatches(lin, x, rows=(1, 8, 9, 17, 64, 65, 97, 300)) == []


@pytest.mark.parametrize("policy", list(kernels.INT_FORMATS))
def test_q8_formats_take_only_exact_blocks_and_keep_nan_in_its_row(policy):
    # K not a whole number of blocks, or a weight off the grids: no integer format (the policy's fallbacks take it)
    formats = kernels.INT_FORMATS[policy]
    assert kernels.PackedLinear(_q4_1_grid(50, 64, 1)[:, :48].contiguous(), formats=formats).format == "f32"
    assert kernels.PackedLinear(torch.randn(50, 64), formats=formats).format == "f32"
    lin = kernels.PackedLinear(_q4_1_grid(40, 64, 2), formats=formats)
    x = _inputs(9, 64, 5)
    clean = lin(x)
    x[4, 40] = float("nan")
    got = lin(x)
    assert got[4].isnan().all() and torch.equal(torch.cat([got[:4], got[5:]]), torch.cat([clean[:4], clean[5:]]))


def _largest_q4_1_sums(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_1 weight whose blocks are all nibble 15 but one (its minimum), and input rows whose int8 parts reach
    |q| = 127 and |q2| = 127 with one sign a row: the largest integer sums a block can make (AVX2 sums a block's
    products in int16 pairs: 8 x 2 x 15 x 127 = 30,480 at most, Avx2::PAIRS16)."""
    g = torch.Generator().manual_seed(5)
    q = torch.full((n, k // 32, 32), 15.0)
    q[..., 0] = 0
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    m = (torch.rand(n, k // 32, generator=g) * 0.05).half().float()
    w = (d[..., None] * q + m[..., None]).reshape(n, k)
    t = torch.full((k // 32, 32), 126.4961)  # q = 126, q2 = round(0.4961 * 256) = 127
    t[:, 0] = 127.0  # the block's max: q = 127 exactly
    row = (t / 127.0).reshape(k)
    x = torch.stack([row, -row, row * 3.5, (t.round() / 127.0).reshape(k)])
    return w, x


@pytest.mark.parametrize("fmt", [kernels.Q8DP_Q4_1, kernels.Q16DP_Q4_1])
def test_the_largest_sums_a_q4_1_block_can_make_are_exact(fmt):
    """No integer sum wraps: a wrapped int16 sum would be off by 65,536 units of a block's scale, far outside the
    reference's fp32 rounding."""
    _, _, parts = Q8[fmt]
    w, x = _largest_q4_1_sums(40, 576)
    lin = kernels.PackedLinear(w, formats=(fmt,))
    assert lin.format == fmt
    # the int16 pair sums this input makes, per row and block, as the kernel forms them: near 2^15
    q, q2, _ = _quantised(x)
    assert (q.abs().sum(-1) * 15 - 15 * 127).max() >= 29_000 and (q2.abs().sum(-1) * 15).max() >= 29_000
    got = lin(x)
    want = quantised_reference(x, w, parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


CHECK_DOT = """
import json, torch
import sys; sys.path[:0] = ["tests/cpu", "tests"]
from test_gemm_q8 import Q8, _inputs, _largest_q4_1_sums, _q4_1_grid
from dspine.cpu import kernels
isa = kernels.load()
out = {"isa": isa, "dot": torch.ops.dspine_cpu.q8_dot(), "sums": []}
for fmt, (make, _, _) in Q8.items():
    lin = kernels.PackedLinear(make(200, 576, 11), formats=(fmt,))
    y = lin(_inputs(97, 576, 7)).double()
    out["sums"].append([float(y.sum()), float((y * torch.arange(y.numel()).view_as(y)).sum()), y.abs().max().item()])
    if make is _q4_1_grid:  # and the largest sums a block can make (int16 pairs on AVX2)
        w, x = _largest_q4_1_sums(40, 576)
        out["sums"].append(kernels.PackedLinear(w, formats=(fmt,))(x).double().flatten().tolist())
print(json.dumps(out))
"""


def _dot_bits(**env: str) -> dict:
    return _in_subprocess(CHECK_DOT, **env)


def test_every_integer_dot_product_gives_the_same_bits():
    """AVX512-VNNI and the AVX2 code in the avx512 build, and the AVX2 build: the same integers, the same fp32
    operations in the same order, so the same outputs (checksums of 97 x 200 outputs, positions weighted), for each
    format and part count."""
    here = _dot_bits()
    assert here["isa"] == kernels.load()
    others = []
    if here["dot"] == "vnni512":
        others.append(_dot_bits(DSPINE_Q8_DOT="avx2"))
        assert others[-1]["dot"] == "avx2"
    if kernels.cpu_isa() == "avx512":
        others.append(_dot_bits(DSPINE_KERNELS="avx2"))
        assert others[-1]["isa"] == "avx2" and others[-1]["dot"] == "avx2"
    if not others:
        pytest.skip("one integer dot product on this CPU")
    for other in others:
        assert other["sums"] == here["sums"]


@pytest.mark.slow
def test_the_portable_build_gives_the_same_bits():
    got = _dot_bits(DSPINE_KERNELS="generic")
    assert got["isa"] == "generic" and got["dot"] == "portable"
    assert got["sums"] == _dot_bits()["sums"]
