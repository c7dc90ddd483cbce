"""Gated DeltaNet math (dspine/models/gdn.py) against HF's reference functions, and ReplaySSM (dspine/models/replay.py).

ReplaySSM contract: after ``forward(block, speculative=True)`` + ``commit(n)``, every GDN layer's conv window and
fp32 recurrent state are *bit-identical* to a non-speculative forward of the same block with ``n_valid = n``
from the same pre-verify cache (same step function, same inputs, same order), and within 1e-6 of a forward
that only ever sees the first ``n`` tokens (upstream matmuls then run on other shapes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import QWEN35_VOCAB as V
from helpers import save_tiny_qwen35
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from dspine.models import gdn, replay
from dspine.models.cache import ModelCache, SSMState
from dspine.models.registry import load_target


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    return load_target(save_tiny_qwen35(tmp_path_factory.mktemp("qwen35r"), seed=3))


@pytest.fixture(autouse=True)
def _no_grad():
    """The decoding loop runs under no_grad; caches must not carry autograd history (deepcopy needs that)."""
    with torch.no_grad():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- gdn.py vs transformers ----------------------------------------------------------------------------------


def test_causal_conv_matches_hf():
    g = _gen(0)
    B, C, K, T = 2, 12, 4, 9
    w = torch.randn(C, K, generator=g)
    u = torch.randn(B, C, T, generator=g)
    seq = gdn.causal_conv(torch.zeros(B, C, K - 1), u, w)
    ref = F.conv1d(u, w[:, None], padding=K - 1, groups=C)[:, :, :T]  # HF causal_conv1d_fn before SiLU
    assert (seq - ref).abs().max().item() < 1e-5
    assert torch.allclose(F.silu(seq), hf.causal_conv1d_fn(u, w, None, activation="silu"), atol=1e-5)
    # continuing from a window = HF's decode update; a step equals the matching column of the sequence
    window = u[:, :, 2:5].clone()
    state = window.clone()
    ref_step = hf.causal_conv1d_update(u[:, :, 5:6], state, w, None, activation="silu")
    assert torch.allclose(F.silu(gdn.causal_conv(window, u[:, :, 5:6], w)), ref_step, atol=1e-6)
    assert torch.equal(state, u[:, :, 3:6])
    steps, win = [], torch.zeros(B, C, K - 1)
    for t in range(T):
        steps.append(gdn.causal_conv(win, u[:, :, t : t + 1], w))
        win = gdn.roll_window(win, u[:, :, t : t + 1], torch.ones(B, dtype=torch.long))
    assert (torch.cat(steps, -1) - seq).abs().max().item() < 1e-6


def test_roll_window():
    window = torch.arange(6.0).view(1, 2, 3).repeat(3, 1, 1)  # rows share the window [[0,1,2],[3,4,5]]
    u = 10 + torch.arange(8.0).view(1, 2, 4).repeat(3, 1, 1)  # [[10..13],[14..17]]
    out = gdn.roll_window(window, u, torch.tensor([0, 2, 4]))
    assert out[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out[1].tolist() == [[2, 10, 11], [5, 14, 15]]
    assert out[2].tolist() == [[11, 12, 13], [15, 16, 17]]


def test_l2norm_and_gated_norm_match_hf():
    g = _gen(1)
    x = torch.randn(3, 5, 16, generator=g)
    assert torch.equal(gdn.l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))
    z = torch.randn(3, 5, 16, generator=g)
    norm = hf.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(16, generator=g))
        assert torch.equal(gdn.gated_rmsnorm(x, z, norm.weight, 1e-6), norm(x, z))


@pytest.mark.parametrize("T", [1, 5, 70])
def test_delta_rule_scan_matches_hf(T):
    g = _gen(T)
    B, Hk, Hv, Dk, Dv = 2, 2, 4, 8, 6
    q = torch.randn(B, T, Hk, Dk, generator=g)
    k = torch.randn(B, T, Hk, Dk, generator=g)
    v = torch.randn(B, T, Hv, Dv, generator=g)
    a = torch.randn(B, T, Hv, generator=g)
    b = torch.randn(B, T, Hv, generator=g)
    A_log = torch.empty(Hv).uniform_(0.05, 2.0, generator=g).log()
    dt_bias = torch.randn(Hv, generator=g)
    S0 = torch.randn(B, Hv, Dk, Dv, generator=g)
    gl, beta = gdn.gates(a, b, A_log, dt_bias)
    assert torch.equal(gl, -A_log.exp() * F.softplus(a + dt_bias)) and (gl <= 0).all()
    qn, kn = gdn.prepare_qk(q, k)
    S, out = gdn.delta_rule_scan(S0, kn, v, gl, beta, q=qn)
    kw = dict(g=gl, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_S = hf.torch_recurrent_gated_delta_rule(q, k, v, **kw)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (S - ref_S).abs().max().item() < 1e-5
    ch_out, ch_S = hf.torch_chunk_gated_delta_rule(q, k, v, chunk_size=16, **kw)
    assert (out - ch_out).abs().max().item() < 1e-4
    assert (S - ch_S).abs().max().item() < 1e-4
    # masked tokens leave the state untouched; the scan never mutates its input state
    S_before = S0.clone()
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[0, : T // 2 + 1] = True
    S_m, _ = gdn.delta_rule_scan(S0, kn, v, gl, beta, valid=valid)
    S_half, _ = gdn.delta_rule_scan(S0[:1], kn[:1, : T // 2 + 1], v[:1, : T // 2 + 1], gl[:1, : T // 2 + 1], beta[:1])
    assert torch.equal(S_m[1], S0[1]) and torch.equal(S0, S_before)
    assert (S_m[0] - S_half[0]).abs().max().item() < 1e-6


# -- ReplaySSM ------------------------------------------------------------------------------------------------


def _prefill(q35, lens: list[int], seed: int) -> tuple[ModelCache, list[torch.Tensor]]:
    g = _gen(seed)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in lens]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    cache = q35.new_cache(len(lens), 4)
    q35(ids, cache, n_valid=torch.tensor(lens))
    return cache, prompts


def _ssm(cache: ModelCache) -> list[SSMState]:
    return [s for s in cache.layers if isinstance(s, SSMState)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commit_equals_direct_forward(q35, seed):
    T = 6
    g = _gen(100 + seed)
    lens = [3, 8, 5, 1, 4]
    base, prompts = _prefill(q35, lens, seed)
    block = torch.randint(0, V, (len(lens), T), generator=g)
    n = torch.tensor([1, T, *torch.randint(1, T + 1, (2,), generator=g).tolist(), 0 if seed == 0 else 2])

    spec = copy.deepcopy(base)
    out_spec = q35(block, spec, speculative=True, taps=(1,))
    assert spec.lengths.tolist() == lens
    for s, s0 in zip(_ssm(spec), _ssm(base)):  # committed state untouched; record only per-token inputs
        assert torch.equal(s.conv, s0.conv) and torch.equal(s.rec, s0.rec)
        assert set(s.pending) == {"conv_in", "k", "v", "g", "beta"}
        assert all(t.shape[:2] in ((len(lens), T), (len(lens), s.conv.shape[1])) for t in s.pending.values())
        assert sum(t.numel() for t in s.pending.values()) < s.rec.numel() * T  # no state per draft position
    q35.commit(spec, n)

    direct = copy.deepcopy(base)
    out_direct = q35(block, direct, n_valid=n, taps=(1,))
    for b in range(len(lens)):  # outputs at accepted positions are the same computation
        assert torch.equal(out_spec.hidden[b, : n[b]], out_direct.hidden[b, : n[b]])
        assert torch.equal(out_spec.taps[b, : n[b]], out_direct.taps[b, : n[b]])
    assert spec.lengths.tolist() == direct.lengths.tolist() == [a + b for a, b in zip(lens, n.tolist())]
    for s, d in zip(_ssm(spec), _ssm(direct)):
        assert s.pending is None
        assert torch.equal(s.conv, d.conv)  # bit-exact
        assert torch.equal(s.rec, d.rec) and s.rec.dtype == torch.float32

    # a forward that never saw the rejected tokens (shorter block, so other matmul shapes): <= 1e-6
    short = copy.deepcopy(base)
    q35(block[:, : max(1, int(n.max()))], short, n_valid=n)
    for s, d in zip(_ssm(spec), _ssm(short)):
        assert (s.conv - d.conv).abs().max().item() <= 1e-6
        assert (s.rec - d.rec).abs().max().item() <= 1e-6

    # decoding continues as if only the accepted tokens had ever been seen
    nxt = torch.randint(0, V, (len(lens), 3), generator=g)
    cont = torch.cat([q35.logits(q35(nxt[:, j : j + 1], spec).hidden) for j in range(3)], dim=1)
    for b in range(len(lens)):
        seq = torch.cat([prompts[b], block[b, : n[b]], nxt[b]])[None]
        ref = q35.score(seq)[0, -3:]
        # incremental steps vs one full-sequence forward: different reduction orders (chunked vs stepwise GDN,
        # ISA-specific kernels), so fp32 rounding scales with the logits (|logit| ~ 4 here; AVX2 gave 1.3e-5)
        assert (cont[b] - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_commit_after_select(q35):
    """The pending record follows ``ModelCache.select`` (a scheduler may drop rows mid-verify)."""
    T = 4
    base, prompts = _prefill(q35, [6, 2, 7], 7)
    block = torch.randint(0, V, (3, T), generator=_gen(8))
    spec = copy.deepcopy(base)
    q35(block, spec, speculative=True)
    spec = spec.select([2, 0])
    q35.commit(spec, torch.tensor([3, 1]))
    direct = copy.deepcopy(base)  # same batch shape as the verify, then the same rows
    q35(block, direct, n_valid=torch.tensor([1, 2, 3]))
    direct = direct.select([2, 0])
    assert spec.lengths.tolist() == direct.lengths.tolist() == [10, 7]
    for s, d in zip(_ssm(spec), _ssm(direct)):
        assert torch.equal(s.conv, d.conv) and torch.equal(s.rec, d.rec)


def test_block_of_one(q35):
    """T = 1 (plain decode through the speculative path) with n = 1 equals a normal decode step."""
    base, _ = _prefill(q35, [4, 9], 9)
    tok = torch.randint(0, V, (2, 1), generator=_gen(10))
    spec, direct = copy.deepcopy(base), copy.deepcopy(base)
    a = q35(tok, spec, speculative=True).hidden
    q35.commit(spec, torch.ones(2, dtype=torch.long))
    b = q35(tok, direct).hidden
    assert torch.equal(a, b)
    for s, d in zip(_ssm(spec), _ssm(direct)):
        assert torch.equal(s.conv, d.conv) and torch.equal(s.rec, d.rec)


def test_misuse_raises(q35):
    base, _ = _prefill(q35, [3, 3], 11)
    block = torch.randint(0, V, (2, 3), generator=_gen(12))
    with pytest.raises(RuntimeError, match="commit without a pending"):
        q35.commit(copy.deepcopy(base), torch.tensor([1, 1]))
    spec = copy.deepcopy(base)
    q35(block, spec, speculative=True)
    with pytest.raises(RuntimeError, match="pending"):
        q35(block, spec)
    with pytest.raises(RuntimeError, match="pending"):
        ModelCache.concat([spec, copy.deepcopy(base)])
    with pytest.raises(ValueError, match="outside"):
        q35.commit(spec, torch.tensor([4, 1]))
    assert spec.lengths.tolist() == [3, 3] and all(s.pending is not None for s in _ssm(spec))  # nothing applied


def test_replay_on_bare_state():
    """replay.commit on a hand-made SSMState (no model): equals the masked direct scan + window roll."""
    g = _gen(13)
    B, C, K, T, Hk, Hv, Dk, Dv = 3, 10, 4, 5, 1, 2, 4, 3
    st = SSMState(torch.randn(B, C, K - 1, generator=g), torch.randn(B, Hv, Dk, Dv, generator=g))
    u = torch.randn(B, C, T, generator=g)
    k = gdn.l2norm(torch.randn(B, T, Hk, Dk, generator=g))
    v = torch.randn(B, T, Hv, Dv, generator=g)
    gl = -torch.rand(B, T, Hv, generator=g)
    beta = torch.rand(B, T, Hv, generator=g)
    n = torch.tensor([0, 2, 5])
    ref_rec, _ = gdn.delta_rule_scan(st.rec, k, v, gl, beta, valid=torch.arange(T)[None] < n[:, None])
    ref_conv = torch.stack([torch.cat([st.conv[b], u[b, :, : n[b]]], -1)[:, -(K - 1) :] for b in range(B)])
    replay.record(st, u, k, v, gl, beta)
    with pytest.raises(RuntimeError, match="already pending"):
        replay.record(st, u, k, v, gl, beta)
    replay.commit(st, n)
    assert torch.equal(st.rec, ref_rec) and torch.equal(st.conv, ref_conv) and st.pending is None
