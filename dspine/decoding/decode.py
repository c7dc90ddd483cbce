"""Batched decoding with continuous batching: plain autoregressive, and speculative (draft -> verify -> commit).

``decode_stream`` keeps up to ``batch_size`` requests decoding. Each new request is prefilled (right-padded,
together with the others admitted at the same moment) and written into the running batch in the slot a
finished request left (``batching.assign_rows``), so nothing waits for the slowest row and a finished request
is handed back the round it finishes. Requests are pulled from the iterator only when a slot is free.
``generate`` is the batch-at-once wrapper.

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dspine.cpu.threads import Governor
from dspine.decoding.batching import assign_rows, can_assign
from dspine.decoding.cost import CostModel, load_or_calibrate
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
from dspine.decoding.schedule import History, plan
from dspine.decoding.verify import accept, check_rows
from dspine.models.cache import ModelCache
from dspine.models.target import Target

VERIFY_MODES = ("cost", "fixed")


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
        return GenerationOutput(self.tokens, self.finish or "length", len(self.prompt), self.stats, self.t1 - self.t0)


def check_request(target: Target, prompt: Sequence[int], sp: SamplingParams, extra: int) -> str | None:
    """Why a request cannot run (empty, out-of-vocabulary ids, over the context), or None."""
    if len(prompt) == 0:
        return "is empty"
    bad = [t for t in prompt if not 0 <= int(t) < target.vocab_size]
    if bad:
        return f"has token id {bad[0]} outside the vocabulary (size {target.vocab_size})"
    if len(prompt) + sp.max_new_tokens + extra > target.max_position:
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
    # taps of tokens committed by plain steps, not yet in the draft's context: [B, 1, D] per step. The draft
    # catches up in one batched call when it next runs (``catch_up``) instead of once per plain step.
    pending: list[torch.Tensor] = field(default_factory=list)

    def catch_up(self, draft) -> None:
        """Append the pending context rows to the draft cache (one forward over all of them)."""
        if self.pending:
            taps = torch.cat(self.pending, dim=1)
            draft.extend_context(self.dcache, taps, torch.full((taps.shape[0],), taps.shape[1], dtype=torch.long))
            self.pending = []

    def select(self, keep: list[int]) -> _Batch:
        if len(keep) == len(self.rows):
            return self
        assert not self.pending, "catch_up before changing the batch"
        return _Batch(
            [self.rows[b] for b in keep],
            self.cache.select(keep),
            None if self.dcache is None else self.dcache.select(keep),
            None if self.hist is None else self.hist.select(keep),
        )

    def append(self, other: _Batch) -> _Batch:
        if not self.rows:
            return other
        assert not self.pending and not other.pending, "catch_up before changing the batch"
        return _Batch(
            self.rows + other.rows,
            ModelCache.concat([self.cache, other.cache]),
            None if self.dcache is None else ModelCache.concat([self.dcache, other.dcache]),
            None if self.hist is None else History.concat([self.hist, other.hist]),
        )

    def assign(self, slots: list[int], other: _Batch) -> bool:
        """Write ``other``'s rows into ``slots`` in place (copies only the newcomers); False if not possible."""
        assert not self.pending and not other.pending, "catch_up before changing the batch"
        if not can_assign(self.cache, other.cache) or (
            self.dcache is not None and not can_assign(self.dcache, other.dcache)
        ):
            return False
        assign_rows(self.cache, slots, other.cache)
        if self.dcache is not None:
            assign_rows(self.dcache, slots, other.dcache)
        if self.hist is not None:
            self.hist.assign(slots, other.hist)
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


def _seeds_positions(rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.tensor([r.sp.seed & ((1 << 63) - 1) for r in rows], dtype=torch.long)
    return seeds, torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)


def _prefill(target: Target, rows: list[_Row], cfg: _Config) -> _Batch:
    """Right-padded prefill of ``rows``; samples and pushes each row's first token (position 0)."""
    dev = target.device
    extra = cfg.block_size if cfg.draft is not None else 0
    lens = torch.tensor([len(r.prompt) for r in rows], dtype=torch.long, device=dev)
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long, device=dev)
    for b, r in enumerate(rows):
        ids[b, : len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
    cap = _capacity(rows, extra)
    cache = target.new_cache(len(rows), cap)
    out = target.forward(ids, cache, n_valid=lens, taps=cfg.taps)
    last = out.hidden[torch.arange(len(rows), device=dev), lens - 1]  # [B, H]
    p = target_probs(target.logits(last[:, None]), [r.sp for r in rows])[:, 0]
    seeds, pos = _seeds_positions(rows)
    first = sample_from(p, keyed_uniforms(seeds, pos, STREAM_FINAL, 1)[:, 0].to(dev)).tolist()
    dcache = hist = None
    if cfg.draft is not None:
        dcache = cfg.draft.new_cache(len(rows), cap)
        cfg.draft.extend_context(dcache, out.taps, lens)
        hist = History.empty(len(rows), cfg.block_size - 1, cfg.accept_prior)
    for r, t in zip(rows, first):
        r.push([t])
    return _Batch(rows, cache, dcache, hist)


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
        batch.pending.append(_plain_round(target, batch, cfg.taps))
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
    host = torch.cat([verdict.n_accepted[:, None], verdict.invalid[:, None].long(), ell.to(dev)[:, None],
                      verdict.committed], dim=1).tolist()  # the round's one host read
    acc_l, ell_l = [], []
    for r, (k, _, e, *committed) in zip(rows, check_rows(host)):
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
        acc_l.append(k)
        ell_l.append(e)
    batch.hist.update(torch.tensor(ell_l), torch.tensor(acc_l))


_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cost_model(target: Target, draft, rows: int, block_size: int) -> CostModel:
    """Calibrated once per (target, draft, rows, block) in this process (no disk key for in-memory models)."""
    per_target = _COSTS.setdefault(target, {})
    key = (id(draft), rows, block_size)
    if key not in per_target:
        per_target[key] = load_or_calibrate(target, draft, rows, block_size)
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
) -> Iterator[tuple[int, GenerationOutput]]:
    """Decode ``(prompt ids, SamplingParams)`` requests, at most ``batch_size`` at a time; yields
    ``(request index, GenerationOutput)`` as each finishes (finish order, not input order).

    Speculative when ``draft`` is given. ``verify``: "fixed" verifies every drafted token (up to the draft's
    own ``dynamic_threshold`` stop); "cost" chooses ℓ per row and round (``schedule.py``) with ``cost`` (default:
    calibrated on first use); ``accept_prior`` is the per-slot acceptance it assumes for a row before that row
    has evidence (default ``schedule.PRIOR_ACCEPT``; a draft's ``decode.json`` may carry its measured one). A
    request that cannot run is yielded at once with ``finish_reason="error"``. ``governor`` (default: a new
    ``threads.Governor``) adjusts torch's thread count to the cores free as the rounds go.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    batch_size = max(1, int(batch_size))
    bs = 1 if draft is None else int(block_size or draft.block_size)
    if draft is not None and bs < 2:
        raise ValueError(f"block_size must be >= 2 for speculative decoding, got {bs}")
    if draft is not None and verify == "cost" and cost is None:
        cost = _cost_model(target, draft, batch_size, bs)
    cfg = _Config(draft, bs, dynamic_threshold, verify, cost, batch_size,
                  tuple(draft.target_layer_ids) if draft is not None else (), accept_prior)
    extra = bs if draft is not None else 0
    gov = Governor() if governor is None else governor
    try:
        yield from _decode_loop(target, requests, batch_size, cfg, extra, draft, gov)
    finally:
        gov.restore()


def _decode_loop(target, requests, batch_size, cfg, extra, draft, gov) -> Iterator[tuple[int, GenerationOutput]]:
    source = enumerate(requests)
    exhausted = False
    batch: _Batch | None = None
    dead: list[int] = []  # slots of finished rows, reusable by newcomers
    while True:
        gov.tick()
        running = 0 if batch is None else len(batch.rows) - len(dead)
        newcomers: list[_Row] = []
        while not exhausted and running + len(newcomers) < batch_size:
            try:
                i, (prompt, sp) = next(source)
            except StopIteration:
                exhausted = True
                break
            row = _Row(i, [int(t) for t in prompt], sp, cfg.block_size if draft is not None else 0)
            why = check_request(target, row.prompt, sp, extra)
            if why is not None:
                yield i, GenerationOutput([], "error", len(row.prompt), row.stats, error=f"prompt {i} {why}")
            elif sp.max_new_tokens == 0:
                row.finish = "length"
                yield i, row.output()
            else:
                newcomers.append(row)
        if newcomers and batch is not None and draft is not None:
            batch.catch_up(draft)
        if newcomers:
            fresh = _prefill(target, newcomers, cfg)
            for r in fresh.rows:
                if r.finish is not None:
                    yield r.index, r.output()
            fresh = fresh.select([b for b, r in enumerate(fresh.rows) if r.finish is None])
            batch, dead = _admit(batch, dead, fresh)
        if batch is not None and dead:
            if draft is not None:
                batch.catch_up(draft)
            batch, dead = batch.select([b for b in range(len(batch.rows)) if b not in set(dead)]), []
        if batch is None or not batch.rows:
            if exhausted:
                return
            continue
        if draft is None:
            _plain_round(target, batch)
        else:
            _spec_round(target, batch, cfg)
        dead = [b for b, r in enumerate(batch.rows) if r.finish is not None]
        for b in dead:
            yield batch.rows[b].index, batch.rows[b].output()


def _admit(batch: _Batch | None, dead: list[int], fresh: _Batch) -> tuple[_Batch | None, list[int]]:
    """Put the freshly prefilled rows into the batch: into dead slots in place first, appended beyond that."""
    if not fresh.rows:
        return batch, dead
    if batch is None:
        return fresh, []
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
) -> list[GenerationOutput]:
    """Generate for token-id prompts; speculative when ``draft`` is given, plain AR otherwise.

    Every sampling argument is a scalar (same for all prompts) or a list with one value per prompt;
    ``stop_token_ids`` is a list of ids or a list of such lists. A scalar ``seed`` seeds every request
    identically, so a request's output depends only on its prompt, parameters and seed.
    ``dynamic_threshold`` turns on confidence-based draft truncation (needs a trained confidence head);
    ``verify``/``cost`` as in ``decode_stream``. ``batch_size`` (default: all prompts at once) bounds the rows
    decoding together; more prompts join as rows finish. Raises ValueError naming the first bad prompt.
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
    extra = bs if draft is not None else 0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        why = check_request(target, p, sp, extra)
        if why is not None:
            raise ValueError(f"prompt {i} {why}")
    outs: list[GenerationOutput | None] = [None] * len(prompts)
    stream = decode_stream(target, draft, zip(prompts, params), batch_size or len(prompts), bs, dynamic_threshold,
                           verify, cost)
    for i, o in stream:
        outs[i] = o
    return outs  # type: ignore[return-value]
