"""Teacher-forced training targets: the target's own labels over text it did not generate (issue 14, item 1b).

Regenerated data (the target's greedy responses) costs a decode per token; text we already have (ShareGPT
answers, HumanEval solutions, worked math answers) costs only the prefill-shaped forward that training runs
anyway to capture taps and teacher distributions. On such text the token at ``a+k`` is a human's, not the
target's, so it is the wrong label: the draft must predict what the *target* would say. Here:

- the label of slot k of the block at anchor a is the target's argmax after ``x_{<=a+k-1}``
  (``greedy_next``; the soft teacher ``softmax(lm_head(hidden[a+k-1]))`` is the same in both paths);
- slot k counts only while the text inside the block agrees with those labels (``x_{a+j}`` equals the target's
  argmax for every j < k). Past the first disagreement the teacher is conditioned on a token the target would
  not have produced, which no draft block ever sees at inference (the block's slots are filled with the
  target's accepted tokens), so those slots are cut, just as slots past the response end are.

Slot 1 is therefore always supervised exactly; later slots where the text happens to follow the target's
greedy path. On target-regenerated text every slot agrees and the two paths give the same labels.
"""

from __future__ import annotations

import torch

from dspine.models.target import Target


@torch.no_grad()
def greedy_next(target: Target, hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """[T] the target's argmax next token after each position, from final-norm hidden states [T, H].

    Chunked so a long sequence never holds [T, vocab] logits at once. Computed in fp32 on the hidden's device.
    """
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for i in range(0, hidden.shape[0], chunk):
        h = hidden[i : i + chunk].to(target.head_weight.dtype)
        out[i : i + chunk] = target.logits(h).float().argmax(-1)
    return out


def teacher_forced_targets(
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    greedy: torch.Tensor,
    anchors: torch.Tensor,
    bs: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [N, bs-1] = ``greedy[a+k-1]`` and weights ``exp(-(k-1)/gamma)``, cut at the first unsupervised
    slot and at the first slot whose in-block predecessor text disagrees with the target's argmax.
    """
    T = ids.shape[0]
    k = torch.arange(1, bs, device=ids.device)
    idx = anchors[:, None] + k[None, :]  # [N, bs-1]: position of slot k's token
    inside = idx < T
    idx = idx.clamp(max=T - 1)
    labels = greedy[idx - 1]
    # slot k needs x_{a+j} == greedy[a+j-1] for 1 <= j < k: shift the per-slot agreement right by one
    agree = ids[idx] == labels
    prefix_ok = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], dim=1)
    ok = (inside & loss_mask[idx] & prefix_ok).long().cumprod(dim=1).bool()
    w = torch.exp(-(k - 1).float() / gamma)[None, :] * ok
    return labels, w
