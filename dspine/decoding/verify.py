"""Lossless acceptance of a drafted block against the target, for the whole batch in tensor ops.

For each row the verifier sees target distributions ``p_0..p_L`` (``p_j`` is the target's distribution for
the token after verify slot j), the proposals ``x_1..x_L``, the proposal distributions ``q_1..q_L`` they were
drawn from (``None`` = deterministic proposals, i.e. one-hot q) and the row's verify length ``ℓ <= L``
(dynamic verification may stop early, down to ℓ = 0, a plain step; slots beyond ℓ are ignored).

Speculative sampling (Leviathan et al.; Chen et al.): accept ``x_j`` with probability
``min(1, p_j(x_j) / q_j(x_j))``; on the first rejection draw from ``norm(max(p_j - q_j, 0))``; if all ℓ are
accepted draw the bonus from ``p_ℓ``. Each committed token is then distributed exactly as ``p``. Greedy rows
are the degenerate case ``p = one-hot(argmax)``: the same formula accepts exactly while the proposal equals
the argmax, and the correction/bonus is the argmax.

Point proposals (``point`` rows: suffix matches, which are not drawn from any q) are verified by sampling the
target's own token at every slot with the uniform plain decoding would use there (``u_point``: keyed by the
position) and accepting while the proposal equals it. A point mass q = one-hot(x) is accepted with probability
``p(x)`` by either rule and the token after a rejection follows ``norm(p - q)`` either way, so this is the same
speculative sampling; but here every committed token *is* the plain decoding token, so a suffix row's output
equals plain decoding token for token, sampled or greedy, whatever was proposed.

The uniforms come from the caller (``u_accept [B, L]`` for the tests, ``u_final [B]`` for the last token):
the decoding loop keys them by request seed and position (``sampling.keyed_uniforms``), so they never depend
on the batch. Nothing here synchronises with the host: the result (with a per-row flag for a draft that
proposed outside its own q) stays on the device until the caller reads it once (``check_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine.decoding.sampling import sample_from


@dataclass
class Verdict:
    n_accepted: torch.Tensor  # LongTensor [B]: accepted draft tokens per row (0..ℓ)
    committed: torch.Tensor  # LongTensor [B, L+1]: row b commits committed[b, : n_accepted[b] + 1]
    invalid: torch.Tensor  # BoolTensor [B]: the draft proposed a token outside its own q (a draft bug)

    @property
    def tokens(self) -> list[list[int]]:
        """Committed tokens per row (accepted drafts + the correction/bonus token); one host read."""
        host = torch.cat([self.n_accepted[:, None], self.invalid[:, None].long(), self.committed], dim=1).tolist()
        return [row[2 : row[0] + 3] for row in check_rows(host)]


def check_rows(host: list[list[int]]) -> list[list[int]]:
    """Raise on a row flagged invalid in a host copy laid out as [n_accepted, invalid, committed...]."""
    if any(row[1] for row in host):
        raise RuntimeError("draft proposed a token outside the support of its own q")
    return host


def accept_greedy(target_tokens: torch.Tensor, proposals: torch.Tensor, n_draft: torch.Tensor) -> Verdict:
    """Greedy rows without their distributions: target_tokens [B, L+1] (the argmax at every slot), proposals
    [B, L], n_draft [B]. Exactly ``accept`` with one-hot p (accept while a proposal equals the argmax, then the
    argmax), without building [B, L+1, V] probabilities: on a CPU that tensor costs more than a wide verify."""
    B, L1 = target_tokens.shape
    L = L1 - 1
    dev = target_tokens.device
    if L:
        inside = torch.arange(L, device=dev)[None, :] < n_draft.to(dev).clamp(0, L)[:, None]
        n_acc = ((target_tokens[:, :L] == proposals[:, :L].to(dev)) & inside).long().cumprod(-1).sum(-1)
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    return Verdict(n_acc, target_tokens, torch.zeros(B, dtype=torch.bool, device=dev))


def accept(
    p: torch.Tensor,
    proposals: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor,
    u_accept: torch.Tensor,
    u_final: torch.Tensor,
    point: torch.Tensor | None = None,
    u_point: torch.Tensor | None = None,
) -> Verdict:
    """p [B, L+1, V] processed target probs; proposals [B, L]; q [B, L, V] or None; n_draft [B] (≤ L);
    u_accept [B, ≥L] and u_final [B] uniforms in [0, 1); ``point`` [B] bool: rows whose proposals are point
    masses, verified by matching the target's token sampled with ``u_point`` [B, L+1] (slot j's plain uniform)."""
    B, L1, V = p.shape
    L = L1 - 1
    dev = p.device
    props = proposals[:, :L].to(dev)
    ell = n_draft.to(dev).clamp(0, L)
    if L:
        px = p[:, :L].gather(-1, props[..., None])[..., 0]  # [B, L]
        qx = torch.ones_like(px) if q is None else q[:, :L].to(dev, p.dtype).gather(-1, props[..., None])[..., 0]
        inside = torch.arange(L, device=dev)[None, :] < ell[:, None]
        invalid = ((qx <= 0) & inside).any(-1)
        ok = (u_accept[:, :L].to(dev) * qx < px) & inside  # accept with probability min(1, p/q)
        n_acc = ok.long().cumprod(-1).sum(-1)  # length of the accepted prefix
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=dev)
        invalid = torch.zeros(B, dtype=torch.bool, device=dev)
    rows = torch.arange(B, device=dev)
    p_last = p[rows, n_acc]  # [B, V]: where the round ends
    rejected = n_acc < ell
    if L:
        slot = n_acc.clamp(max=L - 1)
        if q is None:
            q_last = torch.nn.functional.one_hot(props[rows, slot], V).to(p.dtype)
        else:
            q_last = q[rows, slot].to(dev, p.dtype)
        resid = torch.where(rejected[:, None], (p_last - q_last).clamp_min(0), p_last)
        empty = resid.sum(-1) <= 0  # only reachable through rounding when p == q
        resid = torch.where(empty[:, None], p_last, resid)
    else:
        resid = p_last
    last = sample_from(resid, u_final.to(dev))
    committed = torch.cat([props, torch.zeros(B, 1, dtype=torch.long, device=dev)], dim=1)
    committed[rows, n_acc] = last
    if point is not None and bool(point.any()):
        pt = point.to(dev)
        own = sample_from(p, u_point.to(dev))  # [B, L+1]: the plain token at every slot
        if L:
            inside = torch.arange(L, device=dev)[None, :] < ell[:, None]
            match = (own[:, :L] == props) & inside
            n_pt = match.long().cumprod(-1).sum(-1)
        else:
            n_pt = torch.zeros(B, dtype=torch.long, device=dev)
        n_acc = torch.where(pt, n_pt, n_acc)
        committed = torch.where(pt[:, None], own, committed)
        invalid = invalid & ~pt
    return Verdict(n_acc, committed, invalid)
