"""The torch versions of SGLang's CPU ops and Triton kernels (``dspine.sglang.cpu_kernels``, the CPU test path)
against our own reference math: ``dspine.gdn`` (Gated DeltaNet) and ``dspine.replay`` (ReplaySSM) run on the
same inputs in our layout must give the same outputs and states. Pure torch: runs in the default suite."""

from __future__ import annotations

import torch

from dspine import gdn
from dspine.sglang import cpu_kernels as k

H, HV, DK, DV, KW = 2, 4, 16, 16, 4  # key heads, value heads, head dims, conv kernel
DIM = 2 * H * DK + HV * DV


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(T, seed=0):
    g = _gen(seed)
    return dict(u=torch.randn(DIM, T, generator=g), a=torch.randn(T, HV, generator=g),
                b=torch.randn(T, HV, generator=g))


def _params(seed=1):
    g = _gen(seed)
    return dict(w=torch.randn(DIM, KW, generator=g) * 0.5, A_log=torch.rand(HV, generator=g).log(),
                dt_bias=torch.randn(HV, generator=g))


def _split(y):
    """post-conv [T, DIM] -> q, k [1, T, H, DK], v [1, T, HV, DV]"""
    T = y.shape[0]
    q, kk, v = y.split([H * DK, H * DK, HV * DV], dim=-1)
    return q.reshape(1, T, H, DK), kk.reshape(1, T, H, DK), v.reshape(1, T, HV, DV)


def _reference(u, a, b, p, window=None, S=None):
    """Our reference GDN layer core over u [DIM, T] from (window, S): (outputs [T, HV, DV], window, S [HV, DK, DV])."""
    window = torch.zeros(DIM, KW - 1) if window is None else window
    S = torch.zeros(HV, DK, DV) if S is None else S
    y = torch.nn.functional.silu(gdn.causal_conv(window[None], u[None], p["w"])[0]).T
    q, kk, v = _split(y)
    q, kk = gdn.prepare_qk(q, kk)
    g, beta = gdn.gates(a[None], b[None], p["A_log"], p["dt_bias"])
    S_new, o = gdn.delta_rule_scan(S[None], kk, v, g, beta, q=q)
    return o[0], gdn.roll_window(window[None], u[None], torch.tensor([u.shape[1]]))[0], S_new[0]


def test_qwen35_layer_ops_match_the_reference_target_layout():
    g = _gen(3)
    x, w = torch.randn(5, 3 * 8, generator=g), torch.randn(8, generator=g)
    qg, kv = torch.randn(5, 3 * 2 * 8, generator=g), torch.randn(5, 2 * 8, generator=g)
    q, kk, gate = k.fused_qk_gemma_rmsnorm_with_gate_cpu(qg, kv, w, w * 2, 1e-6, 8, 3)
    from dspine.layers import RMSNorm

    norm = RMSNorm(8, 1e-6, offset=1.0)
    norm.weight.data = w
    per_head = qg.view(5, 3, 16)
    assert torch.allclose(q, norm(per_head[..., :8]).reshape(-1, 8))
    assert torch.equal(gate, per_head[..., 8:].reshape(-1, 8))
    q2, _ = k.fused_qk_gemma_rmsnorm_cpu(per_head[..., :8].reshape(5, 24), kv, w, w * 2, 1e-6, 8)
    assert torch.equal(q2, q) and kk.shape == (10, 8)
    y = x.clone()
    k.fused_sigmoid_mul_cpu(y, x.view(5, 3, 8) * 2)
    assert torch.allclose(y, x * torch.sigmoid(2 * x))
    qkvz, ba = torch.randn(4, DIM + HV * DV, generator=g), torch.randn(4, 2 * HV, generator=g)
    mixed, z, b, a = k.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, H, HV, DK, DV)
    assert torch.equal(mixed, qkvz[:, :DIM]) and torch.equal(z.reshape(4, -1), qkvz[:, DIM:])
    assert torch.equal(b, ba[:, :HV]) and torch.equal(a, ba[:, HV:])


def test_gdn_prefill_then_decode_equals_the_reference_recurrence():
    """causal_conv1d_fn_cpu + chunk_gated_delta_rule_cpu over two packed sequences (one continuing from a
    cached state), then causal_conv1d_update_cpu + fused_sigmoid_gating_delta_rule_update_cpu steps: outputs
    and pool states equal dspine.gdn run request by request."""
    p = _params()
    lens = [5, 3]
    ins = [_inputs(n, seed=10 + i) for i, n in enumerate(lens)]
    slots = torch.tensor([2, 0])
    conv = torch.randn(3, DIM, KW - 1, generator=_gen(4))
    ssm = torch.randn(3, HV, DV, DK, generator=_gen(5)) * 0.1  # SGLang layout [HV, V, K]
    ssm[2] = 0  # a fresh slot (SGLang clears it; the recurrence always starts from the slot's state)
    prior = (conv[0].clone(), ssm[0].transpose(-1, -2).clone())  # request 1 continues a cached prefix
    u = torch.cat([i["u"] for i in ins], dim=1)
    loc = torch.tensor([0, 5, 8])
    y = k.causal_conv1d_fn_cpu(u, p["w"][:, None], None, "silu", conv, torch.tensor([False, True]), slots, loc, lens)
    q, kk, v = _split(y.T)
    g, beta = k.fused_gdn_gating_cpu(p["A_log"], torch.cat([i["a"] for i in ins]), torch.cat([i["b"] for i in ins]),
                                     p["dt_bias"])
    o, _, _ = k.chunk_gated_delta_rule_cpu(q, kk, v, g, beta, ssm, loc, False, True, slots)
    refs = [_reference(ins[0]["u"], ins[0]["a"], ins[0]["b"], p),
            _reference(ins[1]["u"], ins[1]["a"], ins[1]["b"], p, *prior)]
    for i, (s, e) in enumerate([(0, 5), (5, 8)]):
        o_ref, win, S = refs[i]
        assert torch.allclose(o[0, s:e], o_ref, atol=1e-5)
        assert torch.allclose(conv[slots[i]], win) and torch.allclose(ssm[slots[i]].transpose(-1, -2), S, atol=1e-6)
    for step in range(3):  # decode: both requests one token each
        step_ins = [_inputs(1, seed=100 + 10 * step + i) for i in range(2)]
        x = torch.stack([i["u"][:, 0] for i in step_ins])  # [bs, DIM]
        y = k.causal_conv1d_update_cpu(x, conv, p["w"], None, "silu", slots)
        q, kk, v = _split(y)
        out = k.fused_sigmoid_gating_delta_rule_update_cpu(
            p["A_log"], p["dt_bias"], q, kk, v, torch.cat([i["a"] for i in step_ins]),
            torch.cat([i["b"] for i in step_ins]), ssm, slots, torch.tensor([0, 1, 2]), True)
        for i in range(2):
            o_ref, win, S = _reference(step_ins[i]["u"], step_ins[i]["a"], step_ins[i]["b"], p, refs[i][1], refs[i][2])
            refs[i] = (o_ref, win, S)
            assert torch.allclose(out[0, i], o_ref[0], atol=1e-5)
            assert torch.allclose(conv[slots[i]], win)
            assert torch.allclose(ssm[slots[i]].transpose(-1, -2), S, atol=1e-6)
