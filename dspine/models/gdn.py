"""Gated DeltaNet (the Qwen3.5 ``linear_attention`` layer) as plain functions on explicit state.

Conventions match Hugging Face ``transformers`` (``models/qwen3_5/modeling_qwen3_5.py``) and the FLA kernels it
mirrors:

- the fused projection ``in_proj_qkv`` yields the conv input ``u`` with channels ``[q | k | v]``
  (``C = 2 * key_dim + value_dim``); a causal depthwise conv (kernel ``K``, no bias) and SiLU follow;
- q and k are L2-normalised per head in fp32 (eps 1e-6 inside the rsqrt); q is then scaled by ``D_k ** -0.5``;
- one key head serves ``H_v / H_k`` *consecutive* value heads (``repeat_interleave``, not ``repeat``);
- gates: ``beta = sigmoid(b)`` and log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (so ``exp(g)`` in (0, 1));
- recurrence per value head, state ``S [D_k, D_v]`` in fp32:
  ``S <- exp(g) S;  S <- S + beta * k (v - S^T k)^T;  o = S^T q``;
- output: RMSNorm of ``o`` per head with a plain (not zero-centred) weight, times ``silu(z)``.

We always run the recurrence token by token with :func:`delta_rule_scan`, for prefill too (HF uses a chunked
kernel there; it is the same math, equal to ~1e-6 in fp32). One step function serves prefill, decode,
speculative verify and ReplaySSM's commit, so a replayed state is bit-identical to one computed directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(window: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of new inputs ``u`` continuing after ``window`` (pre-activation).

    window [B, C, K-1] (the previous K-1 conv inputs, zeros at sequence start), u [B, C, T], weight [C, K]
    -> [B, C, T] in ``u.dtype``. Output t is ``sum_j weight[:, j] * x[:, t + j]`` with ``x = window ++ u``
    (cross-correlation, as ``F.conv1d``: ``weight[:, K-1]`` multiplies the current token). Accumulates in
    fp32. The same code serves a whole prefill and a single decode step (T = 1).
    """
    T = u.shape[-1]
    K = weight.shape[-1]
    x = torch.cat([window.to(u.dtype), u], dim=-1).float()  # [B, C, K-1+T]
    w = weight.float()
    out = x[:, :, 0:T] * w[:, 0:1]
    for j in range(1, K):
        out = out + x[:, :, j : j + T] * w[:, j : j + 1]
    return out.to(u.dtype)


def roll_window(window: torch.Tensor, u: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The conv window after accepting the first ``n[b]`` of ``u``: the last K-1 of ``window ++ u[b, :, :n[b]]``.

    window [B, C, K-1], u [B, C, T], n LongTensor [B] with 0 <= n <= T -> [B, C, K-1] (``window.dtype``).
    """
    km1 = window.shape[-1]
    x = torch.cat([window, u.to(window.dtype)], dim=-1)  # [B, C, K-1+T]
    # the accepted stream is x[b, :, :K-1+n[b]]; its last K-1 entries start at n[b]
    idx = n.to(torch.long)[:, None] + torch.arange(km1, device=window.device)  # [B, K-1]
    return x.gather(-1, idx[:, None, :].expand(-1, x.shape[1], -1))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA/HF convention: ``x * rsqrt(sum(x^2) + eps)`` over the last dim (not ``x / max(|x|, eps)``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H_k, D_k] (post-conv, any dtype) -> fp32, L2-normalised; q also scaled by ``D_k ** -0.5``."""
    q = l2norm(q.float())
    k = l2norm(k.float())
    return q * (q.shape[-1] ** -0.5), k


def gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [B, T, H_v] (projections), A_log, dt_bias [H_v] -> (g, beta) fp32 [B, T, H_v].

    ``g`` is the log-decay (``<= 0``); beta is computed in the model dtype first, as HF does.
    """
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g.float(), beta


def delta_rule_step(
    S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One gated-delta-rule update. S [B, H_v, D_k, D_v] fp32; k [B, H_v, D_k], v [B, H_v, D_v]; g, beta [B, H_v].

    Returns the new state (never mutates ``S``: ReplaySSM relies on the checkpoint staying intact).
    """
    return delta_rule_update(S, k, v, g, beta)[0]


def delta_rule_update(
    S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_rule_step` that also returns its update vector ``delta`` [B, H_v, D_v]: the new state is
    ``exp(g) S + k delta^T``, so a record of ``(k, delta, g)`` replays the step exactly (:func:`decay_add`)."""
    S = S * g.exp()[..., None, None]
    kv_mem = (k[..., None, :] @ S).squeeze(-2)  # [B, H_v, D_v]: what S already predicts for k
    delta = (v - kv_mem) * beta[..., None]  # [B, H_v, D_v]
    return S + k[..., :, None] * delta[..., None, :], delta


def decay_add(S: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``exp(g) S + k delta^T``: one step replayed from a :func:`delta_rule_update` record (same shapes)."""
    return S * g.exp()[..., None, None] + k[..., :, None] * delta[..., None, :]


def delta_rule_read(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """o = S^T q. S [B, H_v, D_k, D_v], q [B, H_v, D_k] -> [B, H_v, D_v]."""
    return (q[..., None, :] @ S).squeeze(-2)


def delta_rule_scan(
    S: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    q: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run :func:`delta_rule_step` over T tokens.

    S [B, H_v, D_k, D_v] fp32 (not mutated); k [B, T, H_k, D_k], v [B, T, H_v, D_v], g/beta [B, T, H_v] (fp32,
    from :func:`prepare_qk` / :func:`gates`); q [B, T, H_k, D_k] or None (state only); valid bool [B, T] or
    None: where ``valid[b, t]`` is False the state of row b is carried over unchanged (right padding, or
    draft tokens past the accepted prefix). Returns (final state, outputs [B, T, H_v, D_v] fp32 or None).
    """
    T = k.shape[1]
    rep = v.shape[2] // k.shape[2]
    if rep > 1:  # key head h serves value heads h*rep .. h*rep+rep-1
        k = k.repeat_interleave(rep, dim=2)
        q = None if q is None else q.repeat_interleave(rep, dim=2)
    out = None if q is None else v.new_empty(v.shape)
    for t in range(T):
        S_new = delta_rule_step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
        if out is not None:
            out[:, t] = delta_rule_read(S_new, q[:, t])
        S = S_new if valid is None else torch.where(valid[:, t, None, None, None], S_new, S)
    return S, out


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: ``weight * rmsnorm(x) * silu(z)`` over the last dim (plain weight, init 1).

    Unlike the zero-centred Qwen3.5 RMSNorm, the weight is used as is; the normalised x is cast back to the
    input dtype before the weight multiply and the gate runs in fp32 (HF ``Qwen3_5RMSNormGated``).
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(z.float())).to(dtype)
