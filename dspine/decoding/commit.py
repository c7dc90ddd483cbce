"""Verification bookkeeping of a round: the verdict for a batch of greedy and sampled rows (``verify_round``), then
the one host read that pushes each row's committed tokens and counts its stats by source (``record``)."""

from __future__ import annotations

import torch

from dspine.decoding.rows import Row
from dspine.decoding.sampling import STREAM_ACCEPT, STREAM_FINAL, keyed_uniforms, target_probs
from dspine.decoding.schedule import DRAFT, SUFFIX
from dspine.decoding.verify import Verdict, accept, accept_greedy, check_rows


def verify_round(logits: torch.Tensor, rows: list[Row], props: torch.Tensor, q: torch.Tensor | None, ell: torch.Tensor,
            point: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor) -> Verdict:
    """The round's verdict: greedy rows by argmax alone (``verify.accept_greedy``), sampled rows by speculative
    sampling over their processed distributions (``verify.accept``; suffix rows as point masses)."""
    dev = logits.device
    B, W1 = logits.shape[:2]
    W = W1 - 1
    greedy = torch.tensor([r.sp.greedy for r in rows], dtype=torch.bool)
    verdict = accept_greedy(logits.argmax(-1), props, ell)
    if bool(greedy.all()):
        return verdict
    s = torch.nonzero(~greedy).flatten()
    p = target_probs(logits[s.to(dev)], [rows[int(b)].sp for b in s])
    u_acc = keyed_uniforms(seeds[s], pos[s], STREAM_ACCEPT, W).to(dev)
    u_fin = keyed_uniforms(seeds[s], pos[s], STREAM_FINAL, 1)[:, 0].to(dev)
    pt = point[s]
    u_point = None
    if bool(pt.any()):  # slot j's uniform is the one plain decoding draws at position pos + j
        j = torch.arange(W + 1)
        u_point = keyed_uniforms(seeds[s].repeat_interleave(W + 1), (pos[s][:, None] + j).flatten(), STREAM_FINAL, 1)
        u_point = u_point.view(len(s), W + 1).to(dev)
    v = accept(p, props[s.to(dev)], None if q is None else q[s.to(dev)], ell[s].to(dev), u_acc, u_fin, point=pt,
               u_point=u_point)
    sd = s.to(dev)
    verdict.n_accepted[sd] = v.n_accepted
    verdict.committed[sd] = v.committed
    verdict.invalid[sd] = v.invalid
    return verdict


def record(rows: list[Row], verdict, ell: torch.Tensor, sources: list[int]) -> tuple[list[int], list[int]]:
    """Read the round's outcome (its one host read), push each row's committed tokens and count its stats, by
    source; returns the draft's (verified, accepted) per row for its history (0, 0 where the draft did not
    propose)."""
    dev = verdict.n_accepted.device
    host = torch.cat([verdict.n_accepted[:, None], verdict.invalid[:, None].long(), ell.to(dev)[:, None],
                      verdict.committed], dim=1).tolist()
    ell_l, acc_l = [], []
    for r, src, (k, _, e, *committed) in zip(rows, sources, check_rows(host)):
        st = r.stats
        kept = r.push(committed[: k + 1])
        if e == 0:
            st.plain_steps += 1
        else:
            st.verify_steps += 1
            st.draft_tokens_proposed += e
            st.draft_tokens_accepted += k
            st.accept_histogram[k] += 1
            st.round_tokens += kept
            if src == SUFFIX:
                st.suffix_steps += 1
                st.suffix_proposed += e
                st.suffix_accepted += k
                r.sfx_trials += min(k + 1, e)
                r.sfx_hits += k
            else:
                st.dspine_steps += 1
                st.dspine_proposed += e
                st.dspine_accepted += k
        ell_l.append(e if src == DRAFT else 0)
        acc_l.append(k if src == DRAFT else 0)
    return ell_l, acc_l

