"""Fitting the draft's confidence head (after DSpark): a frozen-backbone second stage.

The head is ``c_i = sigmoid(w . [h~_i ; code(x_{i-1})] + b)``: will slot i's proposal survive verification,
given that slot i is reached? Slot i is reached only when every earlier proposal was accepted, so its
predecessor is then the target's own token; on target-regenerated data that is the true previous token, which
makes teacher forcing the exact conditioning (not an approximation) for greedy decoding.

Labels are the acceptance probability of the draft's candidate distribution q_i (refined, restricted to the
top-k candidates, T = 1) against the target's p_i: ``1 - TV(q_i, p_i) = sum_x min(q_i(x), p_i(x))``,
with ``greedy=True`` the greedy acceptance indicator ``[argmax q_i == argmax p_i]`` instead. The head has
H + r + 1 parameters, so fitting is a full-batch logistic regression (L-BFGS on soft-label BCE) over
features gathered once with the draft frozen; it takes seconds once the target captures exist.

Decoding uses it through ``dynamic_threshold``: stop drafting at the first ``c_i < threshold`` (a stopping
time, so lossless; see ``docs/design.md``, "The DSpine draft"). Shorter proposals cost less to verify, which is
what matters where verification is compute-bound (CPU, large batches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspine.draft.model import DSpineDraft
from dspine.models.target import Target
from dspine.training.train import Capture, Example, block_targets, capture, sample_anchors


@dataclass
class ConfidenceData:
    """Teacher-forced features and labels of every supervised slot: refined [M, H], code [M, r], y [M], slot [M]."""

    refined: torch.Tensor
    code: torch.Tensor
    y: torch.Tensor
    slot: torch.Tensor  # 1..bs-1, for per-slot reports


@torch.no_grad()
def confidence_data(
    draft: DSpineDraft,
    target: Target,
    batch: Sequence[tuple[Example, Capture]],
    anchors_per_seq: int = 32,
    seed: int = 0,
    greedy: bool = False,
) -> ConfidenceData:
    """Run the frozen draft over ``batch`` (examples with their captures) and collect (features, label) pairs."""
    gen = torch.Generator().manual_seed(seed)
    bs = draft.block_size
    head = target.head_weight
    dev = draft.device
    parts: list[tuple[torch.Tensor, ...]] = []
    for ex, cap in batch:
        anchors = sample_anchors(ex.loss_mask, anchors_per_seq, gen)
        if len(anchors) == 0:
            continue
        labels, w = block_targets(ex, anchors, bs, gamma=1.0)  # only w > 0 (a supervised prefix) is used
        idx = (anchors[:, None] + torch.arange(bs)[None, :]).clamp(max=len(ex.ids) - 1)
        true_tokens = ex.ids[idx]  # [N, bs]
        block = torch.full_like(true_tokens, draft.mask_token_id)
        block[:, 0] = true_tokens[:, 0]
        anchors, true_tokens, block, w = (t.to(dev) for t in (anchors, true_tokens, block, w))
        out = draft.train_forward(cap.taps, anchors, block, target)
        logits = draft.head_logits(out.hidden[:, 1:], target)  # [N, n, V']
        k = min(draft.top_k, logits.shape[-1])
        cand = draft.vocab_ids(logits.topk(k, dim=-1).indices)  # [N, n, k]
        pred = true_tokens[:, :-1]  # [N, n]: the predecessor when slot i is reached
        refined = draft.refine_slots(out, pred)  # [N, n, H] normed
        q = torch.softmax(torch.einsum("nsh,nskh->nsk", refined.to(head.dtype), head[cand]).float(), dim=-1)
        th = cap.hidden[(anchors[:, None] + torch.arange(bs - 1, device=dev)[None, :]).clamp(max=len(ex.ids) - 1)]
        p = torch.softmax(target.logits(th.to(target.dtype)).float(), dim=-1)  # [N, n, V]
        if greedy:
            y = (cand.gather(-1, q.argmax(-1, keepdim=True))[..., 0] == p.argmax(-1)).float()
        else:
            y = torch.minimum(q, p.gather(-1, cand)).sum(-1)  # 1 - TV(q, p); q is zero off the candidates
        keep = w > 0
        slot = torch.arange(1, bs, device=dev)[None, :].expand_as(keep)
        parts.append(
            (refined[keep].float(), draft.transfer_codes[pred][keep].float(), y[keep].clamp(0, 1), slot[keep])
        )
    if not parts:
        raise ValueError("no supervised slots in the confidence data")
    return ConfidenceData(*(torch.cat(t) for t in zip(*parts)))


def confidence_report(draft: DSpineDraft, data: ConfidenceData) -> dict:
    """BCE of the head vs the constant predictor, mean prediction vs mean label, and per-slot means."""
    with torch.no_grad():
        c = draft.confidence_head(data.refined.to(draft.dtype), data.code).clamp(1e-6, 1 - 1e-6)
        bce = float(F.binary_cross_entropy(c, data.y))
        m = data.y.mean().clamp(1e-6, 1 - 1e-6)
        base = float(F.binary_cross_entropy(m.expand_as(data.y), data.y))
        per_slot = {
            int(s): (round(float(data.y[data.slot == s].mean()), 4), round(float(c[data.slot == s].mean()), 4))
            for s in data.slot.unique()
        }
    return {"n": len(data.y), "bce": bce, "bce_constant": base, "mean_label": float(m), "mean_pred": float(c.mean()),
            "slot_label_pred": per_slot}  # fmt: skip


def fit_confidence(
    draft: DSpineDraft,
    train_data: ConfidenceData,
    eval_data: ConfidenceData | None = None,
    l2: float = 1e-4,
    max_iter: int = 200,
    log: Callable[[str], None] = print,
) -> dict:
    """Fit ``draft.confidence_head`` on ``train_data`` (L-BFGS, soft-label BCE + l2) and mark it trained.

    Only the head changes; the backbone is frozen by construction (features were gathered without grad).
    Returns train (and eval) reports.
    """
    if draft.confidence_head is None:
        raise ValueError("this draft has no confidence head (use_confidence_head is false)")
    head = draft.confidence_head.proj
    x = torch.cat([train_data.refined, train_data.code], dim=-1)  # the head's input [h~ ; code]
    y = train_data.y
    w = torch.zeros(x.shape[1], dtype=torch.float32, requires_grad=True)
    m = float(y.mean().clamp(1e-4, 1 - 1e-4))
    b = torch.tensor([m / (1 - m)], dtype=torch.float32).log().requires_grad_(True)  # start at the base rate
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        head.weight.copy_(w[None].to(head.weight.dtype))
        head.bias.copy_(b.to(head.bias.dtype))
    draft.confidence_trained = True
    report = {"train": confidence_report(draft, train_data)}
    if eval_data is not None:
        report["eval"] = confidence_report(draft, eval_data)
    for split, r in report.items():
        log(f"confidence {split}: n={r['n']} bce={r['bce']:.4f} (constant {r['bce_constant']:.4f}) "
            f"label {r['mean_label']:.3f} pred {r['mean_pred']:.3f}")  # fmt: skip
    return report


def fit_confidence_on_examples(
    draft: DSpineDraft,
    target: Target,
    examples: Sequence[Example],
    sequences: int = 256,
    eval_fraction: float = 0.2,
    anchors_per_seq: int = 32,
    seed: int = 0,
    greedy: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Capture up to ``sequences`` examples (a seeded sample), hold ``eval_fraction`` out, fit, report."""
    rng = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=rng)[:sequences].tolist()
    n_eval = int(round(eval_fraction * len(order))) if len(order) > 1 else 0
    batch = [(examples[i], capture(target, examples[i].ids, draft.target_layer_ids, draft.dtype)) for i in order]
    log(f"confidence: captured {len(batch)} sequences ({n_eval} held out)")
    train_data = confidence_data(draft, target, batch[n_eval:], anchors_per_seq, seed, greedy)
    eval_data = confidence_data(draft, target, batch[:n_eval], anchors_per_seq, seed + 1, greedy) if n_eval else None
    report = fit_confidence(draft, train_data, eval_data, log=log)
    report.update(sequences=len(order), eval_sequences=n_eval, greedy_labels=greedy, anchors_per_seq=anchors_per_seq)
    return report
