"""Prompt-shaped (many-row) linears: every output element is bit-identical whatever the row count, the row's place
and the code path that computed it (issue 26, docs/design.md "The CPU step"), for the fp32 family (each weight
format, each ISA build this CPU runs) and the bf16 family (AVX512-BF16); the prefix cache relies on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _bf16_grid, _in_subprocess, _q4_1_grid, _q8_0_grid, _usable

from dspine import generate, load_target
from dspine.cpu import kernels

pytestmark = pytest.mark.skipif(not _usable(), reason="CPU kernels switched off or no C++ compiler")

ROWS = (1, 3, 5, 7, 8, 96, 97, 200, 1390)  # 1: a decode tile (compact blocks expanded in registers); 3, 5, 8: the
# first row tile from the blocks, storing what it expands, and fp32 row tiles (3 x 4 on AVX2: a 1-row, a 3-row, two
# 3-row ones) over that; 7, 8 of Q4_1 on AVX-512: one tile of all the rows from the blocks, two columns a pass; 96/97:
# the row-chunk boundary; more: the same once per chunk
MODEL_SHAPES = ((576, 1536), (1536, 576))  # SmolLM2-135M's gate/up and down projections (K, N)
HEAD = (576, 49152)
MAKERS = {"f32": lambda n, k, s: torch.randn(n, k, generator=torch.Generator().manual_seed(s)),
          "q4_1": _q4_1_grid, "q8_0": _q8_0_grid, "bf16": _bf16_grid}


def _mismatches(lin, x: torch.Tensor, rows=ROWS) -> list[str]:
    """Each slice x[s : s + M] (at an offset that moves the rows to other tile positions) against the same rows
    of one forward of all of x, and single rows against it: where the bits differ."""
    full = lin(x)
    bad = []
    for m in rows:
        for start in {0, (x.shape[0] - m) // 3}:
            if not torch.equal(lin(x[start : start + m]), full[start : start + m]):
                bad.append(f"M={m}@{start}")
    for i in (0, 7, x.shape[0] // 2 + 3, x.shape[0] - 1):
        if not torch.equal(lin(x[i : i + 1])[0], full[i]):
            bad.append(f"row {i} alone")
    return bad


@pytest.mark.parametrize("fmt", list(MAKERS))
@pytest.mark.parametrize("k,n", MODEL_SHAPES)
def test_fp32_family_rows_are_bit_identical_whatever_the_row_count(fmt, k, n):
    w = MAKERS[fmt](n, k, 11)
    lin = kernels.PackedLinear(w)
    assert lin.format == fmt  # the compact format really ran (the grids are exact)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
    assert _mismatches(lin, x) == []
    # the compact formats' bits are the fp32 weights' at every row count (expanded in registers for a few rows,
    # into an fp32 scratch tile for many)
    if fmt != "f32":
        ref = kernels.PackedLinear(w, formats=("f32",))
        for m in (1, 5, 97, 1390):
            assert torch.equal(lin(x[:m]), ref(x[:m])), m


@pytest.mark.parametrize("fmt", list(MAKERS))
def test_decode_linears_bits_do_not_depend_on_the_threads(fmt):
    """A decode-shaped linear's tiles are split in one contiguous share per thread, so the thread count moves every
    tile to another thread (and another prefetch neighbour): which thread computes a tile never changes its bits.
    The 1-, 7- and 8-row tiles are the decode step's (7-8: the column-pair tile)."""
    k, n = MODEL_SHAPES[0]
    lin = kernels.PackedLinear(MAKERS[fmt](n, k, 5))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = {m: lin(x[:m]) for m in (1, 7, 8)}
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            for _ in range(5):
                for m, y in want.items():
                    assert torch.equal(lin(x[:m]), y), (threads, m)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["q8_0", "f32"])
def test_fp32_family_head_rows_are_bit_identical(fmt):
    k, n = HEAD
    lin = kernels.PackedLinear(MAKERS[fmt](n, k, 12))
    assert lin.format == fmt
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(3))
    assert _mismatches(lin, x, rows=(1, 5, 96, 97)) == []


CHECK_ISA = """
import json, torch
from dspine.cpu import kernels
import sys; sys.path[:0] = ["tests/cpu", "tests"]
from test_gemm import MAKERS, ROWS, _attention_mismatches, _mismatches
isa = kernels.load()
bad = {"attention": got} if (got := _attention_mismatches()) else {}
for fmt, make in MAKERS.items():
    for k, n in ((576, 1536), (1536, 576)):
        lin = kernels.PackedLinear(make(n, k, 11))
        assert lin.format == fmt
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
        got = _mismatches(lin, x)
        if got:
            bad[f"{fmt} {k}x{n}"] = got
print(json.dumps({"isa": isa, "bad": bad}))
"""


@pytest.mark.parametrize("isa", ["avx2", pytest.param("generic", marks=pytest.mark.slow)])
def test_fp32_family_and_attention_invariance_on_lower_isa_builds(isa):
    if kernels.cpu_isa() == "generic" and isa == "avx2":
        pytest.skip("this CPU has no AVX2")
    assert _in_subprocess(CHECK_ISA, DSPINE_KERNELS=isa) == {"isa": isa, "bad": {}}


needs_bf16 = pytest.mark.skipif(not kernels.bf16dp_ok(), reason="no AVX512-BF16 on this CPU (or not the avx512 build)")


def _amx_here() -> bool:
    """Whether the bf16 family can run on AMX tiles here (the CPU has them, Linux grants them): asked once, the
    default restored."""
    if not kernels.bf16dp_ok():
        return False
    before = kernels.bf16_isa().endswith("+amx")
    ok = kernels.set_bf16_amx(True)
    kernels.set_bf16_amx(before)
    return ok


@pytest.fixture(params=["avx512_bf16", pytest.param("amx", marks=pytest.mark.skipif(
    not _amx_here(), reason="no AMX tiles on this CPU"))])
def bf16_path(request):
    """The bf16 family's tests on each of its paths this CPU runs: AVX512-BF16 tiles, and AMX tiles where it has
    them (the default there). Targets built inside a test carry the path in their kernel name."""
    before = kernels.bf16_isa().endswith("+amx")
    assert kernels.set_bf16_amx(request.param == "amx") == (request.param == "amx")
    yield request.param
    kernels.set_bf16_amx(before)


@needs_bf16
@pytest.mark.parametrize("fmt", list(MAKERS))
@pytest.mark.parametrize("k,n", [*MODEL_SHAPES, (577, 97), (64, 49)])
def test_bf16_family_rows_are_bit_identical_whatever_the_row_count(fmt, k, n, bf16_path):
    """Odd K (a zero pair pads it) and N that is no multiple of the 48-column panel included."""
    w = MAKERS[fmt](n, k, 11) if k % 32 == 0 or fmt in ("f32", "bf16") else MAKERS["f32"](n, k, 11)
    lin = kernels.PackedLinear(w, formats=(kernels.BF16DP,))
    assert lin.format == kernels.BF16DP
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
    assert _mismatches(lin, x) == []
    # what it computes: bf16 weights and inputs, products exact in fp32, fp32 sums (in its own order)
    want = F.linear(x[:97].bfloat16().float(), w.bfloat16().float())
    torch.testing.assert_close(lin(x[:97]), want, rtol=1e-5, atol=1e-5 * k**0.5)


@needs_bf16
def test_bf16_family_head_rows_are_bit_identical(bf16_path):
    k, n = HEAD
    lin = kernels.PackedLinear(_q8_0_grid(n, k, 12), formats=(kernels.BF16DP,))
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(3))
    assert _mismatches(lin, x, rows=(1, 5, 96, 97)) == []


@needs_bf16
def test_bf16_target_is_our_kernels_and_batch_invariant(llama_dir, bf16_path):
    """dtype=bfloat16 on an AVX512-BF16 CPU: every linear in the bf16 family, the rest fp32; a row's prompt
    forward and greedy tokens do not depend on its neighbours or on the prompt being read in one piece."""
    bf16, fp32 = load_target(llama_dir, dtype=torch.bfloat16), load_target(llama_dir)
    hd = bf16.layers[0].self_attn.head_dim
    assert bf16.kernel.endswith("-bf16" + ("-kvbf16dp" if kernels.bf16_attention(hd) else "-kvbf16"))
    assert ("+amx-" in bf16.kernel) == (bf16_path == "amx")  # the path's bits, named
    assert bf16.dtype == torch.float32
    assert set(kernels.weight_formats(bf16)) == {kernels.BF16DP}
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, bf16.vocab_size, (3, 40), generator=g)
    together = bf16.score(ids)
    for b in range(3):
        assert torch.equal(bf16.score(ids[b : b + 1])[0], together[b])
    torch.testing.assert_close(together, fp32.score(ids), rtol=0.05, atol=0.05)
    # a prompt read in two forwards (the second over the cache the first filled) gives its last position's
    # hidden state bit for bit
    with torch.no_grad():
        whole = bf16.forward(ids[:1], bf16.new_cache(1, 40)).hidden[0, -1]
        cache = bf16.new_cache(1, 40)
        bf16.forward(ids[:1, :17], cache)  # advances the cache's length
        split = bf16.forward(ids[:1, 17:], cache).hidden[0, -1]
    assert torch.equal(whole, split)
    prompts = [ids[0, :5].tolist(), ids[1, :23].tolist(), ids[2].tolist()]
    assert [o.token_ids for o in generate(bf16, None, prompts, max_new_tokens=8)] == \
        [generate(bf16, None, [p], max_new_tokens=8)[0].token_ids for p in prompts]


BLOCK_MAKERS = {kernels.BF16DP_Q4_1: (_q4_1_grid, 0.4), kernels.BF16DP_Q8_0: (_q8_0_grid, 0.6)}
EVERY_M = (*range(1, 41), 47, 48, 64, 65, 96, 97, 191, 192, 193, 200, 1390)  # every decode / verify height, chunk edges


@needs_bf16
@pytest.mark.parametrize("fmt", list(BLOCK_MAKERS))
@pytest.mark.parametrize("k,n", [*MODEL_SHAPES, (64, 49), (96, 200)])
def test_bf16_block_formats_are_the_bf16_panels_bits_for_every_row_count(fmt, k, n, bf16_path):
    """The bf16 family over GGUF blocks (expanded per panel, rounded to bf16, the same tiles) against the bf16 panels
    of the same weight: bit for bit at every row count, in fewer bytes; and batch invariant like them."""
    make, ratio = BLOCK_MAKERS[fmt]
    w = make(n, k, 11)
    blocks, panels = kernels.PackedLinear(w, formats=(fmt,)), kernels.PackedLinear(w, formats=(kernels.BF16DP,))
    assert blocks.format == fmt and panels.format == kernels.BF16DP
    assert blocks.packed.nbytes < panels.packed.nbytes * ratio
    x = torch.randn(max(EVERY_M), k, generator=torch.Generator().manual_seed(k + n))
    x[3] *= 1e-3  # small and large inputs: rounding ties and exponents of all sizes in the products
    x[5] *= 1e3
    for m in EVERY_M:
        assert torch.equal(blocks(x[:m]), panels(x[:m])), m
    assert _mismatches(blocks, x) == []


@needs_bf16
def test_bf16_block_formats_head_and_fallback(bf16_path):
    k, n = HEAD
    w = _q8_0_grid(n, k, 12)
    blocks = kernels.PackedLinear(w, formats=kernels.BF16_FORMATS)
    assert blocks.format == kernels.BF16DP_Q8_0  # Q4_1 tried first, not a Q4_1 grid
    panels = kernels.PackedLinear(w, formats=(kernels.BF16DP,))
    x = torch.randn(97, k, generator=torch.Generator().manual_seed(4))
    for m in (1, 2, 8, 9, 32, 97):
        assert torch.equal(blocks(x[:m]), panels(x[:m])), m
    # a weight on no grid takes the bf16 panels; K not a whole number of blocks too
    assert kernels.PackedLinear(torch.randn(50, 64), formats=kernels.BF16_FORMATS).format == kernels.BF16DP
    assert kernels.PackedLinear(_q4_1_grid(50, 64, 1)[:, :48].contiguous(),
                                formats=kernels.BF16_FORMATS).format == kernels.BF16DP


@needs_bf16
@pytest.mark.skipif(not _amx_here(), reason="no AMX tiles on this CPU")
def test_amx_and_avx512_paths_compute_the_same_products_in_another_order():
    """Where the CPU has AMX the bf16 family runs on its tiles by default (``DSPINE_AMX=0``: AVX512-BF16): the same
    bf16 weights and inputs, fp32 sums in another order, so outputs within fp32 rounding of each other, not equal."""
    assert kernels.bf16_isa() == f"{kernels.load()}+amx"
    w = _q4_1_grid(300, 1536, 5)
    lin = kernels.PackedLinear(w, formats=(kernels.BF16DP_Q4_1,))
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(6))
    amx = lin(x)
    try:
        kernels.set_bf16_amx(False)
        avx = lin(x)
    finally:
        kernels.set_bf16_amx(True)
    torch.testing.assert_close(amx, avx, rtol=1e-5, atol=1e-5 * 1536**0.5)
    assert not torch.equal(amx, avx)
    got = _in_subprocess("from dspine.cpu import kernels; import json; print(json.dumps(kernels.bf16_isa()))",
                         DSPINE_AMX="0")
    assert got == kernels.load()


def _attention_mismatches(seed: int = 0) -> list[str]:
    """attend_cache (rep query heads per KV head at once, outputs in registers) against the per-query loop it
    replaced, bit for bit, and each query computed alone against the same query inside a many-query call."""
    bad = []
    for B, T, Hq, Hkv, D, window in [(2, 37, 9, 3, 64, 0), (1, 5, 4, 4, 32, 0), (2, 9, 8, 2, 128, 6),
                                     (1, 4, 6, 2, 48, 0), (3, 1, 9, 3, 64, 0), (1, 6, 4, 1, 256, 0)]:
        g = torch.Generator().manual_seed(seed + D + T)
        cap = 64
        kc, vc = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)
        q = torch.randn(B, T, Hq, D, generator=g)
        pos = torch.tensor([3, 20, 0])[:B, None] + torch.arange(T)
        args = (kc, vc, pos, window, D**-0.5)
        got = kernels.attend_cache(q, *args)
        if not torch.equal(got, torch.ops.dspine_cpu.attend_cache_ref(q, *args)):
            bad.append(f"ref {B, T, Hq, Hkv, D}")
        for t in {0, T // 2, T - 1}:
            alone = kernels.attend_cache(q[:, t : t + 1], kc, vc, pos[:, t : t + 1], window, D**-0.5)
            if not torch.equal(alone[:, 0], got[:, t]):
                bad.append(f"alone {B, T, Hq, Hkv, D} t={t}")
    return bad


def test_attention_is_the_per_query_loops_bits_and_query_invariant():
    assert _attention_mismatches() == []
