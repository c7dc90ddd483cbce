"""The running batch: the rows decoding together and their state aligned on dim 0 (target cache, draft cache,
acceptance history, the draft's pending context), and admission of freshly prefilled rows into it (``admit``).
Low-level cache row moves live in ``batching.py``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspine.decoding.batching import assign_rows, can_assign
from dspine.decoding.rows import Row
from dspine.decoding.schedule import History
from dspine.models.cache import ModelCache

PENDING_ROUNDS = 16  # rounds of the draft's context kept pending at most before a catch-up


@dataclass
class RunningBatch:
    """The running rows and their state, aligned on dim 0: target cache, draft cache, acceptance history."""

    rows: list[Row]
    cache: ModelCache
    dcache: ModelCache | None
    hist: History | None
    # taps of tokens committed in rounds the draft did not run, not yet in its context: (taps [B, T, D], n [B])
    # per round, row b's first n[b] valid. The draft catches up in one call when it next runs (``catch_up``),
    # so rounds without the draft (plain steps, suffix rounds) pay no draft upkeep; ``hold`` catches up every
    # ``PENDING_ROUNDS`` rounds so the list stays bounded (one call over many rounds' tokens costs what the rounds
    # would have paid one by one, in one forward).
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def drop_draft(self) -> None:
        """Forget the draft's context (its cache and what is pending for it): the draft was retired
        (``rounds.retire_draft``)."""
        self.dcache, self.pending = None, []

    def hold(self, draft, taps: torch.Tensor | None, n: torch.Tensor) -> float:
        """Keep a round's taps for the draft's context; returns the seconds a catch-up took (0 when none ran)."""
        if taps is None:
            return 0.0
        self.pending.append((taps, n))
        if len(self.pending) < PENDING_ROUNDS:
            return 0.0
        t0 = time.perf_counter()
        self.catch_up(draft)
        return time.perf_counter() - t0

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

    def select(self, keep: list[int]) -> RunningBatch:
        if len(keep) == len(self.rows):
            return self
        return RunningBatch(
            [self.rows[b] for b in keep],
            self.cache.select(keep),
            None if self.dcache is None else self.dcache.select(keep),
            None if self.hist is None else self.hist.select(keep),
            [(t[keep], n[keep]) for t, n in self.pending],
        )

    def append(self, other: RunningBatch) -> RunningBatch:
        if not self.rows:
            return other
        assert not other.pending, "a fresh batch has no pending context"
        k = len(other.rows)
        return RunningBatch(
            self.rows + other.rows,
            ModelCache.concat([self.cache, other.cache]),
            None if self.dcache is None or other.dcache is None else ModelCache.concat([self.dcache, other.dcache]),
            None if self.hist is None else History.concat([self.hist, other.hist]),
            [(torch.cat([t, t.new_zeros(k, *t.shape[1:])]), torch.cat([n, n.new_zeros(k)])) for t, n in self.pending],
        )

    def assign(self, slots: list[int], other: RunningBatch) -> bool:
        """Write ``other``'s rows into ``slots`` in place (copies only the newcomers); False if not possible."""
        assert not other.pending, "a fresh batch has no pending context"
        if other.dcache is None:  # the draft was retired (``rounds.retire_draft``)
            self.drop_draft()
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



def admit(batch: RunningBatch | None, dead: list[int], fresh: RunningBatch) -> tuple[RunningBatch | None, list[int]]:
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


