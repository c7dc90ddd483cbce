"""Verification bookkeeping of a round: the logits of the slots the round reads, through the processing seam
(``processors.process``), the verdict for a batch of greedy and sampled rows (``verify_slots``), then the one
host read that pushes each row's committed tokens and counts its stats by source (``record``). ``sample_first``
does the same for a step that verifies nothing (a plain step, the first token after a prompt)."""

from __future__ import annotations

import torch

from dspine.cpu.kernels import argmax
from dspine.decoding.acceptance import SUFFIX_DECAY, JobAcceptance
from dspine.decoding.processors import Logprobs, grammar_masks, process
from dspine.decoding.rows import Row, seeds_positions
from dspine.decoding.sampling import STREAM_ACCEPT, STREAM_FINAL, keyed_uniforms, sample_from, target_probs
from dspine.decoding.schedule import DRAFT, FORCED, SUFFIX
from dspine.decoding.verify import Verdict, accept, accept_greedy, check_rows
from dspine.models.target import Target


def sample_first(target: Target, hidden: torch.Tensor, rows: list[Row]) -> list[int]:
    """One token per row from final hidden states [rows, H] (the slot after each row's last committed token):
    processed (``processors.process``) and sampled with the uniforms plain decoding draws at that position; pushed
    to the rows (with their logprobs). Returns the tokens."""
    dev = hidden.device
    logits = target.logits(hidden)  # [rows, V]
    states = [r.state for r in rows]
    lp = None
    if any(s is not None for s in states):
        n = list(range(len(rows)))
        zeros = [0] * len(rows)
        masks, _ = grammar_masks(states, None, None)
        lp = Logprobs.of(logits, states, n, zeros)
        logits = process(logits, states, n, zeros, None, masks)
    if all(r.sp.greedy for r in rows):
        # the token sample_from draws from target_probs' one-hot at the argmax, without building the one-hot, its
        # cumulative sum and the uniforms ([rows, V] each: ~1 ms a step at 32 rows)
        toks = argmax(logits).tolist()
    else:
        p = target_probs(logits[:, None], [r.sp for r in rows])[:, 0]
        seeds, pos = seeds_positions(rows)
        toks = sample_from(p, keyed_uniforms(seeds, pos, STREAM_FINAL, 1)[:, 0].to(dev)).tolist()
    for b, (r, t) in enumerate(zip(rows, toks)):
        entry = [lp.take(b, 0, t, r.sp.logprobs)] if lp is not None and (b, 0) in lp.where else None
        r.push([t], entry)
    return toks


def verify_slots(target: Target, hidden: torch.Tensor, rows: list[Row], props: torch.Tensor, ell: torch.Tensor,
                 live: torch.Tensor, point: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                 masks: dict[int, torch.Tensor] | None = None, q: torch.Tensor | None = None
                 ) -> tuple[Verdict, Logprobs | None]:
    """The round's verdict from the forward's final hidden states [B, W+1, H]: the logits of the slots each live
    row verifies only (its anchor and ℓ proposals: ``N = Σ (1 + ℓ)`` rows through the head instead of
    ``B (W + 1)``), processed (``processors.process``: slot j with the proposals before it in the row's history;
    ``masks`` the grammar masks walked before the forward), greedy rows by argmax alone (``verify.accept_greedy``),
    sampled rows by speculative sampling over their processed distributions (``verify.accept``; ``point`` rows as
    point masses, the others against the draft's ``q`` [B, W, V] when given). Also the raw logprob facts of the
    rows that asked for them."""
    dev = hidden.device
    B, W1 = hidden.shape[:2]
    W = W1 - 1
    valid = (torch.arange(W1)[None, :] <= ell[:, None]) & live[:, None]  # [B, W+1] (host)
    b_t, j_t = torch.nonzero(valid, as_tuple=True)
    logits = target.logits(hidden[b_t.to(dev), j_t.to(dev)])  # [N, V]
    states = [r.state for r in rows]
    lp = None
    if any(s is not None for s in states):
        b_idx, j_idx = b_t.tolist(), j_t.tolist()
        lp = Logprobs.of(logits, states, b_idx, j_idx)
        logits = process(logits, states, b_idx, j_idx, props.cpu(), masks)
    top = torch.zeros(B, W1, dtype=torch.long, device=dev)
    top[b_t.to(dev), j_t.to(dev)] = argmax(logits)
    verdict = accept_greedy(top, props, ell)
    greedy = torch.tensor([r.sp.greedy for r in rows], dtype=torch.bool)
    sampled = ~greedy & live
    if not bool(sampled.any()):
        return verdict, lp
    s = torch.nonzero(sampled).flatten()
    where = torch.full((B,), -1, dtype=torch.long)
    where[s] = torch.arange(len(s))
    mine = sampled[b_t]
    full = logits.new_zeros(len(s), W1, logits.shape[-1])  # the sampled rows' slots, padded again
    full[where[b_t[mine]].to(dev), j_t[mine].to(dev)] = logits[mine.to(dev)]
    p = target_probs(full, [rows[int(b)].sp for b in s])
    u_acc = keyed_uniforms(seeds[s], pos[s], STREAM_ACCEPT, W).to(dev)
    u_fin = keyed_uniforms(seeds[s], pos[s], STREAM_FINAL, 1)[:, 0].to(dev)
    pt = point[s]
    u_point = None
    if bool(pt.any()):  # slot j's uniform is the one plain decoding draws at position pos + j
        j = torch.arange(W + 1)
        u_point = keyed_uniforms(seeds[s].repeat_interleave(W + 1), (pos[s][:, None] + j).flatten(), STREAM_FINAL, 1)
        u_point = u_point.view(len(s), W + 1).to(dev)
    qs = None if q is None or W == 0 else q[s.to(dev), :W]
    v = accept(p, props[s.to(dev)], qs, ell[s].to(dev), u_acc, u_fin, point=pt, u_point=u_point)
    sd = s.to(dev)
    verdict.n_accepted[sd] = v.n_accepted
    verdict.committed[sd] = v.committed
    verdict.invalid[sd] = v.invalid
    return verdict, lp


def record(rows: list[Row], verdict, ell: torch.Tensor, sources: list[int], live: list[bool] | None = None,
           job: JobAcceptance | None = None, lp: Logprobs | None = None, forced: list[int] | None = None,
           suffix_expected: float = 0.0) -> tuple[list[int], list[int]]:
    """Read the round's outcome (its one host read), push each live row's committed tokens (with their logprobs)
    and count its stats, by source, into the row and the job's pooled acceptance; returns the draft's (verified,
    accepted) per row for its history (0, 0 where the draft did not propose or the row is finished). ``forced``:
    per row, how many leading proposed tokens its grammar forced (the rest of a FORCED row's proposal is a suffix
    match chained after them). ``suffix_expected``: the tokens the suffix rows' survival estimates expected kept
    (``JobAcceptance.observe_suffix_estimate`` compares them with the kept ones)."""
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
        toks = committed[: k + 1]
        entries = None
        if lp is not None and (b, 0) in lp.where:
            entries = [lp.take(b, j, t, r.sp.logprobs) for j, t in enumerate(toks)]
        kept = r.push(toks, entries)
        if e == 0:
            st.plain_steps += 1
        else:
            st.verify_steps += 1
            st.draft_tokens_proposed += e
            st.draft_tokens_accepted += k
            st.accept_histogram[k] += 1
            st.round_tokens += kept
            if src == FORCED:
                nf = min(forced[b] if forced else e, e)
                st.forced_steps += 1
                st.forced_proposed += nf
                st.forced_accepted += min(k, nf)
                if job is not None:
                    job.count("forced", nf, min(k, nf))
                    job.observe_forced(min(k + 1, nf), min(k, nf))
                if e > nf:  # a suffix match chained after the forced tokens
                    st.suffix_steps += 1
                    st.suffix_proposed += e - nf
                    st.suffix_accepted += max(k - nf, 0)
                    if job is not None:
                        job.count("suffix", e - nf, max(k - nf, 0))
            elif src == SUFFIX:
                if job is not None:
                    job.count("suffix", e, k)
                st.suffix_steps += 1
                st.suffix_proposed += e
                st.suffix_accepted += k
                tried = min(k + 1, e)  # tokens reached: the accepted ones and the first rejected
                r.sfx_trials = r.sfx_trials * SUFFIX_DECAY + tried
                r.sfx_hits = r.sfx_hits * SUFFIX_DECAY + k
                sfx_trials += tried
                sfx_hits += k
            else:
                if job is not None:
                    job.count("dspine", e, k)
                st.dspine_steps += 1
                st.dspine_proposed += e
                st.dspine_accepted += k
        ell_l.append(e if src == DRAFT else 0)
        acc_l.append(k if src == DRAFT else 0)
    if job is not None:
        job.observe_suffix(sfx_trials, sfx_hits)
        job.observe_suffix_estimate(suffix_expected, sfx_hits)
        job.observe_draft(ell_l, acc_l)
    return ell_l, acc_l
