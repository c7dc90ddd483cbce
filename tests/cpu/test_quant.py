"""Weight-only quantized linears, precision settings, and speculative == plain within each setting."""

from __future__ import annotations

import pytest
import torch
from helpers import ScriptedDraft, random_mistakes, save_tiny_qwen35, token_prompts

from dspine import generate, load_target
from dspine.cpu.precision import native_bf16, resolve
from dspine.cpu.quant import GROUP, Int4Linear, Int8Linear, quantize_linears


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def test_int8_linear_matches_its_dequantized_weight():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=True)
    q = Int8Linear.from_weight(lin.weight, lin.bias)
    assert q.qweight.dtype == torch.int8
    assert _rel_err(q.dequantized(), lin.weight) < 0.01  # per-channel absmax/127 grid
    x = torch.randn(3, 5, 96)
    ref = x @ q.dequantized().T + lin.bias
    assert _rel_err(q(x), ref) < 0.01  # bf16 activations
    assert q(x).shape == (3, 5, 40) and q(x).dtype == x.dtype


def test_int4_groups_round_trip_a_q4_1_grid_exactly():
    """Weights already on a Q4_1 grid (q * d + m per group of 32, q spanning 0..15) quantize back to themselves."""
    g = torch.Generator().manual_seed(1)
    n, k = 16, 4 * GROUP
    q = torch.randint(0, 16, (n, k), generator=g)
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15  # every group hits both ends, as llama.cpp's min/max quantizer does
    d = torch.rand(n, k // GROUP, generator=g) * 0.01 + 1e-3
    m = -torch.rand(n, k // GROUP, generator=g) * 0.05
    w = (q.view(n, -1, GROUP) * d[..., None] + m[..., None]).view(n, k)
    q2, d2, m2 = Int4Linear.quantize(w)
    assert torch.equal(q2, q.to(torch.int32))
    assert torch.allclose(d2, d, rtol=1e-5) and torch.allclose(m2, m, rtol=1e-5)
    x = torch.randn(4, k, generator=g)
    assert _rel_err(Int4Linear.from_weight(w)(x), x @ w.T) < 0.02  # bf16 scales and activations


def test_int4_falls_back_to_int8_for_unpackable_shapes():
    lin = torch.nn.Linear(GROUP + 8, 24, bias=False)
    holder = torch.nn.Sequential(lin)
    assert quantize_linears(holder, "int4") == 1
    assert isinstance(holder[0], Int8Linear)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(holder, "int3")


def test_precision_resolution():
    assert resolve().describe() == {"dtype": "float32", "quant": "none"}
    assert resolve("auto", flags={"avx512f", "avx512_bf16"}).dtype == "bfloat16"
    assert resolve("auto", flags={"avx2"}).dtype == "float32"
    assert resolve("auto", "int8", flags={"avx2"}).dtype == "bfloat16"  # quantized linears compute in bf16
    assert native_bf16({"amx_bf16"}) and not native_bf16({"avx512f"})
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        resolve("fp8")
    with pytest.raises(ValueError, match="quant 'int2'"):
        resolve("bfloat16", "int2")
    with pytest.raises(ValueError, match="compute in bfloat16"):
        resolve("float32", "int8")


@pytest.fixture(scope="module", params=["fp32_fused", "bf16", "int8", "int4"])
def setting_target(request, llama_dir):
    kw = {"fp32_fused": dict(fuse=True), "bf16": dict(dtype=torch.bfloat16),
          "int8": dict(dtype=torch.bfloat16, quant="int8"), "int4": dict(dtype=torch.bfloat16, quant="int4", fuse=True)}
    return request.param, load_target(llama_dir, **kw[request.param])


def test_setting_logits_stay_close_to_fp32(setting_target, llama_target):
    name, target = setting_target
    ids = torch.tensor([token_prompts(1, target.vocab_size, seed=5, lo=30, hi=30)[0]])
    ref = llama_target.score(ids)
    bound = {"fp32_fused": 1e-4, "bf16": 0.05, "int8": 0.05, "int4": 0.2}[name]
    assert _rel_err(target.score(ids), ref) < bound


@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_speculative_equals_plain_within_setting(setting_target, batch):
    """Losslessness holds relative to the target as configured: the draft is checked against the same logits."""
    _, target = setting_target
    prompts = token_prompts(batch, target.vocab_size, seed=batch)
    plain = generate(target, None, prompts, max_new_tokens=20)
    script = [o.token_ids for o in plain]
    for rate in (0.0, 0.3, 1.0):
        draft = ScriptedDraft(prompts, script, block_size=4, mistake=random_mistakes(7, rate))
        spec = generate(target, draft, prompts, max_new_tokens=20)
        assert [s.token_ids for s in spec] == script


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_hybrid_target_quantized_speculative_equals_plain(tmp_path, quant):
    """The Qwen3.5 hybrid (GDN + gated attention, fused projections) under quantization: ReplaySSM commits stay
    exact relative to the quantized target."""
    target = load_target(save_tiny_qwen35(tmp_path / "hybrid"), dtype=torch.bfloat16, quant=quant, fuse=True)
    assert isinstance(target.infer_head, Int8Linear)  # int4 keeps an int8 head, like Q4_1 GGUFs
    prompts = token_prompts(3, target.vocab_size, seed=11)
    plain = generate(target, None, prompts, max_new_tokens=16)
    script = [o.token_ids for o in plain]
    draft = ScriptedDraft(prompts, script, block_size=4, mistake=random_mistakes(3, 0.3))
    assert [s.token_ids for s in generate(target, draft, prompts, max_new_tokens=16)] == script
