"""Lossless acceptance of a drafted block against the target.

For each row the verifier sees target distributions ``p_0..p_L`` (``p_j`` is the target's distribution for
the token after verify slot j), the proposals ``x_1..x_L``, the proposal distributions ``q_1..q_L`` they were
drawn from (``None`` = deterministic proposals, i.e. one-hot q) and the row's draft length ``ℓ <= L``
(dynamic verification may stop early; slots beyond ℓ are ignored).

Speculative sampling (Leviathan et al.; Chen et al.): accept ``x_j`` with probability
``min(1, p_j(x_j) / q_j(x_j))``; on the first rejection draw from ``norm(max(p_j - q_j, 0))``; if all ℓ are
accepted draw the bonus from ``p_ℓ``. Each committed token is then distributed exactly as ``p``. Greedy rows
are the degenerate case ``p = one-hot(argmax)``: accept while the proposal equals the argmax.

Each row consumes exactly ``L_max + 1`` uniforms from its own generator per round (``L_max`` = block
size − 1), whatever happens, so its random stream does not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import SamplingParams, sample_from


@dataclass
class Verdict:
    n_accepted: torch.Tensor  # LongTensor [B]: accepted draft tokens per row (0..ℓ)
    tokens: list[list[int]]  # committed tokens per row: accepted drafts + the correction/bonus token


def accept(
    p: torch.Tensor,
    proposals: torch.Tensor,
    q: torch.Tensor | None,
    n_draft: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    uniforms_per_round: int,
) -> Verdict:
    """p [B, L+1, V] processed target probs; proposals [B, L]; q [B, L, V] or None; n_draft [B] (≤ L)."""
    B, L1, V = p.shape
    L = L1 - 1
    n_acc = torch.zeros(B, dtype=torch.long)
    tokens: list[list[int]] = []
    props = proposals[:, :L].tolist()
    ell = n_draft.tolist()
    for b in range(B):
        sp = params[b]
        lb = min(int(ell[b]), L)
        if sp.greedy:
            am = p[b].argmax(-1).tolist()  # p is one-hot for greedy rows
            j = 0
            while j < lb and props[b][j] == am[j]:
                j += 1
            n_acc[b] = j
            tokens.append(props[b][:j] + [am[j]])
            continue
        u = torch.rand(uniforms_per_round, generator=generators[b], device="cpu")
        j = 0
        out: list[int] = []
        rejected = False
        while j < lb:
            x = props[b][j]
            px = float(p[b, j, x])
            qx = 1.0 if q is None else float(q[b, j, x])
            if qx <= 0:
                raise RuntimeError("draft proposed a token outside the support of its own q")
            if float(u[j]) < px / qx:  # accept with probability min(1, p/q)
                out.append(x)
                j += 1
                continue
            if q is None:
                resid = p[b, j].clone()
                resid[x] = 0.0
            else:
                resid = (p[b, j] - q[b, j].to(p.dtype)).clamp_min(0)
            if float(resid.sum()) <= 0:  # only reachable through rounding when p == q
                resid = p[b, j]
            out.append(int(sample_from(resid, u[-1])))
            rejected = True
            break
        if not rejected:
            out.append(int(sample_from(p[b, j], u[-1])))
        n_acc[b] = j
        tokens.append(out)
    return Verdict(n_acc, tokens)
