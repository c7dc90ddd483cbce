"""How many of a proposal's tokens the target is expected to keep: the suffix proposals' survival estimate, per row
and token (the DSpine draft's per-row history is ``schedule.History``)."""

from __future__ import annotations

import torch

from dspine.decoding.rows import Row
from dspine.decoding.suffix import SuffixSource

SUFFIX_PRIOR = 0.5  # per-token acceptance assumed for a row's suffix proposals before it has evidence
SUFFIX_PRIOR_WEIGHT = 4.0  # in pseudo-tokens
AGREEMENT_WEIGHT = 2.0  # pseudo-occurrences behind a proposed token's corpus agreement (count, same)


def suffix_survival(rows: list[Row], src: SuffixSource, width: int) -> tuple[torch.Tensor, list[list[int]]]:
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

