"""Batched decoding: plain autoregressive, and speculative (draft block -> target verify -> accept -> commit).

Both loops share one shape of work: a right-padded prefill of every prompt (``n_valid`` = prompt length per
row), then rounds over the rows still running. Finished rows leave the batch (``ModelCache.select``), so a
long straggler does not keep paying for short requests that are done.

Speculative round for each running row, with ``start`` = committed target length and ``x`` = last token:
  draft.propose(x at position start)          -> x_1..x_ℓ (+ q when sampling)
  target.forward([x, x_1..x_L], speculative)  -> p_0..p_L and the tapped hidden states
  verify.accept                               -> n accepted drafts + 1 correction/bonus token
  target.commit(n + 1); draft.extend_context(taps of the n + 1 committed slots)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, make_generator, per_request, sample_from, target_probs
from .target import Target
from .verify import accept


@dataclass
class SpecStats:
    """Per-request acceptance accounting (see dspine-model.md §8).

    ``accept_length`` is τ per verify round with the bonus/correction token counted: tokens committed by
    verify rounds ÷ verify rounds. The first token (sampled from the prefill) is not counted, so τ ∈ [1, bs].
    """

    block_size: int = 0
    verify_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    round_tokens: int = 0  # tokens committed by verify rounds (≤ accepted + rounds; less after truncation)
    accept_histogram: list[int] = field(default_factory=list)  # index j = rounds that accepted j drafts

    @property
    def accept_length(self) -> float:
        return self.round_tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def accept_rate(self) -> float:
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token was produced; it is included) or "length"
    prompt_tokens: int
    stats: SpecStats
    latency_s: float = 0.0


class _Row:
    """Mutable decoding state of one request."""

    def __init__(self, prompt: list[int], sp: SamplingParams, block_size: int):
        self.prompt = prompt
        self.sp = sp
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.stats = SpecStats(block_size=block_size, accept_histogram=[0] * (block_size + 1))
        self.gen = None if sp.greedy else make_generator(sp.seed)
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


def _validate(target: Target, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], extra: int) -> None:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < target.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary (size {target.vocab_size})")
        if len(p) + sp.max_new_tokens + extra > target.max_position:
            raise ValueError(
                f"prompt {i}: {len(p)} prompt + {sp.max_new_tokens} new tokens exceed the model's context "
                f"({target.max_position})"
            )


def _capacity(rows: list[_Row], extra: int) -> int:
    """Cache positions a batch can need: its longest prompt + budget, plus ``extra`` verify slots."""
    return max(len(r.prompt) + r.sp.max_new_tokens for r in rows) + extra


def _drop_finished(run: list[_Row], caches: list) -> tuple[list[_Row], list]:
    """The rows still running, and the caches cut down to them (a copy only when some row finished)."""
    keep = [b for b, r in enumerate(run) if r.finish is None]
    if len(keep) == len(run):
        return run, caches
    return [run[b] for b in keep], [c.select(keep) for c in caches]


def _prefill(target: Target, rows: list[_Row], taps: tuple[int, ...], extra: int):
    """Right-padded prefill of all rows; returns the cache, the taps and the first sampled token per row."""
    dev = target.device
    lens = torch.tensor([len(r.prompt) for r in rows], dtype=torch.long, device=dev)
    T = int(lens.max())
    ids = torch.zeros(len(rows), T, dtype=torch.long, device=dev)
    for b, r in enumerate(rows):
        ids[b, : len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
    cache = target.new_cache(len(rows), _capacity(rows, extra))
    out = target.forward(ids, cache, n_valid=lens, taps=taps)
    last = out.hidden[torch.arange(len(rows), device=dev), lens - 1]  # [B, H]
    first = _sample_next(target.logits(last[:, None]), rows)
    return cache, out.taps, lens, first


def _sample_next(logits: torch.Tensor, rows: list[_Row]) -> list[int]:
    """logits [B, 1, V] -> one token per row, one uniform per sampled row."""
    probs = target_probs(logits, [r.sp for r in rows])[:, 0]
    out = []
    for b, r in enumerate(rows):
        if r.sp.greedy:
            out.append(int(probs[b].argmax()))
        else:
            u = torch.rand(1, generator=r.gen)
            out.append(int(sample_from(probs[b].cpu(), u[0])))
    return out


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
) -> list[GenerationOutput]:
    """Generate for a batch of token-id prompts; speculative when ``draft`` is given, plain AR otherwise.

    Every sampling argument is a scalar (same for all prompts) or a list with one value per prompt;
    ``stop_token_ids`` is a list of ids or a list of such lists. A scalar ``seed`` seeds every request
    identically, so a request's output depends only on its prompt, parameters and seed.
    ``dynamic_threshold`` turns on confidence-based draft truncation (needs a trained confidence head).
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
    _validate(target, prompts, params, bs)
    rows = [_Row(p, sp, bs if draft is not None else 0) for p, sp in zip(prompts, params)]
    todo = [r for r in rows if r.sp.max_new_tokens > 0]
    for r in rows:
        if r.sp.max_new_tokens == 0:
            r.finish = "length"
    if todo:
        if draft is None:
            _decode_ar(target, todo)
        else:
            _decode_spec(target, draft, todo, bs, dynamic_threshold)
    return [r.output() for r in rows]


def _decode_ar(target: Target, rows: list[_Row]) -> None:
    cache, _, _, first = _prefill(target, rows, (), 0)
    for r, t in zip(rows, first):
        r.push([t])
    run, caches = rows, [cache]
    while True:
        run, caches = _drop_finished(run, caches)
        if not run:
            return
        (cache,) = caches
        ids = torch.tensor([[r.tokens[-1]] for r in run], dtype=torch.long, device=target.device)
        out = target.forward(ids, cache)
        for r, t in zip(run, _sample_next(target.logits(out.hidden), run)):
            r.push([t])


def _decode_spec(target: Target, draft, rows: list[_Row], bs: int, dynamic_threshold: float | None) -> None:
    dev = target.device
    taps = tuple(draft.target_layer_ids)
    cache, tap_h, lens, first = _prefill(target, rows, taps, bs)
    dcache = draft.new_cache(len(rows), _capacity(rows, bs))
    draft.extend_context(dcache, tap_h, lens)
    for r, t in zip(rows, first):
        r.push([t])
    run, caches = rows, [cache, dcache]
    while True:
        run, caches = _drop_finished(run, caches)
        if not run:
            return
        cache, dcache = caches
        anchor = torch.tensor([r.tokens[-1] for r in run], dtype=torch.long, device=dev)
        temps = torch.tensor([r.sp.temperature for r in run], dtype=torch.float32, device=dev)
        prop = draft.propose(
            dcache,
            anchor,
            target,
            temps,
            [r.gen for r in run],
            block_size=bs,
            dynamic_threshold=dynamic_threshold,
        )
        n_draft = prop.n_draft.clamp(0, bs - 1)
        L = int(n_draft.max())
        ids = torch.cat([anchor[:, None], prop.tokens[:, :L]], dim=1)  # [B, L+1]
        out = target.forward(ids, cache, speculative=True, taps=taps)
        p = target_probs(target.logits(out.hidden), [r.sp for r in run]).cpu()
        q = None if prop.q is None else prop.q[:, :L].float().cpu()
        verdict = accept(p, prop.tokens[:, :L].cpu(), q, n_draft.cpu(), [r.sp for r in run], [r.gen for r in run], bs)
        committed = torch.tensor([len(t) for t in verdict.tokens], dtype=torch.long, device=dev)
        target.commit(cache, committed)
        draft.extend_context(dcache, out.taps, committed)
        for b, r in enumerate(run):
            st = r.stats
            st.verify_steps += 1
            st.draft_tokens_proposed += int(n_draft[b])
            st.draft_tokens_accepted += int(verdict.n_accepted[b])
            st.accept_histogram[int(verdict.n_accepted[b])] += 1
            st.round_tokens += r.push(verdict.tokens[b])
