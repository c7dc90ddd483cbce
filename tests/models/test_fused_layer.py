"""A dense layer in one native call (``llama.Block.plan_fused``, ``csrc/layer.cpp``): the same kernels in the
same order as the layer run op by op, so every hidden state and every cache entry is bit-identical, for ragged
prefills, decode steps and packed speculative verifies, in fp32 and under the bf16 policy, for every family of the
dense block (Qwen3's per-head QK norms, Gemma 3's sandwich norms, OLMo 2's post-norms and QK norms over the projections,
Granite's residual scale)."""

from __future__ import annotations

import pytest
import torch
from family_models import save_tiny_family
from helpers import save_tiny_hf

from dspine import load_target
from dspine.cpu import kernels

pytestmark = pytest.mark.skipif(kernels.disabled() or kernels.load() is None, reason="no CPU kernels here")

# family -> how many of its 4 layers run fused (smollm3's NoPE layer is planned but runs op by op: no rotary tables)
CASES = {"llama": 4, "llama-bf16": 4, "qwen3": 4, "qwen3-bf16": 4, "qwen2": 4, "mistral": 4, "smollm3": 4, "phi3": 4,
         "gemma3": 4, "olmo2": 4, "granite": 4}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, _, dtype = request.param.partition("-")
    if dtype == "bf16" and not kernels.bf16dp_ok():
        pytest.skip("no AVX512-BF16 here")
    where = tmp_path_factory.mktemp(request.param)
    if family in ("llama", "qwen3"):
        path = save_tiny_hf(where, family, layers=4, gguf=True)
    else:
        path = save_tiny_family(where, family)
    return request.param, load_target(path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)


def _run(target, fused: bool, plans: list) -> list[torch.Tensor]:
    """A ragged prefill, a decode step with one finished row, a packed speculative verify: hidden states and caches."""
    for layer, plan in zip(target.layers, plans):
        layer.fused = plan if fused else None
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([9, 3, 14])
    cache = target.new_cache(3, 32)
    got = [target.forward(torch.randint(1, target.vocab_size, (3, 14), generator=g), cache, n_valid=lens).hidden]
    got.append(target.forward(torch.randint(1, target.vocab_size, (3, 1), generator=g), cache,
                              n_valid=torch.tensor([1, 0, 1])).hidden)
    got.append(target.forward(torch.randint(1, target.vocab_size, (3, 1), generator=g), cache).hidden)
    got.append(target.forward(torch.randint(1, target.vocab_size, (3, 4), generator=g), cache,
                              n_valid=torch.tensor([4, 1, 2]), speculative=True).hidden)
    return got + [t for layer in cache.layers for t in (layer.k, layer.v)]


def test_a_fused_layer_is_the_layer_op_by_op_bit_for_bit(case):
    name, target = case
    plans = [layer.fused for layer in target.layers]
    assert sum(p is not None for p in plans) == CASES[name]
    fused, per_op = _run(target, True, plans), _run(target, False, plans)
    assert len(fused) == len(per_op)
    for i, (a, b) in enumerate(zip(fused, per_op)):
        assert torch.equal(a, b), (name, i)
    for layer, plan in zip(target.layers, plans):
        layer.fused = plan


def test_a_fused_layer_needs_our_kernels(llama_dir):
    """Off the kernels (torch's linears) nothing is planned: the layer has no packed weights to hand over."""
    t = load_target(llama_dir, kernels=False)
    assert all(getattr(layer, "fused", None) is None for layer in t.layers)


def _run_tapped(target, mode: str, plans: list) -> list[torch.Tensor]:
    """``_run``'s forwards with taps (the draft's features), the layers run as one stack call (``mode`` "stack"), one
    fused call each ("layers") or op by op ("per-op")."""
    target.stacked = mode == "stack"
    for layer, plan in zip(target.layers, plans):
        layer.fused = None if mode == "per-op" else plan
    g = torch.Generator().manual_seed(5)
    taps = (2, 0, 3)
    cache = target.new_cache(3, 32)
    outs = [target.forward(torch.randint(1, target.vocab_size, (3, 11), generator=g), cache,
                           n_valid=torch.tensor([11, 4, 7]), taps=taps),
            target.forward(torch.randint(1, target.vocab_size, (3, 1), generator=g), cache, taps=taps),
            target.forward(torch.randint(1, target.vocab_size, (3, 3), generator=g), cache,
                           n_valid=torch.tensor([3, 0, 2]), speculative=True, taps=taps)]
    target.stacked = True
    return [t for o in outs for t in (o.hidden, o.taps)] + [t for layer in cache.layers for t in (layer.k, layer.v)]


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_the_layers_in_one_stack_call_are_the_layers_one_by_one_bit_for_bit(case, amx, monkeypatch):
    """``DenseTarget.forward`` runs a fully fused target's layers in one ``dense_stack`` call (no ``Block.forward`` in
    between), taps included, with the bits of one ``dense_layer`` call per layer and of the layers op by op; with AMX
    tiles and without (``DSPINE_AMX=0``'s path), where the CPU has them."""
    from dspine.models import llama

    name, target = case
    on = kernels.bf16_isa().endswith("+amx")
    if not amx and not (on and "bf16" in name):
        pytest.skip("no AMX path to leave here (no AMX, or fp32): the amx case covers it")
    plans = [layer.fused for layer in target.layers]
    if "bf16" in name:
        kernels.set_bf16_amx(amx)
    try:
        layers, per_op = _run_tapped(target, "layers", plans), _run_tapped(target, "per-op", plans)
        calls = []
        block_forward = llama.Block.forward

        def counted(self, *a, **k):
            calls.append(1)
            return block_forward(self, *a, **k)

        monkeypatch.setattr(llama.Block, "forward", counted)
        stacked = _run_tapped(target, "stack", plans)
    finally:
        if "bf16" in name:
            kernels.set_bf16_amx(on)
        for layer, plan in zip(target.layers, plans):
            layer.fused = plan
    stack_runs = CASES[name] == len(target.layers) and name != "smollm3"  # smollm3: a NoPE layer, the loop
    assert (not calls) == stack_runs, (name, len(calls))
    for i, (a, b, c) in enumerate(zip(stacked, layers, per_op)):
        assert torch.equal(a, b) and torch.equal(a, c), (name, i)


def test_the_team_stack_is_the_loop_of_fused_layers_bit_for_bit(case):
    """``csrc/layer.cpp``'s team stack (the whole stack in one parallel region over buffers allocated once) gives the
    bits of the loop of fused layer calls: decode steps, a finished row's, packed speculative verifies and prefills,
    taps and caches; and it is what runs for the plain pre-norm block on the fp32 family (the llama case's every
    forward here: at most ``max_rows`` tokens)."""
    name, target = case
    plans = [layer.fused for layer in target.layers]
    before = torch.ops.dspine_cpu.team_stack_runs()
    assert kernels.set_team_stack(True)
    try:
        team = _run_tapped(target, "stack", plans)
        runs = torch.ops.dspine_cpu.team_stack_runs() - before
        kernels.set_team_stack(False)
        loop = _run_tapped(target, "stack", plans)
        assert torch.ops.dspine_cpu.team_stack_runs() - before == runs
    finally:
        kernels.set_team_stack(True)
    if name in ("llama", "mistral"):  # Q4_1 / fp32 weights, the plain block: all three forwards
        assert runs == 3, (name, runs)
    elif name in ("qwen3", "qwen2", "gemma3", "olmo2", "granite", "smollm3") or "bf16" in name:
        assert runs == 0, (name, runs)  # QK norms, biases, sandwich / post norms, a residual scale, NoPE, bf16
    for i, (a, b) in enumerate(zip(team, loop)):
        assert torch.equal(a, b), (name, i)


@pytest.mark.parametrize("quant", ["q8", "q16"])
def test_the_team_stack_runs_the_integer_family_bit_for_bit(quant, tmp_path):
    """The opt-in integer policies (``csrc/gemm_q8.cpp``'s linears, one or two int8 parts, bf16 caches) in the team
    stack: the loop's bits, and it runs for every forward of ``_run_tapped``."""
    path = save_tiny_hf(tmp_path, "llama", layers=4, gguf=True)
    target = load_target(path, dtype=torch.bfloat16, quant=quant)
    assert target.layers[0].fused is not None and "dp" in target.layers[0].fused[1][0]
    plans = [layer.fused for layer in target.layers]
    before = torch.ops.dspine_cpu.team_stack_runs()
    try:
        team = _run_tapped(target, "stack", plans)
        runs = torch.ops.dspine_cpu.team_stack_runs() - before
        kernels.set_team_stack(False)
        loop = _run_tapped(target, "stack", plans)
    finally:
        kernels.set_team_stack(True)
    # where AVX512-BF16 runs the bf16 caches' attention (its own dot products) the layers take the loop
    assert runs == (0 if kernels.bf16_attention(target.layers[0].self_attn.head_dim) else 3)
    for i, (a, b) in enumerate(zip(team, loop)):
        assert torch.equal(a, b), (quant, i)
