"""Verification bookkeeping of a round: the verdict for a batch of greedy and sampled rows (``verify_round``), then
the one host read that pushes each row's committed tokens and counts its stats by source (``record``)."""

from __future__ import annotations

import torch

from dspine.decoding.acceptance import SUFFIX_DECAY, JobAcceptance
from dspine.decoding.rows import Row
from dspine.decoding.sampling import STREAM_ACCEPT, STREAM_FINAL, keyed_uniforms, target_probs
from dspine.decoding.schedule import DRAFT, SUFFIX
from dspine.decoding.verify import Verdict, accept, accept_greedy, check_rows
from dspine.models.target import Target


def verify_slots(target: Target, hidden: torch.Tensor, rows: list[Row], props: torch.Tensor, ell: torch.Tensor,
                 live: torch.Tensor, point: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor) -> Verdict:
    """The round's verdict from the forward's final hidden states [B, W+1, H]: the logits of the slots each live
    row verifies only (its anchor and ℓ proposals: ``N = Σ (1 + ℓ)`` rows through the head instead of
    ``B (W + 1)``), greedy rows by argmax alone (``verify.accept_greedy``), sampled rows by speculative sampling
    over their processed distributions (``verify.accept``; suffix rows as point masses)."""
    dev = hidden.device
    B, W1 = hidden.shape[:2]
    W = W1 - 1
    valid = (torch.arange(W1)[None, :] <= ell[:, None]) & live[:, None]  # [B, W+1] (host)
    b_idx, j_idx = torch.nonzero(valid, as_tuple=True)
    logits = target.logits(hidden[b_idx.to(dev), j_idx.to(dev)])  # [N, V]
    top = torch.zeros(B, W1, dtype=torch.long, device=dev)
    top[b_idx.to(dev), j_idx.to(dev)] = logits.argmax(-1)
    verdict = accept_greedy(top, props, ell)
    greedy = torch.tensor([r.sp.greedy for r in rows], dtype=torch.bool)
    sampled = ~greedy & live
    if not bool(sampled.any()):
        return verdict
    s = torch.nonzero(sampled).flatten()
    where = torch.full((B,), -1, dtype=torch.long)
    where[s] = torch.arange(len(s))
    mine = sampled[b_idx]
    full = logits.new_zeros(len(s), W1, logits.shape[-1])  # the sampled rows' slots, padded again
    full[where[b_idx[mine]].to(dev), j_idx[mine].to(dev)] = logits[mine.to(dev)]
    p = target_probs(full, [rows[int(b)].sp for b in s])
    u_acc = keyed_uniforms(seeds[s], pos[s], STREAM_ACCEPT, W).to(dev)
    u_fin = keyed_uniforms(seeds[s], pos[s], STREAM_FINAL, 1)[:, 0].to(dev)
    pt = point[s]
    u_point = None
    if bool(pt.any()):  # slot j's uniform is the one plain decoding draws at position pos + j
        j = torch.arange(W + 1)
        u_point = keyed_uniforms(seeds[s].repeat_interleave(W + 1), (pos[s][:, None] + j).flatten(), STREAM_FINAL, 1)
        u_point = u_point.view(len(s), W + 1).to(dev)
    v = accept(p, props[s.to(dev)], None, ell[s].to(dev), u_acc, u_fin, point=pt, u_point=u_point)
    sd = s.to(dev)
    verdict.n_accepted[sd] = v.n_accepted
    verdict.committed[sd] = v.committed
    verdict.invalid[sd] = v.invalid
    return verdict


def record(rows: list[Row], verdict, ell: torch.Tensor, sources: list[int], live: list[bool] | None = None,
           job: JobAcceptance | None = None) -> tuple[list[int], list[int]]:
    """Read the round's outcome (its one host read), push each live row's committed tokens and count its stats,
    by source, into the row and the job's pooled acceptance; returns the draft's (verified, accepted) per row for
    its history (0, 0 where the draft did not propose or the row is finished)."""
    dev = verdict.n_accepted.device
    host = torch.cat([verdict.n_accepted[:, None], verdict.invalid[:, None].long(), ell.to(dev)[:, None],
                      verdict.committed], dim=1).tolist()
    ell_l, acc_l = [], []
    sfx_trials = sfx_hits = 0.0
    for b, (r, src, (k, _, e, *committed)) in enumerate(zip(rows, sources, check_rows(host))):
        if live is not None and not live[b]:
            ell_l.append(0)
            acc_l.append(0)
            continue
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
            if job is not None:
                job.count("suffix" if src == SUFFIX else "dspine", e, k)
            if src == SUFFIX:
                st.suffix_steps += 1
                st.suffix_proposed += e
                st.suffix_accepted += k
                tried = min(k + 1, e)  # tokens reached: the accepted ones and the first rejected
                r.sfx_trials = r.sfx_trials * SUFFIX_DECAY + tried
                r.sfx_hits = r.sfx_hits * SUFFIX_DECAY + k
                sfx_trials += tried
                sfx_hits += k
            else:
                st.dspine_steps += 1
                st.dspine_proposed += e
                st.dspine_accepted += k
        ell_l.append(e if src == DRAFT else 0)
        acc_l.append(k if src == DRAFT else 0)
    if job is not None:
        job.observe_suffix(sfx_trials, sfx_hits)
        job.observe_draft(ell_l, acc_l)
    return ell_l, acc_l
