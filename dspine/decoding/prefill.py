"""Reading newcomers' prompts: right-padded prefill (``prefill``, ``fill``), in chunks of a token budget when asked
(``chunks``), with the prefix cache's hits copied instead of computed; ``Pace`` hands the decoding loop its turns
between two forwards of a long prefill. ``chunking_exact`` says where chunking cannot change a row's bits."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from dspine.decoding.batching import assign_rows
from dspine.decoding.commit import sample_first
from dspine.decoding.config import StreamConfig, extra_slots
from dspine.decoding.prefix import Hit, shared_prefixes
from dspine.decoding.rows import Row
from dspine.decoding.running import RunningBatch
from dspine.decoding.schedule import History
from dspine.models.cache import KVCache, ModelCache, SSMState
from dspine.models.target import Target


def capacity(rows: list[Row], extra: int) -> int:
    """Cache positions a batch can need: its longest prompt + budget, plus ``extra`` verify slots."""
    return max(len(r.prompt) + r.sp.max_new_tokens for r in rows) + extra



@dataclass
class Pace:
    """How a prefill job hands the decode loop its turns: ``forwards`` counts the target forwards it has run."""

    forwards: int = 0

    def turn(self) -> Generator[None, None, None]:
        """Before every forward of a job but its first: yield, so the loop runs one round of the rows in flight
        between two forwards; the job's last forward and its finishing work (first tokens, the draft's context)
        then happen in one turn, and the rows join the batch the round that follows it."""
        if self.forwards:
            yield
        self.forwards += 1


def prefill(target: Target, rows: list[Row], cfg: StreamConfig, pace: Pace | None = None
             ) -> Generator[None, None, RunningBatch]:
    """Right-padded prefill of ``rows``; samples and pushes each row's first token (position 0). A generator: it
    yields between two target forwards (``Pace.turn``) and returns the prefilled batch; with whole prompts
    (``cfg.chunk == 0``) the caller runs it to the end at once.

    With a prefix cache (``prefix.py``) the prefixes these newcomers share and the tree lacks are prefilled
    first, once each (``--num-samples`` siblings: their whole prompt), then every row copies what the tree holds
    for its prompt and computes only the rest. A row's state, first token and draft context are bit-identical
    either way (see ``prefix.py`` for why); ``cached`` counts what a row did not compute, the prefill of a shared
    prefix being credited to the first row that needed it. The waves and the rows' own fill run in order inside
    this one job, and the loop advances one job at a time, so a job meets the tree as its whole-prompt prefill
    would after the same earlier jobs: for given newcomers, chunking changes neither what is shared nor the
    credit (which newcomers are admitted together can change: the rows in flight finish at other moments)."""
    pace = Pace() if pace is None else pace
    dev = target.device
    prompts = [r.prompt for r in rows]
    cap = capacity(rows, extra_slots(cfg))
    credit = yield from shared_waves(target, prompts, cfg, pace)
    cache, last, taps, served = yield from fill(target, prompts, cfg, cap, pace)
    for r, got, c in zip(rows, served, credit):
        r.cached = max(0, got - c)
    sample_first(target, last, rows)  # each row's first token, through the processing seam
    dcache = hist = None
    if cfg.draft is not None:
        if cfg.draft_retired is None:  # a retired draft (``rounds.retire_draft``) keeps no context
            # with suffix proposals on (``mixed_round``) the draft proposes for greedy rows only: a sampled row's
            # draft context is never read, so its prompt is not run through the draft (``--num-samples`` jobs)
            lens = torch.tensor([len(q) if cfg.suffix is None or r.sp.greedy else 0 for q, r in zip(prompts, rows)],
                                dtype=torch.long, device=dev)
            dcache = cfg.draft.new_cache(len(rows), cap)
            if int(lens.max()) > 0:
                cfg.draft.extend_context(dcache, taps, lens)
        hist = History.empty(len(rows), cfg.block_size - 1, cfg.accept_prior)
    return RunningBatch(rows, cache, dcache, hist)


def shared_waves(target: Target, prompts: list[list[int]], cfg: StreamConfig, pace: Pace
                 ) -> Generator[None, None, list[int]]:
    """With a prefix cache, the prefixes ``prompts`` share and the tree lacks prefilled into it first, once each
    (``prefix.shared_prefixes``), so the ``fill`` of the prompts after copies them. Returns (a generator's value)
    each prompt's credit: the shared tokens it was first to need, computed by a wave on its behalf."""
    credit = [0] * len(prompts)
    if cfg.prefix is not None:
        for wave in shared_prefixes(prompts, cfg.prefix):
            *_, served = yield from fill(target, [list(p) for p in wave], cfg, max(len(p) for p in wave), pace)
            for p, got in zip(wave, served):
                leader = next(i for i, q in enumerate(prompts) if tuple(q[: len(p)]) == p)
                credit[leader] += len(p) - got
    return credit


def fill(target: Target, prompts: list[list[int]], cfg: StreamConfig, capacity: int, pace: Pace
          ) -> Generator[None, None, tuple[ModelCache, torch.Tensor, torch.Tensor | None, list[int]]]:
    """Prefill ``prompts`` into a new cache, copying what the prefix tree holds and computing the rest, then keep
    each prompt in the tree. The rest is computed in one right-padded forward over the rows that have anything
    left (``cfg.chunk == 0``), or in chunks (``chunks``). Returns (a generator's value) the cache, the final
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
        last, taps = yield from chunks(target, prompts, cache, [h.length for h in hits], need, cfg, longest, pace)
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


def chunks(target: Target, prompts: list[list[int]], cache: ModelCache, done: list[int], need: list[int],
            cfg: StreamConfig, longest: int, pace: Pace
            ) -> Generator[None, None, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Compute rows ``need`` of ``cache`` from position ``done[b]`` to the end of ``prompts[b]`` in right-padded
    forwards ``[k, T]`` of at most ``cfg.chunk`` tokens, padding included (k·T <= chunk; at least one token per
    row, so k <= chunk rows: the rest wait for a later forward).

    T is the budget split evenly over the rows still prefilling, at most what the longest of them has left; a row
    with less left is padded in its last chunk only (``n_valid``, as a whole-prompt prefill pads). Rows that are
    done, or wait, are left out by running on a copy of the others' rows up to the chunk's end (``take_rows``),
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
        sub = cache if in_place else take_rows(cache, active, upto)
        lens = None if min(got) == T else torch.tensor(got, dtype=torch.long, device=dev)
        out = target.forward(ids, sub, n_valid=lens, taps=cfg.taps)
        if not in_place:
            put_rows(cache, active, sub)
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


def take_rows(cache: ModelCache, rows: list[int], upto: int) -> ModelCache:
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


def put_rows(cache: ModelCache, rows: list[int], sub: ModelCache) -> None:
    """Write ``sub`` (from ``take_rows``, after a forward) back into rows ``rows`` of ``cache``."""
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
    if not str(getattr(target, "kernel", "torch")).startswith("dspine-") or getattr(target, "invariance_gaps", ()):
        return False  # a family's own gap (``Target.invariance_gaps``, e.g. longrope) counts too
    return not any(isinstance(x, SSMState) for x in target.new_cache(1, 1).layers)


