"""Batched decoding with continuous batching: plain autoregressive, and speculative (draft -> verify -> commit).

``decode_stream`` keeps up to ``batch_size`` requests decoding. Each new request is prefilled (right-padded,
together with the others admitted at the same moment) and written into the running batch in the slot a
finished request left (``batching.assign_rows``), so nothing waits for the slowest row and a finished request
is handed back the round it finishes. Requests are pulled from the iterator only when a slot is free.
``generate`` is the batch-at-once wrapper. With ``prefill_chunk`` a newcomer's prompt is computed a bounded
number of tokens per forward, one forward per round of the rows in flight (``_chunks``, ``_decode_loop``), so a
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
from dataclasses import dataclass, field

import torch

from dspine.cpu.threads import Governor
from dspine.decoding.batching import assign_rows, can_assign
from dspine.decoding.cost import CostModel, load_or_calibrate
from dspine.decoding.prefix import Hit, PrefixCache, shared_prefixes
from dspine.decoding.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_FINAL,
    SamplingParams,
    keyed_hash,
    keyed_uniforms,
    make_generator,
    per_request,
    sample_from,
    target_probs,
)
from dspine.decoding.schedule import DRAFT, SUFFIX, History, plan, plan_sources
from dspine.decoding.suffix import DEFAULT_CAP_TOKENS, MAX_PROPOSAL, SuffixSource
from dspine.decoding.verify import Verdict, accept, accept_greedy, check_rows
from dspine.models.cache import KVCache, ModelCache, SSMState
from dspine.models.target import Target

VERIFY_MODES = ("cost", "fixed")
PROPOSERS = ("dspine", "suffix", "auto")  # auto: both, chosen per row and round
SUFFIX_PRIOR = 0.5  # per-token acceptance assumed for a row's suffix proposals before it has evidence
SUFFIX_PRIOR_WEIGHT = 4.0  # in pseudo-tokens
AGREEMENT_WEIGHT = 2.0  # pseudo-occurrences behind a proposed token's corpus agreement (count, same)


@dataclass
class SpecStats:
    """Per-request acceptance accounting (see docs/design.md, "Verification and sampling").

    A *verify round* is a round in which this row verified at least one drafted token (ℓ ≥ 1). A round in which
    it verified none (ℓ = 0: cost-aware verification judged drafting not worth it, or the draft's own stop rule
    proposed nothing) is a *plain step*: it commits one token exactly like plain decoding, is counted in
    ``plain_steps`` only, and is not in ``verify_steps``, ``round_tokens`` or the histogram. So
    ``accept_length`` (τ) stays "tokens committed per verify round, bonus/correction included", in [1, bs],
    comparable with fixed-block runs; the first token (sampled from the prefill) is never counted.
    """

    block_size: int = 0
    verify_steps: int = 0
    draft_tokens_proposed: int = 0  # drafted tokens verified (Σ ℓ over verify rounds)
    draft_tokens_accepted: int = 0
    round_tokens: int = 0  # tokens committed by verify rounds (≤ accepted + rounds; less after truncation)
    accept_histogram: list[int] = field(default_factory=list)  # index j = verify rounds that accepted j drafts
    plain_steps: int = 0  # rounds with ℓ = 0
    # the same counts by source (``schedule.SOURCE_NAMES``): the DSpine draft's block, or a suffix proposal
    dspine_steps: int = 0
    dspine_proposed: int = 0
    dspine_accepted: int = 0
    suffix_steps: int = 0
    suffix_proposed: int = 0
    suffix_accepted: int = 0

    @property
    def accept_length(self) -> float:
        return self.round_tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def accept_rate(self) -> float:
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token was produced; it is included), "length", or "error"
    prompt_tokens: int
    stats: SpecStats
    latency_s: float = 0.0
    error: str | None = None  # why the request was rejected (finish_reason "error"); no tokens then
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (not computed for this request)


class _Row:
    """Mutable decoding state of one request."""

    def __init__(self, index: int, prompt: list[int], sp: SamplingParams, block_size: int):
        self.index = index
        self.prompt = prompt
        self.sp = sp
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.stats = SpecStats(block_size=block_size, accept_histogram=[0] * (block_size + 1))
        self.stop = set(sp.stop_token_ids)
        self.t0 = time.perf_counter()
        self.t1 = 0.0
        self.fed = 0  # tokens the suffix source has been given
        self.sfx_trials = 0.0  # suffix tokens verified (reached) and accepted: this row's own acceptance evidence
        self.sfx_hits = 0.0
        self.cached = 0  # prompt tokens served by the prefix cache

    def push(self, new: list[int]) -> int:
        """Append tokens, truncating at a stop token or max_new_tokens; returns how many were kept."""
        kept = 0
        for t in new:
            if self.finish is not None:
                break
            self.tokens.append(int(t))
            kept += 1
            if t in self.stop:
                self.finish = "stop"
            elif len(self.tokens) >= self.sp.max_new_tokens:
                self.finish = "length"
        if self.finish is not None and not self.t1:
            self.t1 = time.perf_counter()
        return kept

    def output(self) -> GenerationOutput:
        return GenerationOutput(self.tokens, self.finish or "length", len(self.prompt), self.stats, self.t1 - self.t0,
                                cached_prompt_tokens=self.cached)


def check_request(target: Target, prompt: Sequence[int], sp: SamplingParams) -> str | None:
    """Why a request cannot run (empty, out-of-vocabulary ids, over the context), or None. Verify slots do not
    count against the context (``_extra``): a request gets what plain decoding would give it."""
    if len(prompt) == 0:
        return "is empty"
    bad = [t for t in prompt if not 0 <= int(t) < target.vocab_size]
    if bad:
        return f"has token id {bad[0]} outside the vocabulary (size {target.vocab_size})"
    if len(prompt) + sp.max_new_tokens > target.max_position:
        return (f"is too long: {len(prompt)} prompt + {sp.max_new_tokens} new tokens exceed the model's context "
                f"({target.max_position})")
    return None


def _capacity(rows: list[_Row], extra: int) -> int:
    """Cache positions a batch can need: its longest prompt + budget, plus ``extra`` verify slots."""
    return max(len(r.prompt) + r.sp.max_new_tokens for r in rows) + extra


@dataclass
class _Batch:
    """The running rows and their state, aligned on dim 0: target cache, draft cache, acceptance history."""

    rows: list[_Row]
    cache: ModelCache
    dcache: ModelCache | None
    hist: History | None
    # taps of tokens committed in rounds the draft did not run, not yet in its context: (taps [B, T, D], n [B])
    # per round, row b's first n[b] valid. The draft catches up in one call when it next runs (``catch_up``),
    # so rounds without the draft (plain steps, suffix rounds) pay no draft upkeep.
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def catch_up(self, draft) -> None:
        """Append the pending context rows to the draft cache (one forward over all of them)."""
        if not self.pending:
            return
        if len(self.pending) == 1:
            taps, n = self.pending[0]
        else:  # pack each row's valid taps contiguously: [B, Σ n, D]
            ns = torch.stack([n for _, n in self.pending], dim=1)  # [B, chunks]
            total = ns.sum(1)
            B, D = ns.shape[0], self.pending[0][0].shape[-1]
            taps = self.pending[0][0].new_zeros(B, int(total.max()), D)
            offset = torch.zeros(B, dtype=torch.long)
            for t, n in self.pending:
                j = torch.arange(t.shape[1])[None, :].expand(B, -1)
                valid = j < n[:, None]
                b_idx = torch.arange(B)[:, None].expand_as(j)
                taps[b_idx[valid], (offset[:, None] + j)[valid]] = t[valid]
                offset += n
            n = total
        self.pending = []
        if int(n.max()) > 0:
            draft.extend_context(self.dcache, taps, n.to(taps.device))

    def select(self, keep: list[int]) -> _Batch:
        if len(keep) == len(self.rows):
            return self
        return _Batch(
            [self.rows[b] for b in keep],
            self.cache.select(keep),
            None if self.dcache is None else self.dcache.select(keep),
            None if self.hist is None else self.hist.select(keep),
            [(t[keep], n[keep]) for t, n in self.pending],
        )

    def append(self, other: _Batch) -> _Batch:
        if not self.rows:
            return other
        assert not other.pending, "a fresh batch has no pending context"
        k = len(other.rows)
        return _Batch(
            self.rows + other.rows,
            ModelCache.concat([self.cache, other.cache]),
            None if self.dcache is None else ModelCache.concat([self.dcache, other.dcache]),
            None if self.hist is None else History.concat([self.hist, other.hist]),
            [(torch.cat([t, t.new_zeros(k, *t.shape[1:])]), torch.cat([n, n.new_zeros(k)])) for t, n in self.pending],
        )

    def assign(self, slots: list[int], other: _Batch) -> bool:
        """Write ``other``'s rows into ``slots`` in place (copies only the newcomers); False if not possible."""
        assert not other.pending, "a fresh batch has no pending context"
        if not can_assign(self.cache, other.cache) or (
            self.dcache is not None and not can_assign(self.dcache, other.dcache)
        ):
            return False
        assign_rows(self.cache, slots, other.cache)
        if self.dcache is not None:
            assign_rows(self.dcache, slots, other.dcache)
        if self.hist is not None:
            self.hist.assign(slots, other.hist)
        for _, n in self.pending:  # the finished rows' pending context is not the newcomers'
            n[slots] = 0
        for s, r in zip(slots, other.rows):
            self.rows[s] = r
        return True


@dataclass
class _Config:
    draft: object | None
    block_size: int
    dynamic_threshold: float | None
    verify: str
    cost: CostModel | None
    nominal_rows: int
    taps: tuple[int, ...]
    accept_prior: float | None = None
    suffix: SuffixSource | None = None  # suffix proposals on (proposers "suffix" or "auto")
    prefix: PrefixCache | None = None  # prompt prefixes kept across requests (``prefix.py``)
    chunk: int = 0  # prompt tokens per prefill forward (``_chunks``); 0: a newcomer's prompt in one forward


def _seeds_positions(rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.tensor([r.sp.seed & ((1 << 63) - 1) for r in rows], dtype=torch.long)
    return seeds, torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)


@dataclass
class _Pace:
    """How a prefill job hands the decode loop its turns: ``forwards`` counts the target forwards it has run."""

    forwards: int = 0

    def turn(self) -> Generator[None, None, None]:
        """Before every forward of a job but its first: yield, so the loop runs one round of the rows in flight
        between two forwards; the job's last forward and its finishing work (first tokens, the draft's context)
        then happen in one turn, and the rows join the batch the round that follows it."""
        if self.forwards:
            yield
        self.forwards += 1


def _prefill(target: Target, rows: list[_Row], cfg: _Config, pace: _Pace | None = None
             ) -> Generator[None, None, _Batch]:
    """Right-padded prefill of ``rows``; samples and pushes each row's first token (position 0). A generator: it
    yields between two target forwards (``_Pace.turn``) and returns the prefilled batch; with whole prompts
    (``cfg.chunk == 0``) the caller runs it to the end at once.

    With a prefix cache (``prefix.py``) the prefixes these newcomers share and the tree lacks are prefilled
    first, once each (``--num-samples`` siblings: their whole prompt), then every row copies what the tree holds
    for its prompt and computes only the rest. A row's state, first token and draft context are bit-identical
    either way (see ``prefix.py`` for why); ``cached`` counts what a row did not compute, the prefill of a shared
    prefix being credited to the first row that needed it. The waves and the rows' own fill run in order inside
    this one job, and the loop advances one job at a time, so a job meets the tree as its whole-prompt prefill
    would after the same earlier jobs: for given newcomers, chunking changes neither what is shared nor the
    credit (which newcomers are admitted together can change: the rows in flight finish at other moments)."""
    pace = _Pace() if pace is None else pace
    dev = target.device
    prompts = [r.prompt for r in rows]
    cap = _capacity(rows, _extra(cfg))
    credit = [0] * len(rows)
    if cfg.prefix is not None:
        for wave in shared_prefixes(prompts, cfg.prefix):
            *_, served = yield from _fill(target, [list(p) for p in wave], cfg, max(len(p) for p in wave), pace)
            for p, got in zip(wave, served):
                leader = next(i for i, q in enumerate(prompts) if tuple(q[: len(p)]) == p)
                credit[leader] += len(p) - got
    cache, last, taps, served = yield from _fill(target, prompts, cfg, cap, pace)
    p = target_probs(target.logits(last[:, None]), [r.sp for r in rows])[:, 0]
    seeds, pos = _seeds_positions(rows)
    first = sample_from(p, keyed_uniforms(seeds, pos, STREAM_FINAL, 1)[:, 0].to(dev)).tolist()
    dcache = hist = None
    if cfg.draft is not None:
        lens = torch.tensor([len(q) for q in prompts], dtype=torch.long, device=dev)
        dcache = cfg.draft.new_cache(len(rows), cap)
        cfg.draft.extend_context(dcache, taps, lens)
        hist = History.empty(len(rows), cfg.block_size - 1, cfg.accept_prior)
    for r, t, got, c in zip(rows, first, served, credit):
        r.cached = max(0, got - c)
        r.push([t])
    return _Batch(rows, cache, dcache, hist)


def _fill(target: Target, prompts: list[list[int]], cfg: _Config, capacity: int, pace: _Pace
          ) -> Generator[None, None, tuple[ModelCache, torch.Tensor, torch.Tensor | None, list[int]]]:
    """Prefill ``prompts`` into a new cache, copying what the prefix tree holds and computing the rest, then keep
    each prompt in the tree. The rest is computed in one right-padded forward over the rows that have anything
    left (``cfg.chunk == 0``), or in chunks (``_chunks``). Returns (a generator's value) the cache, the final
    hidden state of each prompt's last token [B, H], the taps of every prompt position [B, max len, D] (None
    without a draft) and the tokens each row was served from the tree."""
    dev = target.device
    tree = cfg.prefix
    n = len(prompts)
    cache = target.new_cache(n, capacity)
    hits = [tree.lookup(q) for q in prompts] if tree is not None else [Hit(0, [])] * n
    cached_taps = [tree.load(h, cache, b) if h.length else None for b, h in enumerate(hits)]
    need = [b for b in range(n) if hits[b].length < len(prompts[b])]
    longest = max(len(q) for q in prompts)
    last: torch.Tensor | None = None
    taps = None
    if need and cfg.chunk:
        last, taps = yield from _chunks(target, prompts, cache, [h.length for h in hits], need, cfg, longest, pace)
    elif need:
        yield from pace.turn()
        sub = cache if len(need) == n else cache.select(need)
        lens = torch.tensor([len(prompts[b]) - hits[b].length for b in need], dtype=torch.long, device=dev)
        ids = torch.zeros(len(need), int(lens.max()), dtype=torch.long, device=dev)
        for j, b in enumerate(need):
            ids[j, : int(lens[j])] = torch.tensor(prompts[b][hits[b].length :], dtype=torch.long)
        out = target.forward(ids, sub, n_valid=lens, taps=cfg.taps)
        if sub is not cache:
            assign_rows(cache, need, sub)
        got = out.hidden[torch.arange(len(need), device=dev), lens - 1]  # [B_need, H]
        last = got.new_empty(n, got.shape[-1])
        last[need] = got
        if out.taps is not None:
            if len(need) == n and not any(h.length for h in hits):
                taps = out.taps  # today's path, untouched: no copy
            else:
                taps = out.taps.new_zeros(n, longest, out.taps.shape[-1])
                for j, b in enumerate(need):
                    h = hits[b].length
                    taps[b, h : len(prompts[b])] = out.taps[j, : len(prompts[b]) - h]
    for b, h in enumerate(hits):
        if h.length == len(prompts[b]):  # the whole prompt was in the tree
            if last is None:
                last = h.hidden.new_empty(n, h.hidden.shape[-1])
            last[b] = h.hidden
        if cached_taps[b] is not None:
            if taps is None:
                taps = cached_taps[b].new_zeros(n, longest, cached_taps[b].shape[-1])
            taps[b, : h.length] = cached_taps[b]
    if tree is not None:
        for b, q in enumerate(prompts):
            tree.insert(q, cache, b, None if taps is None else taps[b], last[b])
            tree.computed += len(q) - hits[b].length
    return cache, last, taps, [h.length for h in hits]


def _chunks(target: Target, prompts: list[list[int]], cache: ModelCache, done: list[int], need: list[int],
            cfg: _Config, longest: int, pace: _Pace
            ) -> Generator[None, None, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Compute rows ``need`` of ``cache`` from position ``done[b]`` to the end of ``prompts[b]`` in right-padded
    forwards ``[k, T]`` of at most ``cfg.chunk`` tokens, padding included (k·T <= chunk; at least one token per
    row, so k <= chunk rows: the rest wait for a later forward).

    T is the budget split evenly over the rows still prefilling, at most what the longest of them has left; a row
    with less left is padded in its last chunk only (``n_valid``, as a whole-prompt prefill pads). Rows that are
    done, or wait, are left out by running on a copy of the others' rows up to the chunk's end (``_take_rows``),
    written back after; the cache is used in place while every row takes part and the chunk fits it. Returns the
    final hidden state of each computed row's last token [B, H] and the taps of the computed positions
    [B, longest, D] (None without a draft), both unset where a row computed nothing."""
    dev = target.device
    n = len(prompts)
    done = list(done)
    last: torch.Tensor | None = None
    taps: torch.Tensor | None = None
    while True:
        active = [b for b in need if done[b] < len(prompts[b])][: cfg.chunk]
        if not active:
            return last, taps
        T = max(1, min(cfg.chunk // len(active), max(len(prompts[b]) - done[b] for b in active)))
        got = [min(T, len(prompts[b]) - done[b]) for b in active]
        yield from pace.turn()
        ids = torch.zeros(len(active), T, dtype=torch.long, device=dev)
        for j, b in enumerate(active):
            ids[j, : got[j]] = torch.tensor(prompts[b][done[b] : done[b] + got[j]], dtype=torch.long)
        upto = max(done[b] for b in active) + T  # positions this forward reads and writes (padding included)
        in_place = len(active) == n and all(isinstance(x, KVCache) and upto <= x.capacity or isinstance(x, SSMState)
                                            for x in cache.layers)
        sub = cache if in_place else _take_rows(cache, active, upto)
        lens = None if min(got) == T else torch.tensor(got, dtype=torch.long, device=dev)
        out = target.forward(ids, sub, n_valid=lens, taps=cfg.taps)
        if not in_place:
            _put_rows(cache, active, sub)
        for j, b in enumerate(active):
            if out.taps is not None:
                if taps is None:
                    taps = out.taps.new_zeros(n, longest, out.taps.shape[-1])
                taps[b, done[b] : done[b] + got[j]] = out.taps[j, : got[j]]
            done[b] += got[j]
            if done[b] == len(prompts[b]):
                if last is None:
                    last = out.hidden.new_empty(n, out.hidden.shape[-1])
                last[b] = out.hidden[j, got[j] - 1]


def _take_rows(cache: ModelCache, rows: list[int], upto: int) -> ModelCache:
    """Rows ``rows`` of ``cache`` as a new cache holding positions ``< upto`` only: what a chunk reads and
    writes, so leaving the other rows out copies a chunk's worth of the prompt, not the cache's capacity."""
    idx = torch.as_tensor(rows, dtype=torch.long, device=cache.lengths.device)
    layers: list[KVCache | SSMState] = []
    for x in cache.layers:
        if isinstance(x, KVCache):
            layers.append(KVCache(x.k[idx, :, :upto], x.v[idx, :, :upto]))
        else:
            layers.append(x.select(idx))
    return ModelCache(cache.lengths[idx].clone(), layers)


def _put_rows(cache: ModelCache, rows: list[int], sub: ModelCache) -> None:
    """Write ``sub`` (from ``_take_rows``, after a forward) back into rows ``rows`` of ``cache``."""
    idx = torch.as_tensor(rows, dtype=torch.long, device=cache.lengths.device)
    for x, s in zip(cache.layers, sub.layers):
        if isinstance(x, KVCache):
            upto = min(s.capacity, x.capacity)
            x.k[idx, :, :upto] = s.k[:, :, :upto]
            x.v[idx, :, :upto] = s.v[:, :, :upto]
        else:
            x.conv[idx] = s.conv
            x.rec[idx] = s.rec
    cache.lengths[idx] = sub.lengths


def _extra(cfg: _Config) -> int:
    """Cache slots a verify can need beyond the committed tokens. They do not count against the model's context
    (``check_request``): slots of a verify past ``max_position`` hold tokens that can never be committed (a row
    commits at most its budget, which fits), and RoPE is computed, not tabled, so a request near the context
    limit gets exactly the tokens plain decoding gives it."""
    extra = cfg.block_size if cfg.draft is not None else 0
    if cfg.suffix is not None:
        extra = max(extra, cfg.suffix.max_len + 1)
    return extra


def _draft_generators(rows: list[_Row], sampled: list[bool]) -> list[torch.Generator | None]:
    """A fresh generator per sampled speculative row, seeded by (seed, position): the draft's draws for a round
    depend on nothing but the request and where it stands."""
    seeds, pos = _seeds_positions(rows)
    h = keyed_hash(seeds, pos, STREAM_DRAFT, 2).tolist()
    return [make_generator((a << 32) | b) if s else None for (a, b), s in zip(h, sampled)]


def _plain_round(target: Target, batch: _Batch, taps: tuple[int, ...] = ()) -> torch.Tensor | None:
    """One decode step for every row; returns the taps of the committed tokens when ``taps`` are asked for."""
    rows = batch.rows
    dev = target.device
    ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long, device=dev)
    out = target.forward(ids, batch.cache, taps=taps)
    p = target_probs(target.logits(out.hidden), [r.sp for r in rows])[:, 0]
    seeds, pos = _seeds_positions(rows)
    toks = sample_from(p, keyed_uniforms(seeds, pos, STREAM_FINAL, 1)[:, 0].to(dev)).tolist()
    for r, t in zip(rows, toks):
        r.push([t])
    return out.taps


def _spec_round(target: Target, batch: _Batch, cfg: _Config) -> None:
    draft, rows, dev = cfg.draft, batch.rows, target.device
    B, n = len(rows), cfg.block_size - 1
    params = [r.sp for r in rows]
    greedy = torch.tensor([sp.greedy for sp in params], dtype=torch.bool)
    seeds, pos = _seeds_positions(rows)
    anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
    if cfg.verify == "fixed":
        ell = torch.full((B,), n, dtype=torch.long)
    else:
        ell = plan(batch.hist.survival(), greedy, cfg.cost, cfg.nominal_rows)
    W = int(ell.max())
    if W == 0:  # no row drafts: exactly a plain step (same uniforms), the draft's context catches up later
        batch.pending.append((_plain_round(target, batch, cfg.taps), torch.ones(B, dtype=torch.long)))
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
        prop = draft.propose(batch.dcache, anchor, target, temps, _draft_generators(rows, sampled),
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
    ell_l, acc_l = _record(rows, verdict, ell, [DRAFT] * B)
    batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))


def _suffix_survival(rows: list[_Row], src: SuffixSource, width: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Each row's suffix proposal (tokens, capped by what the row may still generate) and its estimated survival
    a [rows, width]: per token, the corpus agreement (how often the n-gram before it was followed by the same
    token) shrunk towards the row's own suffix acceptance rate; 0 past the proposal."""
    a = torch.zeros(len(rows), width)
    props: list[list[int]] = []
    for b, r in enumerate(rows):
        room = r.sp.max_new_tokens - len(r.tokens) - 1  # a verify of ℓ commits up to ℓ + 1 tokens
        sug = src.suggest(r.index, min(width, room)) if room > 0 else None
        if sug is None:
            props.append([])
            continue
        rate = (r.sfx_hits + SUFFIX_PRIOR * SUFFIX_PRIOR_WEIGHT) / (r.sfx_trials + SUFFIX_PRIOR_WEIGHT)
        surv, out = 1.0, []
        for j, (count, same) in enumerate(zip(sug.counts, sug.sames)):
            agree = (same + AGREEMENT_WEIGHT * rate) / (max(count - 1, 0) + AGREEMENT_WEIGHT)
            surv *= min(agree, rate + (1.0 - rate) * agree)
            a[b, j] = surv
            out.append(sug.tokens[j])
        props.append(out)
    return a, props


def _mixed_round(target: Target, batch: _Batch, cfg: _Config) -> None:
    """A round with suffix proposals on: per row a plain step, the draft's block or the row's suffix proposal
    (``schedule.plan_sources``), verified together in one ragged forward."""
    draft, rows, dev, src = cfg.draft, batch.rows, target.device, cfg.suffix
    B = len(rows)
    params = [r.sp for r in rows]
    greedy = torch.tensor([sp.greedy for sp in params], dtype=torch.bool)
    seeds, pos = _seeds_positions(rows)
    a_sfx, sfx = _suffix_survival(rows, src, src.max_len)
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
        prop = draft.propose(batch.dcache, anchor, target, temps, _draft_generators(rows, sampled),
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
        got = _plain_round(target, batch, taps)
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
    verdict = _verify(logits, rows, props, q, ell, source == SUFFIX, seeds, pos)
    n_commit = verdict.n_accepted + 1
    target.commit(batch.cache, n_commit)
    if upkeep:
        if pl.draft_block:
            draft.extend_context(batch.dcache, out.taps, n_commit)
        else:  # the draft did not run: its upkeep waits until it does
            batch.pending.append((out.taps, n_commit.cpu()))
    ell_l, acc_l = _record(rows, verdict, ell, source.tolist())
    if batch.hist is not None:
        batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))


def _verify(logits: torch.Tensor, rows: list[_Row], props: torch.Tensor, q: torch.Tensor | None, ell: torch.Tensor,
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


def _record(rows: list[_Row], verdict, ell: torch.Tensor, sources: list[int]) -> tuple[list[int], list[int]]:
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


_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cost_model(target: Target, draft, rows: int, block_size: int, long_tokens: int | None = None) -> CostModel:
    """Calibrated once per (target, draft, rows, block) in this process (no disk key for in-memory models)."""
    per_target = _COSTS.setdefault(target, {})
    key = (id(draft), rows, block_size, long_tokens)
    if key not in per_target:
        per_target[key] = load_or_calibrate(target, draft, rows, block_size, long_tokens=long_tokens)
    return per_target[key]


def chunking_exact(target: Target) -> bool:
    """Whether a prompt prefilled in chunks leaves a row bit-identical to one prefilled whole on ``target``: dense
    targets on our CPU kernels (``dspine-*``, fp32 or the bf16 family).

    There a prompt position's keys, values, hidden state and taps depend only on the tokens up to it: the linears
    are batch invariant (a row's result does not depend on how many tokens the GEMM held), the norms, RoPE and the
    SiLU gate are our per-row kernels, and attention reads the cache one query at a time. torch's GEMMs
    (``kernel == "torch"``: bf16 torch, quantized weights, ``DSPINE_CPU_KERNELS=0``) choose their blocking by
    shape, so a chunk's tokens may round differently from the same tokens inside a whole prompt. A hybrid
    (Qwen3.5: Gated DeltaNet layers) carries its conv window and recurrent state from chunk to chunk as a
    prefix-cache hit does, but its GDN norms and gated attention are torch ops whose reductions follow the
    tensor's shape: measured on the tiny test hybrid, a row's state after chunks of 1, 5 or 64 tokens differs
    from a whole prefill in the last bits (~1e-6), so hybrids prefill whole prompts. Where this is False prompts
    go whole whatever ``prefill_chunk`` says, so the chunk size never changes an output and is part of no run's
    identity."""
    if not str(getattr(target, "kernel", "torch")).startswith("dspine-"):
        return False
    return not any(isinstance(x, SSMState) for x in target.new_cache(1, 1).layers)


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
    ``prefill_chunk`` (> 0) prefills newcomers in forwards of at most that many prompt tokens, one per round of
    the rows in flight (``_chunks``, ``_decode_loop``); 0 prefills each newcomer's prompt in one forward. Only
    where it is exact (``chunking_exact``); elsewhere prompts go whole, so outputs never depend on it either.
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
    cfg = _Config(draft if use_draft else None, bs, dynamic_threshold, verify, cost, batch_size,
                  tuple(draft.target_layer_ids) if use_draft else (), accept_prior,
                  SuffixSource(suffix_cap, suffix_max) if use_suffix else None, prefix_cache,
                  int(prefill_chunk) if chunking_exact(target) else 0)
    if prefix_cache is not None:
        prefix_cache.bind(target, target.new_cache(1, 1), len(cfg.taps))
    gov = Governor() if governor is None else governor
    try:
        yield from _decode_loop(target, requests, batch_size, cfg, cfg.draft, gov)
    finally:
        gov.restore()


@dataclass
class _Job:
    """Newcomers admitted together, being prefilled: ``steps`` (``_prefill``) is advanced by the loop."""

    rows: list[_Row]
    steps: Generator[None, None, _Batch]


def _advance(job: _Job, whole: bool) -> _Batch | None:
    """Run ``job`` to its next turn (chunked) or to its end (``whole``); the prefilled batch once it is done."""
    try:
        while True:
            next(job.steps)
            if not whole:
                return None
    except StopIteration as stop:
        return stop.value


def _decode_loop(target, requests, batch_size, cfg, draft, gov) -> Iterator[tuple[int, GenerationOutput]]:
    """The continuous-batching loop. Each iteration: admit requests into free slots (a slot is taken from the
    moment its request is admitted: rows being prefilled count), advance the oldest prefill job, put its rows
    into the batch when it is done, then run one round of the batch. With whole prompts a job is done in the
    iteration that admits it (one forward, or one per shared-prefix wave); chunked (``cfg.chunk``), a job runs
    one forward per iteration, so the rows in flight commit a round's tokens between two chunks of a long
    prompt instead of waiting for all of it. Jobs are advanced one at a time, in admission order (each finds the
    prefix tree as the jobs before it left it), and later newcomers wait behind the job in flight."""
    source = enumerate(requests)
    exhausted = False
    batch: _Batch | None = None
    dead: list[int] = []  # slots of finished rows, reusable by newcomers
    jobs: list[_Job] = []  # prefills in flight, oldest first
    while True:
        gov.tick()
        running = 0 if batch is None else len(batch.rows) - len(dead)
        running += sum(len(j.rows) for j in jobs)
        newcomers: list[_Row] = []
        while not exhausted and running + len(newcomers) < batch_size:
            try:
                i, (prompt, sp) = next(source)
            except StopIteration:
                exhausted = True
                break
            row = _Row(i, [int(t) for t in prompt], sp, _hist_len(cfg))
            why = check_request(target, row.prompt, sp)
            if why is not None:
                yield i, GenerationOutput([], "error", len(row.prompt), row.stats, error=f"prompt {i} {why}")
            elif sp.max_new_tokens == 0:
                row.finish = "length"
                yield i, row.output()
            else:
                newcomers.append(row)
        if newcomers:
            jobs.append(_Job(newcomers, _prefill(target, newcomers, cfg)))
        fresh = _advance(jobs[0], not cfg.chunk) if jobs else None
        if fresh is not None:
            jobs.pop(0)
            if cfg.suffix is not None:
                for r in fresh.rows:
                    cfg.suffix.start(r.index, r.prompt)
                _feed(cfg.suffix, fresh.rows)
            for r in fresh.rows:
                if r.finish is not None:
                    if cfg.suffix is not None:
                        cfg.suffix.finish(r.index)
                    yield r.index, r.output()
            fresh = fresh.select([b for b, r in enumerate(fresh.rows) if r.finish is None])
            batch, dead = _admit(batch, dead, fresh)
        if batch is not None and dead:
            batch, dead = batch.select([b for b in range(len(batch.rows)) if b not in set(dead)]), []
        if batch is None or not batch.rows:
            if exhausted and not jobs:
                return
            continue
        if cfg.suffix is not None:
            _mixed_round(target, batch, cfg)
            _feed(cfg.suffix, batch.rows)
        elif draft is None:
            _plain_round(target, batch)
        else:
            _spec_round(target, batch, cfg)
        dead = [b for b, r in enumerate(batch.rows) if r.finish is not None]
        for b in dead:
            if cfg.suffix is not None:
                cfg.suffix.finish(batch.rows[b].index)
            yield batch.rows[b].index, batch.rows[b].output()


def _hist_len(cfg: _Config) -> int:
    """Longest verify a row can make (its accept histogram has one more entry): the draft's block, or a suffix
    proposal's length + 1; 0 without speculation."""
    n = cfg.block_size if cfg.draft is not None else 0
    if cfg.suffix is not None:
        n = max(n, cfg.suffix.max_len + 1)
    return n


def _feed(src: SuffixSource, rows: list[_Row]) -> None:
    """Give the suffix source the tokens each row committed since it last saw the row."""
    for r in rows:
        if len(r.tokens) > r.fed:
            src.extend(r.index, r.tokens[r.fed :])
            r.fed = len(r.tokens)


def _admit(batch: _Batch | None, dead: list[int], fresh: _Batch) -> tuple[_Batch | None, list[int]]:
    """Put the freshly prefilled rows into the batch: into dead slots in place first, appended beyond that."""
    if not fresh.rows:
        return batch, dead
    if batch is None or len(dead) == len(batch.rows):
        return fresh, []  # every slot is free: the old cache is dropped whole, nothing copied or grown
    k = min(len(dead), len(fresh.rows))
    if k and batch.assign(dead[:k], fresh.select(list(range(k)))):
        dead = dead[k:]
        fresh = fresh.select(list(range(k, len(fresh.rows))))
        if not fresh.rows:
            return batch, dead
    alive = [b for b in range(len(batch.rows)) if b not in set(dead)]
    return batch.select(alive).append(fresh), []


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
) -> list[GenerationOutput]:
    """Generate for token-id prompts; speculative when ``draft`` is given, plain AR otherwise.

    Every sampling argument is a scalar (same for all prompts) or a list with one value per prompt;
    ``stop_token_ids`` is a list of ids or a list of such lists. A scalar ``seed`` seeds every request
    identically, so a request's output depends only on its prompt, parameters and seed.
    ``dynamic_threshold`` turns on confidence-based draft truncation (needs a trained confidence head);
    ``verify``/``cost``/``proposers``/``prefix_cache``/``prefill_chunk`` as in ``decode_stream``. ``batch_size``
    (default: all prompts at once) bounds the rows decoding together; more prompts join as rows finish. Raises
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
                           prefill_chunk=prefill_chunk)
    for i, o in stream:
        outs[i] = o
    return outs  # type: ignore[return-value]
