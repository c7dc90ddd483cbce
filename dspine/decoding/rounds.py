"""The three kinds of decoding round over a running batch: a plain step for every row (``plain_round``), the DSpine
draft's block (``spec_round``), and a round in which each row takes a plain step, the draft's block or its suffix
proposal (``mixed_round``). Each proposes, runs one target forward and hands the verdict to ``commit.py``."""

from __future__ import annotations

import time

import torch

from dspine.decoding.acceptance import point_proposals
from dspine.decoding.commit import record, sample_first, verify_slots
from dspine.decoding.config import StreamConfig
from dspine.decoding.explain import break_even, draft_outlook
from dspine.decoding.prices import Stopwatch
from dspine.decoding.processors import grammar_masks
from dspine.decoding.rows import Row, seeds_positions
from dspine.decoding.running import RunningBatch
from dspine.decoding.sampling import (
    STREAM_DRAFT,
    keyed_hash,
    make_generator,
)
from dspine.decoding.schedule import DRAFT, FORCED, SUFFIX, plan, plan_packed, plan_sources
from dspine.decoding.suffix import SuffixSource
from dspine.models.target import Target


def draft_generators(rows: list[Row], sampled: list[bool]) -> list[torch.Generator | None]:
    """A fresh generator per sampled speculative row, seeded by (seed, position): the draft's draws for a round
    depend on nothing but the request and where it stands."""
    seeds, pos = seeds_positions(rows)
    h = keyed_hash(seeds, pos, STREAM_DRAFT, 2).tolist()
    return [make_generator((a << 32) | b) if s else None for (a, b), s in zip(h, sampled)]


def feed_suffix(src: SuffixSource, rows: list[Row]) -> None:
    """Give the suffix source the tokens each row committed since it last saw the row. Called where a lookup is
    about to read the corpora (``mixed_round``, rounds that look for proposals) and when a row finishes (its
    output joins the finished rows' corpus), not after every round: the tokens of quiet rounds
    (``_quiet_round``) wait and go in with the next round that looks, so no index is fed that no lookup reads,
    and what every lookup reads is what feeding after every round would have given it."""
    for r in rows:
        if len(r.tokens) > r.fed:
            src.extend(r.index, r.tokens[r.fed :])
            r.fed = len(r.tokens)


def plain_round(target: Target, batch: RunningBatch, taps: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One decode step for every live row; returns the taps of the committed tokens (when ``taps`` are asked
    for) and the tokens each row committed (1, or 0 for a finished row kept in its slot: it computes nothing)."""
    rows = batch.rows
    dev = target.device
    live = [r.finish is None for r in rows]
    n = torch.tensor(live, dtype=torch.long)
    everyone = all(live)
    ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long, device=dev)
    out = target.forward(ids, batch.cache, n_valid=None if everyone else n.to(dev), taps=taps)
    idx = list(range(len(rows))) if everyone else [b for b, x in enumerate(live) if x]
    hidden = out.hidden[:, 0] if everyone else out.hidden[idx, 0]
    sample_first(target, hidden, [rows[b] for b in idx])
    return out.taps, n


def grammar_cut(ell: torch.Tensor, cut: torch.Tensor, drawn: torch.Tensor | None) -> torch.Tensor:
    """Verify lengths after the grammar walk (``processors.grammar_masks``' ``cut``: per row, how many proposed
    tokens the grammar takes in a row). A point proposal (greedy rows, suffix matches, forced tokens) ends at the
    first refused token: the target could never accept it, and the token after the accepted prefix is the
    target's own either way. A proposal *drawn from the draft's q* (``drawn[b]``: a sampled row verified against
    q) must instead be verified and rejected at the refused slot, its token then drawn from the residual
    norm(max(p - q, 0)): p masks the refused token, so the rejection is certain, but taking the bonus from p there
    gives that slot the law p + q(refused) * (p - residual), not p (p = (1/2, 1/2, 0), q = (1/2, 0, 1/2): P(a) =
    3/4, the target 1/2). So a drawn row keeps its refused token as the last one it verifies (one slot more to
    compute; the slots after it are never read)."""
    if drawn is None or not bool(drawn.any()):
        return cut
    return torch.where(drawn & (cut < ell), cut + 1, cut)


def spec_round(target: Target, batch: RunningBatch, cfg: StreamConfig) -> None:
    """The DSpine draft's block for every row (``proposers="dspine"``): ℓ by ``schedule.plan`` from the static
    cost model (sampled rows' ℓ may decide their tokens, so it must not read live prices), sampled rows verified
    against the draft's q."""
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
        batch.hold(draft, *plain_round(target, batch, cfg.taps))
        for r in rows:
            r.stats.plain_steps += 1
        batch.hist.update(torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        return
    batch.catch_up(draft)
    pre = ell
    sampled = [not sp.greedy and int(e) > 0 for sp, e in zip(params, ell)]
    temps = torch.tensor([sp.temperature if s else 0.0 for sp, s in zip(params, sampled)], device=dev)
    prop = draft.propose(batch.dcache, anchor, target, temps, draft_generators(rows, sampled),
                         block_size=W + 1, dynamic_threshold=cfg.dynamic_threshold)
    ell = torch.minimum(ell, prop.n_draft.cpu().clamp(0, W))
    conf = getattr(prop, "confidence", None)
    if cfg.verify == "cost" and conf is not None:  # reads the confidences (a host sync off the CPU)
        a = conf[:, :W].float().cpu().cumprod(-1)
        ell = plan(a, greedy, cfg.cost, cfg.nominal_rows, cap=ell, sunk_block=W + 1, row_blocks=pre + 1)
    states = [r.state for r in rows]
    masks = None
    if any(s is not None and s.matcher is not None for s in states):  # a refused proposal ends the verify there
        masks, cut = grammar_masks(states, prop.tokens[:, :W].cpu(), ell)
        if cut is not None:
            ell = grammar_cut(ell, cut, torch.tensor(sampled) if prop.q is not None else None)
    W = int(ell.max())  # verify no wider than the longest row needs
    props = prop.tokens[:, :W].to(dev)
    q = None if prop.q is None or W == 0 else prop.q[:, :W]
    ids = torch.cat([anchor[:, None], props], dim=1)
    n_valid = (ell.to(dev) + 1) if target.packs and W > 0 else None  # packed: each row computes its 1 + ℓ tokens
    out = target.forward(ids, batch.cache, n_valid=n_valid, speculative=W > 0, taps=cfg.taps)
    live = torch.ones(B, dtype=torch.bool)
    verdict, lp = verify_slots(target, out.hidden, rows, props, ell, live, torch.zeros(B, dtype=torch.bool), seeds,
                               pos, masks, q)
    n_commit = verdict.n_accepted + 1
    if W > 0:
        target.commit(batch.cache, n_commit)
    draft.extend_context(batch.dcache, out.taps, n_commit)
    ell_l, acc_l = record(rows, verdict, ell, [DRAFT] * B, lp=lp)
    batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))


RETIRE_ROUNDS = 4  # rounds in a row without the draft before retiring it is considered (and every 4 after)
RETIRE_MARGIN = 0.8  # ... and its expected τ must be below this share of what a round of it must reach
RETIRE_IDLE = 32  # rounds in a row without the draft after which it is retired whatever its outlook


def retire_draft(cfg: StreamConfig, ran: bool, R: int) -> bool:
    """Whether to stop keeping the draft's context for the rest of the stream (``proposers=auto``): when the planner
    has not chosen it for ``RETIRE_ROUNDS`` rounds in a row and its expected τ on this job, at the rows in flight,
    is below ``RETIRE_MARGIN`` of the τ a round of it must reach to beat a plain step, or when the planner has not
    chosen it for ``RETIRE_IDLE`` rounds in a row whatever its outlook (an outlook within the margin that the plan,
    which sees each round's rows, never takes: measured on 16 chat prompts at 8 rows, the draft ran once in 241
    rounds and its upkeep ran in all of them). Its upkeep (the context forward over every committed token, the
    taps) is paid whichever source runs, so a draft that does not pay costs a few per cent of every round (~3 % on
    free text at 8 rows, one thread) and keeps the stream from its quiet rounds; retired, the stream runs suffix
    proposals and plain steps alone. Only greedy rows take the draft under ``auto``, so retiring it changes no
    token (the choice reads live prices, which never decide a token: docs/design.md, "Live prices")."""
    if ran:
        cfg.draft_idle = 0
        return False
    cfg.draft_idle += 1
    if cfg.draft_idle % RETIRE_ROUNDS or cfg.job is None or cfg.job.slots <= 0:
        return False  # looked at every RETIRE_ROUNDS rounds in a row without it
    if not _priced_out(cfg, R) and cfg.draft_idle < RETIRE_IDLE:
        return False
    cfg.draft_retired = cfg.rounds
    return True


def _priced_out(cfg: StreamConfig, R: int) -> bool:
    """The draft's expected τ on this job at ``R`` rows (best block, pooled acceptance) is below ``RETIRE_MARGIN``
    of the τ a round of it must reach to beat a plain step: the test both retirements share."""
    tau, need, _ = draft_outlook(cfg.job, cfg.prices, R)
    return tau < RETIRE_MARGIN * need


def draft_cannot_pay(cfg: StreamConfig, R: int) -> bool:
    """Whether the draft is out of the running at ``R`` rows before any round has run: ``retire_draft``'s own test
    taken before the prefill. With no evidence yet, the job's pooled acceptance is the draft's prior, and the plan
    of the first rounds prices the draft with that same prior; where it expects the draft's best block to reach
    less than ``RETIRE_MARGIN`` of the tau a round of it needs, ``retire_draft`` would retire it at its first look
    (after ``RETIRE_ROUNDS`` rounds of upkeep and a prefill that ran every prompt through it) — so it is retired
    now, at no cost. Also where no block could pay even with every token accepted (a round of each block ``b``
    costs ``b`` plain steps or more: the draft's best case, every row taking the block, since its forward is paid
    for the batch whoever takes it). Where it may pay (one row on this CPU: the embedded draft's prior tau 1.47
    against 1.67 needed), it stays, and the rounds' evidence decides. ``scripts/bench/draft_outlook.py`` prints
    these figures per row count."""
    if cfg.draft is None or cfg.draft_retired is not None or cfg.job is None or cfg.job.slots <= 0 \
            or cfg.prices is None or R <= 0:
        return False
    return (all(b <= break_even(cfg.prices, R, b - 1, b) for b in range(2, cfg.job.slots + 2))
            or _priced_out(cfg, R))


def retire_before_prefill(cfg: StreamConfig, R: int) -> None:
    """Retire the draft before the stream's first prefill (``draft_cannot_pay`` at the rows admitted first): no
    prompt is run through it, no target forward computes its taps, and the stream's rounds are those of a draft
    already retired (suffix proposals, forced tokens and plain steps). Measured before this (mixed prompts at 32
    rows): the prefill's taps and the draft's context over every prompt were 55 ms of a 4 s stream that never ran
    the draft, and at 8 rows its upkeep ran for the 4-32 rounds ``retire_draft`` waits. Its weights stay (a later
    stream with fewer rows may want it). Changes no token: the draft only ever proposes."""
    cfg.draft_retired, cfg.draft_retired_rows = 0, R
    cfg.taps = ()  # the prefix tree is bound after this (``decode._decode_loop``): it keeps no taps either


QUIET_AFTER = 8  # rounds in a row that verified nothing before the stream looks for proposals less often ...
QUIET_EVERY = 4  # ... only every QUIET_EVERY-th round (the others plain steps, planned by no one) ...
QUIET_MAX_EVERY = 16  # ... and half as often after each further QUIET_AFTER looks that found nothing, to this


def quiet_every(quiet: int) -> int:
    """How often a quiet stream looks, after ``quiet`` looking rounds in a row verified nothing: every 4th round,
    then every 8th, then every 16th. Why back off: on text that does not repeat (sampled rows, free text at
    32-64 rows) each look and plan costs ~1.5 ms beside a 18 ms step at 8 rows, and looking every 4th round kept
    ~4 % of the stream's time there; a row that starts repeating is still seen within 16 rounds, and newly
    admitted rows bring the stream back to every 4th (``decode``)."""
    return min(QUIET_MAX_EVERY, QUIET_EVERY << max(0, (quiet - QUIET_AFTER) // QUIET_AFTER))


def _quiet_round(target: Target, batch: RunningBatch, cfg: StreamConfig) -> tuple[int, int, int]:
    """A plain step for every live row with no proposals looked for and nothing planned: taken on three rounds in
    four once ``QUIET_AFTER`` rounds in a row verified nothing, with no draft context to keep up (no draft, a
    retired one, or no greedy row: the draft proposes for greedy rows only here) and no row under a grammar.
    Looking for suffix matches and planning cost ~4 % of a plain step at 8 rows (two
    threads: Python between parallel forwards) and buy nothing on text that does not repeat; a row that starts
    repeating itself is still seen within ``quiet_every`` rounds (4-16; the index is fed before a look). A plain
    step's tokens are every choice's tokens, so this changes none."""
    live = [r for r in batch.rows if r.finish is None]
    plain_round(target, batch)
    for r in live:
        r.stats.plain_steps += 1
    return len(live), 0, 0


def mixed_round(target: Target, batch: RunningBatch, cfg: StreamConfig, watch: Stopwatch) -> tuple[int, int, int]:
    """A round with point proposals on (suffix matches, and the tokens a row's grammar forces): per row a plain
    step, the draft's block or its point proposal (``schedule.plan_packed`` / ``plan_sources`` with the live
    prices), verified together in one ragged forward (packed on targets that pack: each row computes its own
    ``1 + ℓ`` tokens). Finished rows kept in their slots (``cfg.keep_dead``) take no part. Returns what the round
    was, for its price: (live rows, verified tokens beyond one per row, the draft's block or 0)."""
    draft = cfg.draft if cfg.draft_retired is None else None
    if draft is None:  # rows prefilled before the draft was retired
        batch.drop_draft()
    rows, dev, src, job = batch.rows, target.device, cfg.suffix, cfg.job
    cfg.rounds += 1
    constrained = any(r.state is not None and r.state.matcher is not None for r in rows)
    if (cfg.quiet >= QUIET_AFTER and cfg.rounds % quiet_every(cfg.quiet) and not constrained
            and (draft is None or not any(r.finish is None and r.sp.greedy for r in rows))):  # no upkeep to keep
        return _quiet_round(target, batch, cfg)
    t_look = time.perf_counter()
    B = len(rows)
    live = torch.tensor([r.finish is None for r in rows], dtype=torch.bool)
    R = int(live.sum())
    params = [r.sp for r in rows]
    greedy = torch.tensor([sp.greedy for sp in params], dtype=torch.bool)
    feed_suffix(src, rows)
    a_raw, pts, n_forced = point_proposals(rows, src, src.max_len, job)
    # the job's calibration of the suffix estimates (``JobAcceptance.suffix_scale``); forced tokens keep theirs
    scale = job.suffix_scale()
    plain_pts = torch.tensor([n == 0 for n in n_forced], dtype=torch.bool)
    a_pt = torch.where(plain_pts[:, None], (a_raw * scale).clamp(max=1.0), a_raw) if scale != 1.0 else a_raw
    job.suggested += any(pts)
    a_draft = batch.hist.survival(job.draft_rates()) if draft is not None else None
    packed = cfg.prices.packed
    if packed:
        pl = plan_packed(a_draft, a_pt, greedy, live, cfg.prices)
    else:
        pl = plan_sources(a_draft, a_pt, greedy, cfg.prices)
    # the draft proposes for greedy rows only here: a batch of sampled rows (``--num-samples``) keeps no draft
    # context, so its rounds pay no taps and no upkeep (a greedy row admitted later brings its own from prefill)
    upkeep = draft is not None and batch.dcache is not None and bool((greedy & live).any())
    if upkeep and retire_draft(cfg, bool(pl.draft_block), R):
        batch.drop_draft()
        if cfg.release_retired and callable(release := getattr(draft, "release", None)):  # its weights too:
            from dspine.cpu.memory import trim

            release()  # never read again this stream
            trim(collect=False)  # and the pages they held given back (glibc keeps freed memory otherwise); no
            # garbage collection: the weights went with their last reference, and a full pass over a job's heap
            # cost ~90 ms mid-stream (mixed prompts at 32 rows)
        draft, upkeep = None, False
    watch.look_s += time.perf_counter() - t_look  # looking and planning: priced as a verify's (``LivePrices``)
    watch.priced = pl.rate
    taps = cfg.taps if upkeep else ()
    source, ell = pl.source.clone(), pl.ell
    source[(source == SUFFIX) & torch.tensor([n > 0 for n in n_forced], dtype=torch.bool)] = FORCED
    anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
    dprops = None
    if pl.draft_block:
        t0 = time.perf_counter()
        batch.catch_up(draft)  # upkeep: paid whoever proposes, so priced neither as the draft's nor the round's
        t1 = time.perf_counter()
        watch.upkeep_s += t1 - t0
        use = source == DRAFT
        temps = torch.zeros(B, device=dev)  # only greedy rows take the draft here (``plan_*``): no q is needed
        prop = draft.propose(batch.dcache, anchor, target, temps, [None] * B, block_size=pl.draft_block,
                             dynamic_threshold=cfg.dynamic_threshold)
        d_ell = torch.minimum(ell, prop.n_draft.cpu().clamp(0, pl.draft_block - 1))
        conf = getattr(prop, "confidence", None)
        if conf is not None and bool(use.any()):  # the draft's confidences re-plan its own rows
            idx = torch.nonzero(use).flatten()
            a = conf[idx, : pl.draft_block - 1].float().cpu().cumprod(-1)
            d_ell[idx] = plan(a, greedy[idx], cfg.cost, cfg.nominal_rows, cap=d_ell[idx],
                              sunk_block=pl.draft_block, row_blocks=ell[idx] + 1)
        ell = torch.where(use, d_ell, ell)
        dprops = prop.tokens
        watch.draft_s += time.perf_counter() - t1
    W = int(ell.max())
    props = torch.zeros(B, W, dtype=torch.long)
    for b in torch.nonzero(ell).flatten().tolist():
        e = int(ell[b])
        if source[b] in (SUFFIX, FORCED):
            props[b, :e] = torch.tensor(pts[b][:e], dtype=torch.long)
        elif source[b] == DRAFT:
            props[b, :e] = dprops[b, :e].cpu()
    masks = None
    if constrained:  # walked before the forward: a
        masks, cut = grammar_masks([r.state for r in rows], props, ell, live.tolist())  # refused token ends it
        if cut is not None:
            ell = cut
            W = int(ell.max())
            props = props[:, :W]
    cfg.quiet = cfg.quiet + 1 if W == 0 else 0
    if W == 0:  # every row takes a plain step (same uniforms as plain decoding)
        got, n = plain_round(target, batch, taps)
        if upkeep:
            watch.upkeep_s += batch.hold(draft, got, n)
        for b in torch.nonzero(live).flatten().tolist():
            rows[b].stats.plain_steps += 1
        if batch.hist is not None:
            batch.hist.update(torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        return R, 0, pl.draft_block
    props = props.to(dev)
    seeds, pos = seeds_positions(rows)
    ids = torch.cat([anchor[:, None], props], dim=1)
    n_valid = ((ell + 1) * live).to(dev) if packed else None
    out = target.forward(ids, batch.cache, n_valid=n_valid, speculative=True, taps=taps)
    point = (source == SUFFIX) | (source == FORCED)
    before = sum(len(r.tokens) for r in rows)
    verdict, lp = verify_slots(target, out.hidden, rows, props, ell, live, point, seeds, pos, masks)
    n_commit = (verdict.n_accepted + 1) * live.to(dev)
    target.commit(batch.cache, n_commit)
    if upkeep:
        if pl.draft_block:
            draft.extend_context(batch.dcache, out.taps, n_commit)
        else:  # the draft did not run: its upkeep waits until it does (or until ``hold`` catches up)
            watch.upkeep_s += batch.hold(draft, out.taps, n_commit.cpu())
    sfx = (source == SUFFIX) & live  # the estimates' expected kept tokens, over the tokens verified
    expected = float((a_raw * (torch.arange(a_raw.shape[1])[None, :] < ell[:, None]))[sfx].sum())
    ell_l, acc_l = record(rows, verdict, ell, source.tolist(), live.tolist(), job, lp, n_forced, expected)
    watch.committed = sum(len(r.tokens) for r in rows) - before  # what the verify gave, against its price
    if batch.hist is not None:
        batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))
    return R, (int(ell[live].sum()) if packed else R * W), pl.draft_block
