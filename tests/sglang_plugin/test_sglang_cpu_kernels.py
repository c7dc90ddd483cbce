"""The torch versions of SGLang's CPU ops and Triton kernels (``dspine.sglang.cpu_kernels``, the CPU test path)
against our own reference math: ``dspine.models.gdn`` (Gated DeltaNet) and ``dspine.models.replay`` (ReplaySSM) run
on the same inputs in our layout must give the same outputs and states. Pure torch: runs in the default suite."""

from __future__ import annotations

import pytest
import torch

from dspine.models import gdn, replay
from dspine.models.cache import SSMState
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
    from dspine.models.layers import RMSNorm

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
    and pool states equal dspine.models.gdn run request by request."""
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


# -- ReplaySSM: SGLang's ring protocol against dspine.models.replay ----------------------------------------------

L_RING, BLOCK = 16, 4


def _effective_state(checkpoint, d, kc, gc, rawv, rawk, r, wp, base):
    """The committed state the ring protocol stands for: the checkpoint [HV, V, K] advanced over the ring's
    write_pos records (independent recomputation, our layout [HV, DK, DV])."""
    S = checkpoint.float().transpose(-1, -2)
    for c in range(wp):
        p = (base + c) % L_RING
        dd = d[r][:, p].float() + (0 if rawv is None else rawv[r][:, p].float())
        kk = kc[r][:, p].float() + (0 if rawk is None else rawk[r][:, p].float())
        S = gdn.decay_add(S, kk.repeat_interleave(HV // H, 0), dd, gc[r][:, p])
    return S


@pytest.mark.parametrize("ring_dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-4)])
def test_replayssm_ring_verify_and_commit_equal_dspine_replay(ring_dtype, atol):
    """Rounds of verify (gdn_replayssm_spec_decode) + commit (cursor advance, fold, tracking snapshot) for two
    requests with random accepted counts: every verify output equals dspine.models.gdn's scan from the reference state,
    and the committed state (checkpoint + ring) equals dspine.models.replay.commit's, through several ring folds. With
    bfloat16 rings the rounding residuals go to the low-part rings (SGLang's layout for 16-bit activations)."""
    p = _params(7)
    g = _gen(8)
    slots, rows = torch.tensor([1, 3]), torch.tensor([0, 2])  # mamba slots (checkpoints), ring slots
    ckpt = torch.zeros(1, 6, HV, DV, DK)
    ckpt[0, slots] = torch.randn(2, HV, DV, DK, generator=g) * 0.2
    d = torch.zeros(1, 4, HV, L_RING, DV, dtype=ring_dtype)
    kc = torch.zeros(1, 4, H, L_RING, DK, dtype=ring_dtype)
    gc = torch.zeros(1, 4, HV, L_RING)
    res = ring_dtype != torch.float32
    rawv, rawk = (torch.zeros_like(d), torch.zeros_like(kc)) if res else (None, None)
    wp, base, flush = (torch.zeros(4, dtype=torch.int32) for _ in range(3))
    flush = flush.to(torch.int8)
    ref = SSMState(conv=torch.zeros(2, DIM, KW - 1), rec=ckpt[0, slots].transpose(-1, -2).clone())
    loc = torch.tensor([0, BLOCK, 2 * BLOCK])
    folds = 0
    for rnd in range(12):
        q, kk, v = (torch.randn(2 * BLOCK, n, dd, generator=g) for n, dd in ((H, DK), (H, DK), (HV, DV)))
        a, b = torch.randn(2 * BLOCK, HV, generator=g), torch.randn(2 * BLOCK, HV, generator=g)
        out = torch.full((2 * BLOCK, HV, DV), float("nan"))
        k.gdn_replayssm_spec_decode(q, kk, v, a, b, p["A_log"], p["dt_bias"], ckpt[0], d[0], kc[0], gc[0],
                                    None if rawv is None else rawv[0], None if rawk is None else rawk[0], None,
                                    out, loc, slots, rows, wp, base, flush, L_RING, BLOCK, scale=DK**-0.5,
                                    null_block_id=-1, launch_mode="verify")
        qn, kn = gdn.prepare_qk(q.view(2, BLOCK, H, DK), kk.view(2, BLOCK, H, DK))
        gg, beta = gdn.gates(a.view(2, BLOCK, HV), b.view(2, BLOCK, HV), p["A_log"], p["dt_bias"])
        vv = v.view(2, BLOCK, HV, DV)
        _, o_ref = gdn.delta_rule_scan(ref.rec, kn, vv, gg, beta, q=qn)
        assert torch.allclose(out.view(2, BLOCK, HV, DV), o_ref, atol=atol)
        n = torch.randint(1, BLOCK + 1, (2,), generator=g)
        replay.record(ref, torch.zeros(2, DIM, BLOCK), kn, vv, gg, beta)
        before = ref.rec.clone()
        replay.commit(ref, n)
        k.commit_gdn_replayssm_spec(wp, base, flush, n.to(torch.int32), rows, L_RING, BLOCK, null_block_id=-1)
        track = rnd == 5  # snapshot request 0 at its first accepted step into slot 5 (prefix-cache tracking)
        k.commit_gdn_replayssm_circular(
            checkpoint_state=ckpt, d_cache=d, k_cache=kc, g_cache=gc, d_residual_cache=rawv, k_residual_cache=rawk,
            state_batch_indices=slots, replay_indices=rows, write_pos=wp, cache_base=base, is_flush=flush,
            accept_lens=n, mamba_track_indices=torch.tensor([5, -1]) if track else None,
            mamba_steps_to_track=torch.tensor([0, -1]) if track else None)
        folds += int((wp[rows] == 0).sum())
        for i in range(2):
            r = int(rows[i])
            S = _effective_state(ckpt[0, slots[i]], d[0], kc[0], gc[0], None if rawv is None else rawv[0],
                                 None if rawk is None else rawk[0], r, int(wp[r]), int(base[r]))
            assert torch.allclose(S, ref.rec[i], atol=atol)
            assert int(wp[r]) + 2 * BLOCK <= L_RING  # the next block always fits
        if track:
            one, _ = gdn.delta_rule_scan(before[:1], kn[:1, :1], vv[:1, :1], gg[:1, :1], beta[:1, :1])
            assert torch.allclose(ckpt[0, 5].transpose(-1, -2), one[0], atol=atol)
    assert folds >= 2


def test_replayssm_pad_rows_get_zero_output_and_leave_the_ring_alone():
    p = _params(9)
    ckpt, d, kc, gc = torch.ones(2, HV, DV, DK), torch.zeros(2, HV, L_RING, DV), torch.zeros(2, H, L_RING, DK), \
        torch.zeros(2, HV, L_RING)
    cursors = [torch.zeros(2, dtype=torch.int32) for _ in range(2)] + [torch.zeros(2, dtype=torch.int8)]
    out = torch.full((BLOCK, HV, DV), float("nan"))
    x = torch.randn(BLOCK, H, DK)
    k.gdn_replayssm_spec_decode(x, x, torch.randn(BLOCK, HV, DV), torch.randn(BLOCK, HV), torch.randn(BLOCK, HV),
                                p["A_log"], p["dt_bias"], ckpt, d, kc, gc, None, None, None, out,
                                torch.tensor([0, BLOCK]), torch.tensor([-1]), torch.tensor([0]), *cursors, L_RING,
                                BLOCK, null_block_id=-1, launch_mode="verify")
    assert (out == 0).all() and (d == 0).all() and (kc == 0).all()


def test_verify_conv_windows_roll_back_to_the_accepted_prefix():
    """causal_conv1d_update_cpu over a verify block keeps the window after every token; the commit's
    fused_conv_window_scatter_with_mask then leaves each slot with dspine.models.gdn.roll_window of the accepted
    part."""
    p = _params(11)
    g = _gen(12)
    conv = torch.randn(1, 3, DIM, KW - 1, generator=g)  # [layers, slots, dim, K-1]
    start = conv.clone()
    x = torch.randn(2, DIM, BLOCK, generator=g)
    inter = torch.zeros(1, 3, BLOCK, DIM, KW - 1)
    slots = torch.tensor([2, 0])
    y = k.causal_conv1d_update_cpu(x, conv[0], p["w"], None, "silu", slots, intermediate_conv_window=inter[0],
                                   intermediate_state_indices=torch.tensor([0, 1]))
    for i in range(2):
        win = start[0, slots[i]]
        ref = torch.nn.functional.silu(gdn.causal_conv(win[None], x[i : i + 1], p["w"]))[0]
        assert torch.allclose(y[i], ref, atol=1e-6)
    last = torch.tensor([1, 3])  # last accepted step (commit_lens - 1)
    k.fused_conv_window_scatter_with_mask(conv, inter, slots, last)
    for i in range(2):
        want = gdn.roll_window(start[0, slots[i]][None], x[i : i + 1], last[i : i + 1] + 1)[0]
        assert torch.equal(conv[0, slots[i]], want)
    assert torch.equal(conv[0, 1], start[0, 1])


def test_after_import_runs_every_callback_registered_for_one_module(tmp_path, monkeypatch):
    """The CPU bridges patch several kernels of one SGLang module (the ReplaySSM ring): every callback must run."""
    import sys

    from dspine.sglang.after_import import after_import

    (tmp_path / "dspine_after_import_probe.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("dspine_after_import_probe", lambda m: seen.append(("a", m.X)))
    after_import("dspine_after_import_probe", lambda m: seen.append(("b", m.X)))
    try:
        import dspine_after_import_probe  # noqa: F401

        assert seen == [("a", 1), ("b", 1)]
        after_import("dspine_after_import_probe", lambda m: seen.append(("c", m.X)))  # already imported: at once
        assert seen[-1] == ("c", 1)
    finally:
        sys.modules.pop("dspine_after_import_probe", None)
