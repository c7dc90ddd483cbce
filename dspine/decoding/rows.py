"""One request's state while it decodes (``Row``), what it hands back (``GenerationOutput``, ``SpecStats``), and
the checks a request must pass before it may run (``check_request``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspine.decoding.processors import RowState
from dspine.decoding.sampling import SamplingParams
from dspine.models.target import Target


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
    forced_steps: int = 0  # verify rounds that proposed tokens the row's grammar forces (``grammar.forced``)
    forced_proposed: int = 0
    forced_accepted: int = 0

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
    # per generated token when the request asked for logprobs: (id, logprob, [(id, logprob) of the top k]) of the
    # model's raw distribution at that position (``processors.Logprobs``)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class Row:
    """Mutable decoding state of one request."""

    def __init__(self, index: int, prompt: list[int], sp: SamplingParams, block_size: int,
                 vocab_size: int | None = None):
        self.index = index
        self.prompt = prompt
        self.sp = sp
        # penalties, grammar, logprobs (``processors.py``); None for the common request that asks for none
        self.state = RowState.of(sp, prompt, vocab_size) if vocab_size else None
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

    def push(self, new: list[int], logprobs: list | None = None) -> int:
        """Append tokens, truncating at a stop token or max_new_tokens; returns how many were kept. ``logprobs``:
        the tokens' entries (``processors.Logprobs.take``), kept for the kept tokens."""
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
        if self.state is not None and kept:
            self.state.commit(self.tokens[-kept:])
            if logprobs is not None:
                self.state.logprobs.extend(logprobs[:kept])
        if self.finish is not None and not self.t1:
            self.t1 = time.perf_counter()
        return kept

    def output(self) -> GenerationOutput:
        lp = self.state.logprobs if self.state is not None and self.sp.logprobs is not None else None
        return GenerationOutput(self.tokens, self.finish or "length", len(self.prompt), self.stats, self.t1 - self.t0,
                                cached_prompt_tokens=self.cached, logprobs=lp)


def check_request(target: Target, prompt: Sequence[int], sp: SamplingParams) -> str | None:
    """Why a request cannot run (empty, out-of-vocabulary ids, over the context), or None. Verify slots do not
    count against the context (``extra_slots``): a request gets what plain decoding would give it."""
    if len(prompt) == 0:
        return "is empty"
    bad = [t for t in prompt if not 0 <= int(t) < target.vocab_size]
    if bad:
        return f"has token id {bad[0]} outside the vocabulary (size {target.vocab_size})"
    if len(prompt) + sp.max_new_tokens > target.max_position:
        return (f"is too long: {len(prompt)} prompt + {sp.max_new_tokens} new tokens exceed the model's context "
                f"({target.max_position})")
    return None


def seeds_positions(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.tensor([r.sp.seed & ((1 << 63) - 1) for r in rows], dtype=torch.long)
    return seeds, torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)

