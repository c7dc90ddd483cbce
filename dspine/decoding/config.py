"""What a decoding stream was asked to do (``StreamConfig``), and the sizes that follow from it: the cache slots a
verify may need beyond the committed tokens (``extra_slots``) and the longest verify a row can make (``hist_len``)."""

from __future__ import annotations

from dataclasses import dataclass

from dspine.decoding.acceptance import JobAcceptance
from dspine.decoding.cost import CostModel
from dspine.decoding.prefix import PrefixCache
from dspine.decoding.prices import LivePrices, StaticPrices
from dspine.decoding.suffix import SuffixSource


@dataclass
class StreamConfig:
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
    chunk: int = 0  # prompt tokens per prefill forward (``chunks``); 0: a newcomer's prompt in one forward
    prices: LivePrices | StaticPrices | None = None  # what rounds cost, from the job's own rounds (``prices.py``)
    job: JobAcceptance | None = None  # acceptance pooled over the stream's rows (``acceptance.py``)
    keep_dead: bool = False  # finished rows stay in their slots until reused (the target packs: they cost nothing)
    draft_idle: int = 0  # rounds in a row the planner could have run the draft and did not (``rounds.retire_draft``)
    draft_retired: int | None = None  # the round the draft was retired at: no context kept, never proposed again
    draft_retired_rows: int = 0  # the rows admitted first, when it was retired before the first prefill
    release_retired: bool = False  # a retired draft's weights freed too (``DSpineDraft.release``): its owner
    # reloads it for a later stream (the reference engine); off for callers that reuse the draft object
    rounds: int = 0  # mixed rounds run so far
    quiet: int = 0  # rounds in a row that verified nothing (``rounds._quiet_round``)


def extra_slots(cfg: StreamConfig) -> int:
    """Cache slots a verify can need beyond the committed tokens. They do not count against the model's context
    (``check_request``): slots of a verify past ``max_position`` hold tokens that can never be committed (a row
    commits at most its budget, which fits), and RoPE is computed, not tabled, so a request near the context
    limit gets exactly the tokens plain decoding gives it."""
    extra = cfg.block_size if cfg.draft is not None else 0
    if cfg.suffix is not None:
        extra = max(extra, cfg.suffix.max_len + 1)
    return extra


def hist_len(cfg: StreamConfig) -> int:
    """Longest verify a row can make (its accept histogram has one more entry): the draft's block, or a suffix
    proposal's length + 1; 0 without speculation."""
    n = cfg.block_size if cfg.draft is not None else 0
    if cfg.suffix is not None:
        n = max(n, cfg.suffix.max_len + 1)
    return n

