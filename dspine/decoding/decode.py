"""Batched decoding with continuous batching: plain autoregressive, and speculative (draft -> verify -> commit).

``decode_stream`` keeps up to ``batch_size`` requests decoding. Each new request is prefilled (right-padded,
together with the others admitted at the same moment) and written into the running batch in the slot a
finished request left (``batching.assign_rows``), so nothing waits for the slowest row and a finished request
is handed back the round it finishes. Requests are pulled from the iterator only when a slot is free.
``generate`` is the batch-at-once wrapper. With ``prefill_chunk`` a newcomer's prompt is computed a bounded
number of tokens per forward, one forward per round of the rows in flight (``chunks``, ``_decode_loop``), so a
long prompt neither stalls them nor holds a whole prompt's activations; a row ends bit-identical either way.

Speculative round, with ``s`` = tokens generated so far per row and ``x`` = the last one:
  schedule.plan (history)                      -> ℓ per row; all 0 -> no draft this round (a plain step)
  draft.propose(x, block = max ℓ + 1)          -> x_1..x_L (+ q when sampling, + confidence when trained)
  schedule.plan (confidence), capped by ℓ      -> final ℓ per row (cost-aware verification only)
  target.forward([x, x_1..x_L], speculative)   -> p_0..p_L and the tapped hidden states (one ragged forward)
  verify.accept                                -> n accepted drafts + 1 correction/bonus token per row
  target.commit(n + 1); draft.extend_context(taps of the n + 1 committed slots)
The host reads the round's outcome once (one ``tolist``); on CPU it also reads the final ℓ to shrink the
forward to the longest verified row (free there), and cost-aware rounds that use a confidence head read the
confidences to plan (a second sync on an accelerator).

Randomness is keyed by (request seed, position, purpose) (``sampling.keyed_uniforms``): a plain step at
position s and a speculative round starting at s that verifies nothing draw the same uniform, so a request
decoded with ℓ = 0 everywhere equals plain decoding token for token, sampled or greedy. With ``verify="fixed"``
or greedy sampling a request's output never depends on its batch; with ``verify="cost"`` sampled rows choose ℓ
by a rule of their own (``schedule.row_rule``), which keeps that true for a given cost model.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dspine.cpu.threads import Governor
from dspine.decoding.acceptance import JobAcceptance
from dspine.decoding.config import StreamConfig, hist_len
from dspine.decoding.cost import CostModel, load_or_calibrate
from dspine.decoding.explain import explain
from dspine.decoding.prefill import chunking_exact, prefill
from dspine.decoding.prefix import PrefixCache
from dspine.decoding.prices import LivePrices, StaticPrices, Stopwatch
from dspine.decoding.rounds import (
    QUIET_AFTER,
    draft_cannot_pay,
    feed_suffix,
    mixed_round,
    plain_round,
    retire_before_prefill,
    spec_round,
)
from dspine.decoding.rows import GenerationOutput, Row, SpecStats, check_request
from dspine.decoding.running import RunningBatch, admit
from dspine.decoding.sampling import SamplingParams, per_request
from dspine.decoding.schedule import PRIOR_ACCEPT
from dspine.decoding.suffix import DEFAULT_CAP_TOKENS, MAX_PROPOSAL, SuffixSource
from dspine.models.target import Target

VERIFY_MODES = ("cost", "fixed")
EXPLAIN_EVERY = 32  # rounds between two refreshes of a caller's ``decisions``
PROPOSERS = ("dspine", "suffix", "auto")  # auto: both, chosen per row and round

__all__ = ["GenerationOutput", "SpecStats", "chunking_exact", "check_request", "decode_stream", "generate"]


_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cost_model(target: Target, draft, rows: int, block_size: int, long_tokens: int | None = None) -> CostModel:
    """Calibrated once per (target, draft, rows, block) in this process (no disk key for in-memory models)."""
    per_target = _COSTS.setdefault(target, {})
    key = (id(draft), rows, block_size, long_tokens)
    if key not in per_target:
        per_target[key] = load_or_calibrate(target, draft, rows, block_size, long_tokens=long_tokens)
    return per_target[key]



@torch.no_grad()
def decode_stream(
    target: Target,
    draft=None,
    requests: Iterable[tuple[Sequence[int], SamplingParams]] = (),
    batch_size: int = 8,
    block_size: int | None = None,
    dynamic_threshold: float | None = None,
    verify: str = "fixed",
    cost: CostModel | None = None,
    accept_prior: float | None = None,
    governor: Governor | None = None,
    proposers: str = "dspine",
    suffix_cap: int = DEFAULT_CAP_TOKENS,
    suffix_max: int = MAX_PROPOSAL,
    prefix_cache: PrefixCache | None = None,
    prefill_chunk: int = 0,
    prices: str | LivePrices | StaticPrices = "live",
    decisions: dict | None = None,
    release_retired: bool = False,
) -> Iterator[tuple[int, GenerationOutput]]:
    """Decode ``(prompt ids, SamplingParams)`` requests, at most ``batch_size`` at a time; yields
    ``(request index, GenerationOutput)`` as each finishes (finish order, not input order).

    Speculative when ``draft`` is given or ``proposers`` asks for suffix proposals. ``verify``: "fixed" verifies
    every drafted token (up to the draft's own ``dynamic_threshold`` stop); "cost" chooses ℓ per row and round
    (``schedule.py``) with ``cost`` (default: calibrated on first use); ``accept_prior`` is the per-slot acceptance
    it assumes for a row before that row has evidence (default ``schedule.PRIOR_ACCEPT``; a draft's
    ``decode.json`` may carry its measured one). ``proposers``: "dspine" (the draft only), "suffix" (suffix
    matches only, ``suffix.py``; no draft needed), "auto" (both, chosen per row and round; needs
    ``verify="cost"``); ``suffix_cap`` bounds the finished-output tokens the suffix index keeps, ``suffix_max``
    the tokens a suffix proposal may hold. A request that cannot run is yielded at once with
    ``finish_reason="error"``. ``governor`` (default: a new ``threads.Governor``) adjusts torch's thread count
    to the cores free as the rounds go. ``prefix_cache`` (``prefix.py``; kept by the caller across calls) serves
    prompt prefixes already prefilled and shares those of requests admitted together; outputs never depend on it.
    ``prices`` (suffix proposals on): what rounds cost as the planner sees it; "live" (default) fits the job's
    own round times, seeded by ``cost`` (``prices.LivePrices``); "static" keeps ``cost``'s calibrated prices
    (``prices.StaticPrices``: tests that must not depend on timing); or a prices object. Prices only choose
    between choices whose tokens are identical, so no output depends on them.
    ``decisions`` (a dict the caller keeps; ``"_first_token"``: ``time.monotonic()`` when the first prefill sampled
    its rows' first tokens): filled every ``EXPLAIN_EVERY`` rounds and at the end with what each
    proposer did and, where one did not run, why (``explain.explain``), and the live prices (``"prices"``).
    ``prefill_chunk`` (> 0) prefills newcomers in forwards of at most that many prompt tokens, one per round of
    the rows in flight (``chunks``, ``_decode_loop``); 0 prefills each newcomer's prompt in one forward. Only
    where it is exact (``chunking_exact``); elsewhere prompts go whole, so outputs never depend on it either.
    ``release_retired``: a draft retired under ``auto`` (``rounds.retire_draft``) also frees its weights
    (``DSpineDraft.release``), so it cannot serve another stream: for owners that load it again when they need it.
    """
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0 (0 = whole prompts), got {prefill_chunk}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if proposers not in PROPOSERS:
        raise ValueError(f"proposers must be one of {PROPOSERS}, got {proposers!r}")
    use_suffix = proposers in ("suffix", "auto")
    if use_suffix and verify != "cost":
        raise ValueError("suffix proposals are chosen by the cost model: they need verify='cost'")
    if use_suffix and not 1 <= int(suffix_max) <= 64:
        raise ValueError(f"suffix_max must be in 1..64, got {suffix_max}")
    batch_size = max(1, int(batch_size))
    use_draft = draft is not None and proposers in ("dspine", "auto")
    bs = 1 if draft is None else int(block_size or draft.block_size)
    if draft is not None and bs < 2:
        raise ValueError(f"block_size must be >= 2 for speculative decoding, got {bs}")
    if (use_draft or use_suffix) and verify == "cost" and cost is None:
        cost = _cost_model(target, draft if use_draft else None, batch_size, bs if use_draft else 2,
                           int(suffix_max) + 1 if use_suffix else None)
    cfg = StreamConfig(draft if use_draft else None, bs, dynamic_threshold, verify, cost, batch_size,
                       tuple(draft.target_layer_ids) if use_draft else (), accept_prior,
                       SuffixSource(suffix_cap, suffix_max) if use_suffix else None, prefix_cache,
                       int(prefill_chunk) if chunking_exact(target) else 0)
    if use_suffix:  # rounds priced live and acceptance pooled over the job (``prices.py``, ``acceptance.py``)
        if prices == "live":
            prices = LivePrices(cost, packed=target.packs)
        elif prices == "static":
            prices = StaticPrices(cost, packed=target.packs)
        elif not hasattr(prices, "round_s"):
            raise ValueError(f"prices must be 'live', 'static' or a prices object, got {prices!r}")
        cfg.prices = prices
        cfg.job = JobAcceptance(PRIOR_ACCEPT if accept_prior is None else accept_prior, bs - 1 if use_draft else 0)
    # finished rows stay in their slots (they cost nothing on a packing target) where the round knows them
    cfg.keep_dead = target.packs and (use_suffix or cfg.draft is None)
    cfg.release_retired = release_retired
    gov = Governor() if governor is None else governor
    try:
        yield from _decode_loop(target, requests, batch_size, cfg, cfg.draft, gov, decisions)
    finally:
        gov.restore()
        _explain(cfg, decisions)


@dataclass
class _Job:
    """Newcomers admitted together, being prefilled: ``steps`` (``prefill``) is advanced by the loop."""

    rows: list[Row]
    steps: Generator[None, None, RunningBatch]


def _advance(job: _Job, whole: bool) -> RunningBatch | None:
    """Run ``job`` to its next turn (chunked) or to its end (``whole``); the prefilled batch once it is done."""
    try:
        while True:
            next(job.steps)
            if not whole:
                return None
    except StopIteration as stop:
        return stop.value


def _explain(cfg: StreamConfig, decisions: dict | None) -> None:
    """Refresh the caller's ``decisions`` (see ``decode_stream``)."""
    if decisions is None or cfg.job is None:
        return
    decisions.update(explain(cfg.job, cfg.prices, cfg.draft is not None, cfg.nominal_rows,
                             decisions.get("_row_rounds", 0), cfg.draft_retired, cfg.draft_retired_rows))
    summary = getattr(cfg.prices, "summary", None)
    if summary is not None:
        decisions["prices"] = summary()


def _decode_loop(target, requests, batch_size, cfg, draft, gov, decisions=None
                 ) -> Iterator[tuple[int, GenerationOutput]]:
    """The continuous-batching loop. Each iteration: admit requests into free slots (a slot is taken from the
    moment its request is admitted: rows being prefilled count), advance the oldest prefill job, put its rows
    into the batch when it is done, then run one round of the batch. With whole prompts a job is done in the
    iteration that admits it (one forward, or one per shared-prefix wave); chunked (``cfg.chunk``), a job runs
    one forward per iteration, so the rows in flight commit a round's tokens between two chunks of a long
    prompt instead of waiting for all of it. Jobs are advanced one at a time, in admission order (each finds the
    prefix tree as the jobs before it left it), and later newcomers wait behind the job in flight."""
    source = enumerate(requests)
    exhausted = False
    batch: RunningBatch | None = None
    dead: list[int] = []  # slots of finished rows, reusable by newcomers (kept in place with ``cfg.keep_dead``)
    jobs: list[_Job] = []  # prefills in flight, oldest first
    rounds = row_rounds = 0
    first_admission = True  # the draft may be retired before it (``rounds.draft_cannot_pay``)
    while True:
        gov.tick()
        running = 0 if batch is None else len(batch.rows) - len(dead)
        running += sum(len(j.rows) for j in jobs)
        newcomers: list[Row] = []
        while not exhausted and running + len(newcomers) < batch_size:
            try:
                i, (prompt, sp) = next(source)
            except StopIteration:
                exhausted = True
                break
            row = Row(i, [int(t) for t in prompt], sp, hist_len(cfg), target.vocab_size)
            why = check_request(target, row.prompt, sp)
            if why is not None:
                yield i, GenerationOutput([], "error", len(row.prompt), row.stats, error=f"prompt {i} {why}")
            elif sp.max_new_tokens == 0:
                row.finish = "length"
                yield i, row.output()
            else:
                newcomers.append(row)
        if newcomers:
            if first_admission:
                if draft_cannot_pay(cfg, running + len(newcomers)):
                    retire_before_prefill(cfg, running + len(newcomers))
                if cfg.prefix is not None:  # bound after that choice: the taps width is part of the tree's layout,
                    # so streams that retire the draft here keep one tree between them (bound before it, each
                    # would have emptied the tree twice)
                    cfg.prefix.bind(target, target.new_cache(1, 1), len(cfg.taps))
                first_admission = False
            jobs.append(_Job(newcomers, prefill(target, newcomers, cfg)))
        fresh = _advance(jobs[0], not cfg.chunk) if jobs else None
        if fresh is not None:
            jobs.pop(0)
            if decisions is not None and "_first_token" not in decisions:  # the stream's first sampled tokens
                decisions["_first_token"] = time.monotonic()
            if cfg.suffix is not None:
                for r in fresh.rows:
                    cfg.suffix.start(r.index, r.prompt)
                feed_suffix(cfg.suffix, fresh.rows)
                cfg.quiet = min(cfg.quiet, QUIET_AFTER)  # new rows: look every 4th round again (``quiet_every``)
            for r in fresh.rows:
                if r.finish is not None:
                    if cfg.suffix is not None:
                        cfg.suffix.finish(r.index)
                    yield r.index, r.output()
            fresh = fresh.select([b for b, r in enumerate(fresh.rows) if r.finish is None])
            batch, dead = admit(batch, dead, fresh)
        if batch is not None and dead and (not cfg.keep_dead or 2 * len(dead) > len(batch.rows)):
            # compact: always where the round does not know finished rows; with ``keep_dead`` only once most
            # slots are dead (a job's tail), so the copy is of the few live rows and never once per finish
            batch, dead = batch.select([b for b in range(len(batch.rows)) if b not in set(dead)]), []
        if batch is None or len(dead) == len(batch.rows):
            if exhausted and not jobs:
                return
            continue
        if cfg.suffix is not None:
            watch = Stopwatch()
            R, k, block = mixed_round(target, batch, cfg, watch)
            # looking for proposals and planning (``watch.look_s``): observed apart and priced as a verify's cost,
            # since a round that verifies keeps the stream looking (``prices.LivePrices.observe``, ``round_s``)
            cfg.prices.observe(R, k, watch.elapsed() - watch.look_s, block, watch.draft_s, watch.look_s,
                               watch.priced, watch.committed)
            rounds += 1
            row_rounds += R
            if decisions is not None:
                decisions["_row_rounds"] = row_rounds
                if rounds % EXPLAIN_EVERY == 0:
                    _explain(cfg, decisions)
        elif draft is None:
            plain_round(target, batch)
        else:
            spec_round(target, batch, cfg)
        was = set(dead)
        dead = [b for b, r in enumerate(batch.rows) if r.finish is not None]
        for b in dead:
            if b in was:
                continue
            if cfg.suffix is not None:
                feed_suffix(cfg.suffix, [batch.rows[b]])  # its last tokens, for the finished rows' corpus
                cfg.suffix.finish(batch.rows[b].index)
            yield batch.rows[b].index, batch.rows[b].output()



@torch.no_grad()
def generate(
    target: Target,
    draft=None,
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float | Sequence[float] = 0.0,
    top_p: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    seed: int | Sequence[int] = 0,
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
    block_size: int | None = None,
    dynamic_threshold: float | None = None,
    verify: str = "fixed",
    cost: CostModel | None = None,
    batch_size: int | None = None,
    proposers: str = "dspine",
    prefix_cache: PrefixCache | None = None,
    prefill_chunk: int = 0,
    prices: str | LivePrices | StaticPrices = "live",
    **processors,
) -> list[GenerationOutput]:
    """Generate for token-id prompts; speculative when ``draft`` is given, plain AR otherwise.

    Every sampling argument is a scalar (same for all prompts) or a list with one value per prompt;
    ``stop_token_ids`` is a list of ids or a list of such lists. A scalar ``seed`` seeds every request
    identically, so a request's output depends only on its prompt, parameters and seed.
    ``dynamic_threshold`` turns on confidence-based draft truncation (needs a trained confidence head);
    ``verify``/``cost``/``proposers``/``prefix_cache``/``prefill_chunk``/``prices`` as in ``decode_stream``.
    ``batch_size`` (default: all prompts at once) bounds the rows decoding together; more prompts join as rows
    finish. ``processors``: any other ``SamplingParams`` field, scalar or one value per prompt (penalties,
    ``min_tokens``, ``logit_bias`` as {id: bias}, ``logprobs``, ``grammar``: ``processors.py``). Raises
    ValueError naming the first bad prompt.
    """
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        return []
    params = per_request(
        len(prompts),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_token_ids=stop_token_ids,
        **processors,
    )
    bs = 1 if draft is None else int(block_size or draft.block_size)
    if draft is not None and bs < 2:
        raise ValueError(f"block_size must be >= 2 for speculative decoding, got {bs}")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        why = check_request(target, p, sp)
        if why is not None:
            raise ValueError(f"prompt {i} {why}")
    outs: list[GenerationOutput | None] = [None] * len(prompts)
    stream = decode_stream(target, draft, zip(prompts, params), batch_size or len(prompts), bs, dynamic_threshold,
                           verify, cost, proposers=proposers, prefix_cache=prefix_cache,
                           prefill_chunk=prefill_chunk, prices=prices)
    for i, o in stream:
        outs[i] = o
    return outs  # type: ignore[return-value]
