"""How many of a proposal's tokens the target is expected to keep, learned from the job as it runs.

Two levels. Per row: the DSpine draft's per-slot history (``schedule.History``) and a suffix acceptance rate over
the row's own recent suffix verifies. Job-wide (``JobAcceptance``): the same counts pooled over every row of the
stream, with a half-life in rounds, which is what a row without evidence of its own is shrunk towards. So the
draft's τ on *this* text, not a number measured once on other prompts, decides whether a fresh row tries it; a
source that stops paying is dropped within a few rounds (its rates fall on the rows that use it, and the pooled
rate with them) and one that starts paying (a row begins to repeat itself) is picked up from the row's own
evidence. A row's suffix evidence decays too (``SUFFIX_DECAY`` per verify), so its rate follows the text it is
writing now rather than its whole history.

``suffix_survival`` turns a suffix proposal into per-token survival estimates: the corpus agreement of each
proposed token (how often the n-gram before it was followed by the same token), shrunk towards the row's rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspine.decoding.grammar import forced
from dspine.decoding.rows import Row
from dspine.decoding.suffix import SuffixSource

SUFFIX_PRIOR = 0.5  # per-token acceptance assumed for suffix proposals before the job has any evidence
SUFFIX_PRIOR_WEIGHT = 4.0  # in pseudo-tokens
AGREEMENT_WEIGHT = 2.0  # pseudo-occurrences behind a proposed token's corpus agreement (count, same)
FORCED_PRIOR = 0.9  # per-token acceptance assumed for a forced string's canonical tokens before evidence
SUFFIX_DECAY = 0.9  # a row's suffix evidence kept per suffix verify it makes
POOL_HALF_LIFE = 64.0  # rounds: pooled evidence halves after this many rounds that add to it
POOL_WEIGHT = 8.0  # pseudo-trials behind the static prior in the pooled estimates
CALIBRATION_WEIGHT = 4.0  # pseudo-tokens behind "the suffix estimates are right" (``suffix_scale`` = 1)
CALIBRATION_RANGE = (0.25, 2.0)  # how far the job's evidence may scale the suffix survival estimates
_POOL_DECAY = 0.5 ** (1.0 / POOL_HALF_LIFE)


@dataclass
class JobAcceptance:
    """Pooled acceptance of the stream's proposals, per source (see the module docstring)."""

    draft_prior: float  # per-slot acceptance assumed before any evidence (the draft's decode.json, or the default)
    slots: int  # draft slots (block - 1)
    draft_trials: torch.Tensor = field(default=None)  # type: ignore[assignment]
    draft_hits: torch.Tensor = field(default=None)  # type: ignore[assignment]
    suffix_trials: float = 0.0
    suffix_hits: float = 0.0
    forced_trials: float = 0.0
    forced_hits: float = 0.0
    # what each source did over the whole stream (not decayed): verify rounds, tokens proposed, tokens accepted
    totals: dict[str, list[int]] = field(
        default_factory=lambda: {"dspine": [0, 0, 0], "suffix": [0, 0, 0], "forced": [0, 0, 0]})
    suggested: int = 0  # rounds in which some row had a suffix proposal at all
    # the suffix survival estimates' calibration: tokens they expected kept, tokens kept (decayed as the pools)
    suffix_expected: float = 0.0
    suffix_kept: float = 0.0

    def __post_init__(self) -> None:
        if self.draft_trials is None:
            self.draft_trials = torch.zeros(max(self.slots, 0))
            self.draft_hits = torch.zeros(max(self.slots, 0))

    def draft_rates(self) -> torch.Tensor:
        """[slots] per-slot acceptance (given the previous slot passed) pooled over the job's draft rounds."""
        return (self.draft_hits + self.draft_prior * POOL_WEIGHT) / (self.draft_trials + POOL_WEIGHT)

    def suffix_rate(self) -> float:
        return (self.suffix_hits + SUFFIX_PRIOR * POOL_WEIGHT) / (self.suffix_trials + POOL_WEIGHT)

    def forced_rate(self) -> float:
        """Acceptance of a grammar's forced-string tokens (the model may split the same text otherwise)."""
        return (self.forced_hits + FORCED_PRIOR * POOL_WEIGHT) / (self.forced_trials + POOL_WEIGHT)

    def observe_forced(self, trials: float, hits: float) -> None:
        if trials <= 0:
            return
        self.forced_trials = self.forced_trials * _POOL_DECAY + trials
        self.forced_hits = self.forced_hits * _POOL_DECAY + hits

    def observe_draft(self, verified: list[int], accepted: list[int]) -> None:
        """One round's draft verifies: per row ℓ and accepted (rows that did not take the draft: 0, 0)."""
        if not any(verified) or self.slots <= 0:
            return
        j = torch.arange(self.slots)[None, :]
        v, a = torch.tensor(verified)[:, None], torch.tensor(accepted)[:, None]
        tried = ((j < v) & (j <= a)).float().sum(0)
        hit = ((j < a) & (j < v)).float().sum(0)
        self.draft_trials = self.draft_trials * _POOL_DECAY + tried
        self.draft_hits = self.draft_hits * _POOL_DECAY + hit

    def count(self, source: str, proposed: int, accepted: int) -> None:
        """One row's verify of ``proposed`` tokens from ``source``, ``accepted`` of them kept."""
        n = self.totals[source]
        n[0] += 1
        n[1] += proposed
        n[2] += accepted

    def suffix_scale(self) -> float:
        """What the job's suffix verifies say of the survival estimates: tokens kept over tokens expected kept
        (Σ of the estimated survival over the verified tokens), shrunk towards 1 and bounded. The estimates come
        from corpus agreement and a rate per row; on free text at several rows a proposal they call even odds is
        kept less often than that, and a verify that does not pay is a loss the plan cannot see otherwise."""
        lo, hi = CALIBRATION_RANGE
        ratio = (self.suffix_kept + CALIBRATION_WEIGHT) / (self.suffix_expected + CALIBRATION_WEIGHT)
        return min(hi, max(lo, ratio))

    def observe_suffix_estimate(self, expected: float, kept: float) -> None:
        """One round's suffix verifies: the survival estimates' expected kept tokens against the kept ones."""
        if expected <= 0:
            return
        self.suffix_expected = self.suffix_expected * _POOL_DECAY + expected
        self.suffix_kept = self.suffix_kept * _POOL_DECAY + kept

    def observe_suffix(self, trials: float, hits: float) -> None:
        if trials <= 0:
            return
        self.suffix_trials = self.suffix_trials * _POOL_DECAY + trials
        self.suffix_hits = self.suffix_hits * _POOL_DECAY + hits


def row_suffix_rate(r: Row, prior: float) -> float:
    """The row's suffix acceptance rate, shrunk towards ``prior`` (the job's pooled rate)."""
    return (r.sfx_hits + prior * SUFFIX_PRIOR_WEIGHT) / (r.sfx_trials + SUFFIX_PRIOR_WEIGHT)


def point_proposals(rows: list[Row], src: SuffixSource, width: int, job: JobAcceptance
                    ) -> tuple[torch.Tensor, list[list[int]], list[int]]:
    """Each running row's point-mass proposal and its survival a [rows, width]: a row with a grammar proposes the
    tokens it forces (``grammar.forced``: single allowed tokens certain, a forced string's canonical tokens at the
    job's forced rate) and a suffix match chained after them; other rows their suffix proposal
    (``suffix_survival``). Returns (a, tokens per row, forced tokens per row)."""
    a, props = suffix_survival([r if r.state is None or r.state.matcher is None else None for r in rows], src,
                               width, job.suffix_rate())
    n_forced = [0] * len(rows)
    a_np = a.numpy()  # the same memory, cheap element writes
    for b, r in enumerate(rows):
        st = r.state
        if st is None or st.matcher is None or r.finish is not None:
            continue
        room = min(width, r.sp.max_new_tokens - len(r.tokens) - 1)
        if room <= 0:
            continue
        toks, certain = forced(st.matcher, r.sp.grammar.encode, st.vocab_size, room, st.head)
        surv, out = 1.0, []
        rate = job.forced_rate()
        for j, t in enumerate(toks):
            surv *= 1.0 if j >= len(toks) - certain else rate
            a_np[b, j] = surv
            out.append(t)
        n_forced[b] = len(out)
        if len(out) < room:
            sug = src.suggest(r.index, room - len(out), tail=out)
            if sug is not None:
                srate = row_suffix_rate(r, job.suffix_rate())
                for j, (count, same) in enumerate(zip(sug.counts, sug.sames)):
                    agree = (same + AGREEMENT_WEIGHT * srate) / (max(count - 1, 0) + AGREEMENT_WEIGHT)
                    surv *= min(agree, srate + (1.0 - srate) * agree)
                    a_np[b, len(out)] = surv
                    out.append(sug.tokens[j])
        props[b] = out
    return a, props, n_forced


def suffix_survival(rows: list[Row | None], src: SuffixSource, width: int, prior: float = SUFFIX_PRIOR
                    ) -> tuple[torch.Tensor, list[list[int]]]:
    """Each running row's suffix proposal (tokens, capped by what the row may still generate) and its estimated
    survival a [rows, width]: per token, the corpus agreement (how often the n-gram before it was followed by the
    same token) shrunk towards the row's own suffix acceptance rate; 0 past the proposal and for finished rows.

    A row is looked up only when its text could match (``SuffixSource.could_match``: the n-gram of the smallest
    order ending it is in a corpus it reads), which skips the lookups that would find nothing and changes no
    proposal. The survival is computed for all proposals at once (numpy over [rows, tokens]), the same float64
    products, token after token, as one row at a time."""
    n = len(rows)
    props: list[list[int]] = [[] for _ in range(n)]
    counts = np.zeros((n, width), dtype=np.float64)
    sames = np.zeros((n, width), dtype=np.float64)
    lens = np.zeros(n, dtype=np.int64)
    rates = np.zeros(n, dtype=np.float64)
    for b, r in enumerate(rows):
        if r is None or r.finish is not None:  # finished, or a row that proposes otherwise (``point_proposals``)
            continue
        room = r.sp.max_new_tokens - len(r.tokens) - 1  # a verify of ℓ commits up to ℓ + 1 tokens
        if room <= 0 or not src.could_match(r.index):
            continue
        sug = src.suggest(r.index, min(width, room))
        if sug is None:
            continue
        k = len(sug.tokens)
        props[b] = list(sug.tokens)
        counts[b, :k] = sug.counts
        sames[b, :k] = sug.sames
        lens[b] = k
        rates[b] = row_suffix_rate(r, prior)
    if not lens.any():
        return torch.zeros(n, width), props
    rate = rates[:, None]
    agree = (sames + AGREEMENT_WEIGHT * rate) / (np.maximum(counts - 1, 0) + AGREEMENT_WEIGHT)
    step = np.minimum(agree, rate + (1.0 - rate) * agree)
    inside = np.arange(width)[None, :] < lens[:, None]
    surv = np.cumprod(np.where(inside, step, 1.0), axis=1) * inside
    return torch.from_numpy(surv.astype(np.float32)), props
