"""Turning one backbone pass into a block proposal: the transition cache and the path sampled through it.

See ``docs/design.md``, "The DSpine draft" (dynamic proposal) and "Verification and sampling" (why q must be
exactly the distribution the tokens were drawn from). The backbone gives each slot's top-k candidates; the
transition cache re-applies the last layer's injection for every candidate predecessor, so slot i's scores
depend on which candidate slot i-1 chose; ``sample_path`` then chooses the tokens slot by slot: argmax for
greedy rows, inverse-CDF sampling from ``softmax(scores / T)`` for sampled rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from dspine.models.target import Target


@dataclass
class BlockOutput:
    """What one forward over N blocks produces (``backbone``: N = batch rows; ``train_forward``: N = anchors)."""

    hidden: torch.Tensor  # [N, bs, H] after the last layer's injection and the final norm
    last_pre: torch.Tensor  # [N, bs, H] last layer's output *before* its injection: what refinement rewrites
    last_feat: torch.Tensor  # [N, bs, r] f_L(i), the last layer's receiver features
    anchor: torch.Tensor  # [N] LongTensor, the block's slot-0 token
    logits: torch.Tensor | None = None  # backbone: [N, bs-1, V'] float32 logits of slots 1..bs-1 (draft vocab)
    post_feats: list[torch.Tensor] | None = None  # training: per layer [N, bs, r] post-injection features


class BlockDraft(Protocol):
    """What the proposal needs of a draft (``dspine.draft.model.DSpineDraft`` is one): its candidate width,
    draft-vocabulary ids, last-write refinement and confidence head. A protocol rather than an import, so the
    model can use this module and this module never imports the model."""

    top_k: int
    confidence_enabled: bool

    def vocab_ids(self, ids: torch.Tensor) -> torch.Tensor: ...

    def refine_slots(self, out: BlockOutput, pred: torch.Tensor) -> torch.Tensor: ...

    def confidence(self, refined: torch.Tensor, pred: torch.Tensor) -> torch.Tensor: ...

#: ``slot_scores(i, prev)``: slot i+1's candidate scores [B, k] (and confidence [B] or None) given that slot i
#: chose candidate ``prev`` [B] (ignored for slot 1, whose predecessor is the anchor).
SlotScores = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class Transition:
    """The transition cache: every candidate of slot i scored under every candidate predecessor."""

    cand: torch.Tensor  # [B, n, k] LongTensor, n = bs-1: top-k backbone candidates of slots 1..bs-1
    pred: torch.Tensor  # [B, n, k] LongTensor: predecessor of each row (the anchor for every row of slot 1)
    scores: torch.Tensor  # [B, n, k(pred row), k(cand)] float32 refined logits
    confidence: torch.Tensor | None  # [B, n, k(pred row)] float32, or None without an enabled head


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, bs-1] LongTensor (slots beyond n_draft may hold anything)
    q: torch.Tensor | None  # [B, bs-1, V] float32 draft probabilities; None when every row is greedy
    n_draft: torch.Tensor  # [B] LongTensor: proposals to verify (bs-1 unless dynamic stopping cut it)
    confidence: torch.Tensor | None  # [B, bs-1] float32 c_i along the chosen path, or None


def candidates(draft: BlockDraft, out: BlockOutput) -> torch.Tensor:
    """Top-k backbone candidates of slots 1..bs-1 as target ids: [B, n, k]."""
    k = min(draft.top_k, out.logits.shape[-1])
    return draft.vocab_ids(out.logits.topk(k, dim=-1).indices)


@torch.no_grad()
def transition(draft: BlockDraft, out: BlockOutput, target: Target) -> Transition:
    """Top-k candidates per slot and their refined scores under every candidate predecessor.

    Row j of slot i (i >= 2) is "slot i-1 chose its candidate j"; slot 1's predecessor is the anchor, so
    its k rows are identical. About n*k*k dot products on top of n*k refinements, in one batched pass.
    """
    cand = candidates(draft, out)  # [B, n, k] target ids
    B, n, k = cand.shape
    pred = torch.cat([out.anchor[:, None, None].expand(B, 1, k), cand[:, :-1]], dim=1)  # [B, n, k]
    refined = draft.refine_slots(out, pred)  # [B, n, k, H]
    w = target.head_weight[cand]  # [B, n, k, H]
    scores = (refined.to(w.dtype) @ w.transpose(-1, -2)).float()  # [B, n, k(pred), k(cand)]
    conf = draft.confidence(refined, pred) if draft.confidence_enabled else None  # [B, n, k]
    return Transition(cand, pred, scores, conf)


def choose(s: torch.Tensor, u: torch.Tensor, temp: torch.Tensor,
           sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot of the path: scores s [B, k], uniforms u [B], temperatures temp [B, 1] (> 0), sampled [B] bool
    -> (pick [B], q row [B, k]): argmax and one-hot for greedy rows; for sampled rows the inverse-CDF draw from
    q = softmax(s / T) and q itself. The one implementation of the walk step (the reference ``sample_path`` and
    the SGLang selector's walk both call it); no host sync, so it also runs inside a captured CUDA graph.
    """
    k = s.shape[-1]
    ks = torch.arange(k, device=s.device)
    probs = torch.softmax(s / temp, dim=-1)  # [B, k]: q restricted to the candidates
    cdf = probs.cumsum(-1)
    j = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # first index with cdf > u
    j = torch.minimum(j, torch.where(probs > 0, ks, 0).amax(-1))  # never an index with q = 0
    pick = torch.where(sampled, j, s.argmax(-1))
    one_hot = (ks[None, :] == pick[:, None]).float()  # not F.one_hot: no range check, no host sync
    return pick, torch.where(sampled[:, None], probs, one_hot)


def sample_path(
    cand: torch.Tensor,
    slot_scores: SlotScores,
    temperature: torch.Tensor,
    generators: list[torch.Generator | None],
    threshold: float | None,
    vocab_size: int,
) -> Proposal:
    """Choose x_1..x_n slot by slot from the candidates ``cand`` [B, n, k] (target ids).

    Greedy rows (temperature 0) take the argmax of ``slot_scores``; sampled rows draw x_i from
    q_i = softmax(scores / T) over the k candidates by inverse CDF, consuming exactly one
    ``torch.rand(n, generator=generators[b])`` per call, so a row's draws never depend on its batch neighbours.
    ``q`` is returned dense over ``vocab_size`` (zero off the candidates) because verification needs it there.
    """
    B, n, k = cand.shape
    dev = cand.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32).to(dev).reshape(B)
    sampled = temperature > 0  # [B]
    sampled_rows = sampled.tolist()
    any_sampled = any(sampled_rows)
    if any_sampled:
        if len(generators) != B:
            raise ValueError(f"need one generator (or None) per row: got {len(generators)} for batch {B}")
        draws = []
        for b in range(B):
            g = generators[b]
            if sampled_rows[b]:
                draws.append(torch.rand(n, generator=g, device=g.device if g is not None else dev).to(dev))
            else:
                draws.append(torch.zeros(n, device=dev))
        u = torch.stack(draws)  # [B, n] uniforms in [0, 1)
        temp = torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]  # [B, 1]
        q_small = torch.zeros(B, n, k, dtype=torch.float32, device=dev)
    rows = torch.arange(B, device=dev)
    prev = torch.zeros(B, dtype=torch.long, device=dev)  # row into the cache: slot 1's rows are all equal
    tokens = torch.empty(B, n, dtype=torch.long, device=dev)
    conf = None
    for i in range(n):
        s, c = slot_scores(i, prev)  # [B, k] scores of slot i+1 given the chosen predecessor
        if c is not None:  # computed before x_{i+1} is chosen
            if conf is None:
                conf = torch.empty(B, n, dtype=torch.float32, device=dev)
            conf[:, i] = c
        if any_sampled:
            pick, q_small[:, i] = choose(s, u[:, i], temp, sampled)
        else:
            pick = s.argmax(-1)
        tokens[:, i] = cand[rows, i, pick]
        prev = pick
    q = None
    if any_sampled:  # dense q: exactly the sampled distribution, zero off the candidates; greedy rows one-hot
        q = torch.zeros(B, n, vocab_size, dtype=torch.float32, device=dev).scatter_(-1, cand, q_small)
    n_draft = torch.full((B,), n, dtype=torch.long, device=dev)
    if threshold is not None and conf is not None:
        stop = conf < threshold  # [B, n]
        n_draft = torch.where(stop.any(-1), stop.int().argmax(-1), n_draft)  # first c_i < threshold -> i-1
    return Proposal(tokens, q, n_draft, conf)
