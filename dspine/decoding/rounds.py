"""The three kinds of decoding round over a running batch: a plain step for every row (``plain_round``), the DSpine
draft's block (``spec_round``), and a round in which each row takes a plain step, the draft's block or its suffix
proposal (``mixed_round``). Each proposes, runs one target forward and hands the verdict to ``commit.py``."""

from __future__ import annotations

import torch

from dspine.decoding.acceptance import suffix_survival
from dspine.decoding.commit import record, verify_round
from dspine.decoding.config import StreamConfig
from dspine.decoding.rows import Row, seeds_positions
from dspine.decoding.running import RunningBatch
from dspine.decoding.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_FINAL,
    keyed_hash,
    keyed_uniforms,
    make_generator,
    sample_from,
    target_probs,
)
from dspine.decoding.schedule import DRAFT, SUFFIX, plan, plan_sources
from dspine.decoding.verify import accept
from dspine.models.target import Target


def draft_generators(rows: list[Row], sampled: list[bool]) -> list[torch.Generator | None]:
    """A fresh generator per sampled speculative row, seeded by (seed, position): the draft's draws for a round
    depend on nothing but the request and where it stands."""
    seeds, pos = seeds_positions(rows)
    h = keyed_hash(seeds, pos, STREAM_DRAFT, 2).tolist()
    return [make_generator((a << 32) | b) if s else None for (a, b), s in zip(h, sampled)]


def plain_round(target: Target, batch: RunningBatch, taps: tuple[int, ...] = ()) -> torch.Tensor | None:
    """One decode step for every row; returns the taps of the committed tokens when ``taps`` are asked for."""
    rows = batch.rows
    dev = target.device
    ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long, device=dev)
    out = target.forward(ids, batch.cache, taps=taps)
    p = target_probs(target.logits(out.hidden), [r.sp for r in rows])[:, 0]
    seeds, pos = seeds_positions(rows)
    toks = sample_from(p, keyed_uniforms(seeds, pos, STREAM_FINAL, 1)[:, 0].to(dev)).tolist()
    for r, t in zip(rows, toks):
        r.push([t])
    return out.taps


def spec_round(target: Target, batch: RunningBatch, cfg: StreamConfig) -> None:
    draft, rows, dev = cfg.draft, batch.rows, target.device
    B, n = len(rows), cfg.block_size - 1
    params = [r.sp for r in rows]
    greedy = torch.tensor([sp.greedy for sp in params], dtype=torch.bool)
    seeds, pos = seeds_positions(rows)
    anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
    if cfg.verify == "fixed":
        ell = torch.full((B,), n, dtype=torch.long)
    else:
        ell = plan(batch.hist.survival(), greedy, cfg.cost, cfg.nominal_rows)
    W = int(ell.max())
    if W == 0:  # no row drafts: exactly a plain step (same uniforms), the draft's context catches up later
        batch.pending.append((plain_round(target, batch, cfg.taps), torch.ones(B, dtype=torch.long)))
        for r in rows:
            r.stats.plain_steps += 1
        batch.hist.update(torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        return
    batch.catch_up(draft)
    pre = ell
    props, q = torch.zeros(B, 0, dtype=torch.long, device=dev), None
    if W > 0:
        sampled = [not sp.greedy and int(e) > 0 for sp, e in zip(params, ell)]
        temps = torch.tensor([sp.temperature if s else 0.0 for sp, s in zip(params, sampled)], device=dev)
        prop = draft.propose(batch.dcache, anchor, target, temps, draft_generators(rows, sampled),
                             block_size=W + 1, dynamic_threshold=cfg.dynamic_threshold)
        ell = torch.minimum(ell.to(dev), prop.n_draft.to(dev).clamp(0, W))
        conf = getattr(prop, "confidence", None)
        if cfg.verify == "cost" and conf is not None:  # reads the confidences (a host sync off the CPU)
            a = conf[:, :W].float().cpu().cumprod(-1)
            ell = plan(a, greedy, cfg.cost, cfg.nominal_rows, cap=ell.cpu(), sunk_block=W + 1,
                       row_blocks=pre + 1).to(dev)
        if dev.type == "cpu":  # free to read here: verify no wider than the longest row needs
            W = int(ell.max())
        props = prop.tokens[:, :W].to(dev)
        q = None if prop.q is None or W == 0 else prop.q[:, :W]
    ids = torch.cat([anchor[:, None], props], dim=1)
    out = target.forward(ids, batch.cache, speculative=W > 0, taps=cfg.taps)
    p = target_probs(target.logits(out.hidden), params)
    u_acc = keyed_uniforms(seeds, pos, STREAM_ACCEPT, W).to(dev)
    u_fin = keyed_uniforms(seeds, pos, STREAM_FINAL, 1)[:, 0].to(dev)
    verdict = accept(p, props, q, ell.to(dev), u_acc, u_fin)
    n_commit = verdict.n_accepted + 1
    if W > 0:
        target.commit(batch.cache, n_commit)
    draft.extend_context(batch.dcache, out.taps, n_commit)
    ell_l, acc_l = record(rows, verdict, ell, [DRAFT] * B)
    batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))



def mixed_round(target: Target, batch: RunningBatch, cfg: StreamConfig) -> None:
    """A round with suffix proposals on: per row a plain step, the draft's block or the row's suffix proposal
    (``schedule.plan_sources``), verified together in one ragged forward."""
    draft, rows, dev, src = cfg.draft, batch.rows, target.device, cfg.suffix
    B = len(rows)
    params = [r.sp for r in rows]
    greedy = torch.tensor([sp.greedy for sp in params], dtype=torch.bool)
    seeds, pos = seeds_positions(rows)
    a_sfx, sfx = suffix_survival(rows, src, src.max_len)
    a_draft = batch.hist.survival() if draft is not None else None
    pl = plan_sources(a_draft, a_sfx, greedy, cfg.cost)
    # the draft proposes for greedy rows only here: a batch of sampled rows (``--num-samples``) keeps no draft
    # context, so its rounds pay no taps and no upkeep (a greedy row admitted later brings its own from prefill)
    upkeep = batch.dcache is not None and bool(greedy.any())
    taps = cfg.taps if upkeep else ()
    source, ell = pl.source, pl.ell
    anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
    q, dprops = None, None  # q: the draft's proposal distributions, for sampled draft rows (none under auto)
    if pl.draft_block:
        batch.catch_up(draft)
        use = source == DRAFT
        sampled = [bool(u) and not sp.greedy for u, sp in zip(use.tolist(), params)]
        temps = torch.tensor([sp.temperature if s else 0.0 for sp, s in zip(params, sampled)], device=dev)
        prop = draft.propose(batch.dcache, anchor, target, temps, draft_generators(rows, sampled),
                             block_size=pl.draft_block, dynamic_threshold=cfg.dynamic_threshold)
        d_ell = torch.minimum(ell, prop.n_draft.cpu().clamp(0, pl.draft_block - 1))
        conf = getattr(prop, "confidence", None)
        if conf is not None and bool(use.any()):  # the draft's confidences re-plan its own rows
            idx = torch.nonzero(use).flatten()
            a = conf[idx, : pl.draft_block - 1].float().cpu().cumprod(-1)
            d_ell[idx] = plan(a, greedy[idx], cfg.cost, cfg.nominal_rows, cap=d_ell[idx],
                              sunk_block=pl.draft_block, row_blocks=ell[idx] + 1)
        ell = torch.where(use, d_ell, ell)
        dprops = prop.tokens  # only greedy rows take the draft here (``plan_sources``): no q is needed
    W = int(ell.max())
    if W == 0:  # every row takes a plain step (same uniforms as plain decoding)
        got = plain_round(target, batch, taps)
        if upkeep:
            batch.pending.append((got, torch.ones(B, dtype=torch.long)))
        for r in rows:
            r.stats.plain_steps += 1
        if batch.hist is not None:
            batch.hist.update(torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        return
    props = torch.zeros(B, W, dtype=torch.long)
    for b in range(B):
        e = int(ell[b])
        if source[b] == SUFFIX and e:
            props[b, :e] = torch.tensor(sfx[b][:e], dtype=torch.long)
        elif source[b] == DRAFT and e:
            props[b, :e] = dprops[b, :e].cpu()
    props = props.to(dev)
    ids = torch.cat([anchor[:, None], props], dim=1)
    out = target.forward(ids, batch.cache, speculative=True, taps=taps)
    logits = target.logits(out.hidden)  # [B, W+1, V]
    verdict = verify_round(logits, rows, props, q, ell, source == SUFFIX, seeds, pos)
    n_commit = verdict.n_accepted + 1
    target.commit(batch.cache, n_commit)
    if upkeep:
        if pl.draft_block:
            draft.extend_context(batch.dcache, out.taps, n_commit)
        else:  # the draft did not run: its upkeep waits until it does
            batch.pending.append((out.taps, n_commit.cpu()))
    ell_l, acc_l = record(rows, verdict, ell, source.tolist())
    if batch.hist is not None:
        batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))

