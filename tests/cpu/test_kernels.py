"""dspine.cpu.kernels: our CPU linear and fused per-layer ops against the torch computations they replace, batch
invariance, the fallback, and the other ISA builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, make_draft, subprocess_env

from dspine import generate, load_target
from dspine.cpu import kernels
from dspine.models.cache import KVCache
from dspine.models.layers import Positions, RMSNorm, apply_rope, attend


def _usable() -> bool:
    """Skip only where the kernels cannot be built at all (switched off, or no C++ compiler); a machine that has
    a compiler and still cannot build them fails here rather than silently testing torch."""
    if kernels.disabled() or shutil.which(os.environ.get("CXX", "c++")) is None:
        return False
    assert kernels.load() is not None, f"the CPU kernels failed to build: {kernels.unavailable_reason()}"
    return True


pytestmark = pytest.mark.skipif(not _usable(), reason="CPU kernels switched off or no C++ compiler")


@pytest.mark.parametrize("M,N,K", [(1, 576, 576), (2, 193, 64), (7, 64, 40), (13, 1536, 96), (200, 96, 48),
                                   (0, 8, 16), (3, 1, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_torch_linear(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w, b, x = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(M, K, generator=g)
    lin = kernels.PackedLinear(w, b if bias else None)
    y = lin(x)
    assert y.shape == (M, N)
    torch.testing.assert_close(y, F.linear(x, w, b if bias else None), rtol=1e-5, atol=1e-5 * K**0.5)
    # leading dims are kept
    assert lin(x.view(1, M, K)).shape == (1, M, N)


def test_packed_linear_is_batch_invariant():
    """A row's outputs are bit-identical whatever the other rows are and wherever it sits in the batch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g)
    lin = kernels.PackedLinear(w)
    x = torch.randn(37, 576, generator=g)
    full = lin(x)
    for i in (0, 5, 36):
        assert torch.equal(lin(x[i : i + 1])[0], full[i])
        assert torch.equal(lin(x[i : i + 3])[0], full[i])
    shuffled = lin(x.flip(0))
    assert torch.equal(shuffled.flip(0), full)
    # torch's own GEMM is the counter-example this guards against: not required to be invariant, and the test
    # would pass trivially if PackedLinear silently fell back to it — so check the kernel really ran
    assert lin.packed.numel() >= w.numel() and not hasattr(lin, "weight")


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_rms_norm_equals_rmsnorm(offset):
    norm = RMSNorm(96, 1e-6, offset)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 96) * 4
    torch.testing.assert_close(kernels.FusedRMSNorm(norm)(x), norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rope_store_and_attend_cache_equal_the_torch_path(window, rotary_dim):
    """RoPE + KV-cache write + masked GQA attention, rows at different lengths with T > 1 (a verify block)."""
    g = torch.Generator().manual_seed(rotary_dim + (window or 0))
    B, T, Hq, Hkv, D, cap = 3, 4, 4, 2, 16, 24
    lengths = torch.tensor([0, 7, 13])
    pos = lengths[:, None] + torch.arange(T)
    theta = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = pos.float()[..., None] * theta
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, T, d] as layers.Rotary gives them
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, T, Hkv, D, generator=g)
    v = torch.randn(B, T, Hkv, D, generator=g)
    old_k, old_v = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)

    ref = KVCache(old_k.clone(), old_v.clone())
    at = Positions.of(pos)
    ref.write(at.pos, apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2), upto=at.upto, rows=at.rows)
    keys, values = ref.view(at.upto)
    want = attend(apply_rope(q.transpose(1, 2), cos, sin), keys, values, at.mask(window), D**-0.5)
    want = want.transpose(1, 2).reshape(B, T, Hq * D)

    kc, vc = old_k.clone(), old_v.clone()
    qr = kernels.rope_store(q.clone(), k, v, cos[:, 0], sin[:, 0], kc, vc, pos)
    got = kernels.attend_cache(qr, kc, vc, pos, window, D**-0.5)
    torch.testing.assert_close(kc, ref.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, ref.v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_silu_mul():
    gu = torch.randn(2, 3, 2 * 40)
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("V", [1, 7, 8, 9, 17, 1000, 49152])
def test_argmax_is_torchs_argmax(V):
    """The greedy rows' argmax gives torch's indices on what can make them differ: ties (the first maximum), -0.0
    beside 0.0, rows of -inf only, +inf, NaN anywhere (the first NaN), the vector body and the scalar tail."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g)
    ties = x.clone()
    ties[:, ::3] = ties.max()
    zeros = torch.zeros(6, V)
    zeros[:, V // 3] = -0.0
    zeros[1:, -1] = 0.0
    nans = x.clone()
    nans[0, V // 2] = float("nan")
    nans[2, -1] = float("nan")
    nans[3, :] = float("nan")
    infs = x.clone()
    infs[:, -1] = float("inf")
    infs[1:, 0] = float("inf")
    cases = [x, ties, zeros, nans, infs, torch.full((6, V), float("-inf")), x.round(), x[::2], x[:, : (V + 1) // 2]]
    for case in cases:
        got = kernels.argmax(case)
        assert got.dtype == torch.long and torch.equal(got, case.argmax(-1)), case
    assert torch.equal(kernels.argmax(x.T.contiguous().T), x.argmax(-1))  # a strided input
    assert torch.equal(kernels.argmax(x[None]), x[None].argmax(-1))  # 3-D: torch's own


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_target_with_kernels_matches_torch_and_is_batch_invariant(family, llama_dir, qwen3_dir):
    path = llama_dir if family == "llama" else qwen3_dir
    fast, slow = load_target(path), load_target(path, kernels=False)
    assert fast.kernel.startswith("dspine-") and slow.kernel == "torch"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, fast.vocab_size, (3, 20), generator=g)
    torch.testing.assert_close(fast.score(ids), slow.score(ids), rtol=1e-4, atol=1e-4)
    prompts = [ids[0, :5].tolist(), ids[1, :11].tolist(), ids[2].tolist()]
    together = generate(fast, None, prompts, max_new_tokens=12)
    alone = [generate(fast, None, [p], max_new_tokens=12)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.token_ids for o in together] == [o.token_ids for o in generate(slow, None, prompts, max_new_tokens=12)]


def test_speculative_equals_plain_with_kernels_on_target_and_draft(llama_dir):
    target = load_target(llama_dir)
    draft = make_draft(target, block_size=4).use_kernels()
    assert draft._kernels
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 17)]
    plain = generate(target, None, prompts, max_new_tokens=24)
    spec = generate(target, draft, prompts, max_new_tokens=24)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.verify_steps for o in spec) > 0
    with pytest.raises(RuntimeError, match="cannot be saved"):
        draft.save(ROOT / "never-written")


def test_packed_draft_proposes_like_the_torch_draft(llama_target):
    vocab = list(range(0, llama_target.vocab_size, 2))
    torch_draft = make_draft(llama_target, block_size=4, draft_vocab=vocab)
    packed = make_draft(llama_target, block_size=4, draft_vocab=vocab).use_kernels()
    assert packed._kernels and packed.state_dict().keys() != torch_draft.state_dict().keys()
    h = torch.randn(2, 3, llama_target.hidden_size)
    torch.testing.assert_close(packed.head_logits(h, llama_target), torch_draft.head_logits(h, llama_target),
                               rtol=1e-4, atol=1e-4)


def _in_subprocess(code: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=subprocess_env(**env), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CHECK_BUILD = """
import json, torch, torch.nn.functional as F
from dspine.cpu import kernels
isa = kernels.load()
w, x = torch.randn(70, 40), torch.randn(5, 40)
lin = kernels.PackedLinear(w) if isa else None
err = float((lin(x) - F.linear(x, w)).abs().max()) if isa else None
inv = bool(torch.equal(lin(x[2:3])[0], lin(x)[2])) if isa else None
print(json.dumps({"isa": isa, "name": kernels.kernel_name(), "err": err, "invariant": inv}))
"""


def test_kernels_can_be_switched_off():
    got = _in_subprocess(CHECK_BUILD, DSPINE_KERNELS="0")
    assert got == {"isa": None, "name": "torch", "err": None, "invariant": None}


@pytest.mark.parametrize("isa", ["avx2", pytest.param("generic", marks=pytest.mark.slow)])
def test_lower_isa_builds_compute_the_same(isa):
    if kernels.cpu_isa() == "generic" and isa == "avx2":
        pytest.skip("this CPU has no AVX2")
    got = _in_subprocess(CHECK_BUILD, DSPINE_KERNELS=isa)
    assert got["isa"] == isa and got["name"] == f"dspine-{isa}"
    assert got["err"] < 1e-4 and got["invariant"] is True


def test_isa_choice_from_cpu_flags():
    assert kernels.cpu_isa({"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx2", "fma"}) == "avx512"
    assert kernels.cpu_isa({"avx2", "fma", "f16c", "avx512f"}) == "avx2"
    assert kernels.cpu_isa({"avx2", "fma"}) == "generic"  # the integer family reads float16 scales (F16C)
    assert kernels.cpu_isa({"sse4_2"}) == "generic"
    avx512 = {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}
    assert kernels.wanted_isa({"DSPINE_KERNELS": "avx2"}, avx512) == "avx2"
    assert kernels.wanted_isa({"DSPINE_KERNELS": "avx512"}, {"avx2", "fma", "f16c"}) == "avx2"  # never above the CPU
    assert kernels.wanted_isa({}, avx512) == "avx512"


def test_build_finds_the_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    # An unactivated venv's python (scripts/ci/ci_sglang.sh) has the pip ninja beside it but not on PATH.
    if kernels.shutil.which("ninja", path=kernels.sysconfig.get_path("scripts")) is None:
        pytest.skip("no ninja installed beside this interpreter")
    monkeypatch.setenv("PATH", str(tmp_path))
    with kernels._ninja_on_path():
        assert shutil.which("ninja") is not None
    assert os.environ["PATH"] == str(tmp_path)


def _q4_1_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight made the way GGUF Q4_1 makes one: per 32 columns, m = the block min and d = (max - min) / 15,
    both float16, values d * q + m (the min and max hit q = 0 and q = 15)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return (d[..., None] * q + m[..., None]).reshape(n, k)


def _q8_0_grid(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 5] = 127
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    return (d[..., None] * q).reshape(n, k)


def _bf16_grid(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


@pytest.mark.parametrize("fmt,make,ratio", [("q4_1", _q4_1_grid, 0.19), ("q8_0", _q8_0_grid, 0.29),
                                            ("bf16", _bf16_grid, 0.5)])
def test_exact_compact_formats_give_the_fp32_weights_outputs_bit_for_bit(fmt, make, ratio):
    w = make(70, 192, seed=3)
    x = torch.randn(9, 192)
    packed, fp32 = kernels.PackedLinear(w), kernels.PackedLinear(w, formats=("f32",))
    assert packed.format == fmt and fp32.format == "f32"
    assert packed.packed.nbytes <= fp32.packed.nbytes * ratio
    assert torch.equal(packed(x), fp32(x))
    torch.testing.assert_close(packed(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # a weight one ulp off the grid is not a block weight: it stays fp32 (never approximated)
    off = w.clone()
    off[3, 40] = torch.nextafter(off[3, 40], torch.tensor(1.0))
    assert kernels.PackedLinear(off).format == "f32"


def test_block_recovery_round_trips():
    w = _q4_1_grid(8, 64, seed=5)
    q, d, m = kernels.exact_q4_1(w)
    vals = torch.cat([q & 15, q >> 4], dim=-1).float()  # GGUF order: byte l holds q_l and q_{l+16}
    assert torch.equal(d[..., None] * vals + m[..., None], w.view(8, 2, 32))
    assert kernels.exact_q4_1(torch.randn(8, 64)) is None and kernels.exact_q8_0(torch.randn(8, 64)) is None
    assert kernels.exact_q4_1(torch.randn(8, 48)) is None  # not whole blocks


def test_embedded_target_is_stored_in_its_gguf_blocks():
    """The shipped target's decoder weights are Q4_1 and its (tied) head Q8_0, exactly: stored as blocks, with
    logits bit-identical to the same kernels on fp32 weights."""
    from dspine.embedded.smollm2 import embedded_target_path

    path = embedded_target_path()
    blocks = load_target(path)
    assert kernels.weight_formats(blocks) == {"q4_1": 4 * blocks.num_layers, "q8_0": 1}
    fp32 = load_target(path, kernels=False).use_kernels(formats=("f32",))
    assert kernels.weight_formats(fp32) == {"f32": 4 * blocks.num_layers + 1}
    ids = torch.randint(0, blocks.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(blocks.score(ids), fp32.score(ids))


def test_packed_weights_are_cached_on_disk_and_reused(llama_dir, tmp_path, monkeypatch):
    import dspine.models.registry

    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dspine.models.registry, "PACK_CACHE_MIN_BYTES", 0)  # tiny test checkpoints are not cached
    first = load_target(llama_dir)
    files = list((tmp_path / "packed").glob("*.safetensors"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    second = load_target(llama_dir)  # from the cache: the file is read, not rewritten
    assert files[0].stat().st_mtime_ns == stamp
    assert kernels.weight_formats(second) == kernels.weight_formats(first)
    ids = torch.randint(0, first.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(first.score(ids), second.score(ids))
    # a damaged cache entry: packed afresh, same outputs. Replaced (a new file under the name), as our writers do
    # (``atomic_file``): the loads above read their packed weights from a map of the old file, which truncating it
    # in place would pull from under them (SIGBUS)
    files[0].unlink()
    files[0].write_bytes(b"not a safetensors file")
    third = load_target(llama_dir)
    assert torch.equal(third.score(ids), first.score(ids))
