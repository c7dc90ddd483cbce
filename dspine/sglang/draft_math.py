"""The DSpine draft in SGLang's layout, for the SGLang draft model and worker (plain torch, no SGLang import).

The math itself is not here: injection, predecessor codes, last-write refinement (``dspine.draft.model.Injection``)
and the walk step (``dspine.draft.proposal.choose``) are the reference draft's own functions. This module only
adapts them to SGLang's layout: flat tokens ``[bs * B, ...]``, fused-residual decoder layers, a candidate
"selector" that scores a ``k x k`` lattice per slot, a packed hidden row; ``tests/sglang_plugin/test_sglang_math.py``
checks the whole against the reference draft on CPU. Nothing here syncs with the host (no ``.item()`` /
``.tolist()``), so it is safe inside a captured CUDA graph.

Layout of the draft's packed output (``pack_hidden``): per token ``[normed_post (H) | last_pre (H) |
last_feat (r)]``: the final-normed state after the last injection (what the backbone logits score), the
last layer's output before its injection (what last-write refinement rewrites) and that layer's receiver
features. SGLang slices hidden states only along tokens, so the wider row travels through its CUDA-graph
buffers unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dspine.draft.proposal import choose

# A decoder layer in SGLang's fused-residual convention: (hidden, residual) -> (hidden, residual), where the
# residual stream is ``hidden + residual`` (or ``hidden`` alone when residual is None).
LayerCall = Callable[[int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]


def stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual-stream value of a fused-residual layer output."""
    return hidden if residual is None else hidden + residual


def anchor_predecessor(injection, codes: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """p(1) = sqrt(r) * code(anchor): anchor [bs] -> [bs, r] (the predecessor of slot 1 at every layer)."""
    return injection.code(codes, anchor)


def inject_block(injection, layer: int, h: torch.Tensor, f: torch.Tensor, anchor_pred: torch.Tensor,
                 offset: int) -> torch.Tensor:
    """Adjacent injection into slots 1..B-1 of h [bs, B, H] (slot 0 untouched); f [bs, B, r] are the
    pre-injection features; slot i's predecessor is f(i - offset) if i - offset >= 1 else the anchor code."""
    return injection.inject(layer, h, f, injection.predecessors(f, anchor_pred, offset))


def block_forward(layer_call: LayerCall, num_layers: int, embeds: torch.Tensor, block_size: int, injection,
                  anchor_pred: torch.Tensor, offsets: Sequence[int], norm) -> torch.Tensor:
    """The DSpine block pass over flat tokens embeds [bs*B, H] -> packed hidden [bs*B, 2H + r].

    ``layer_call(i, hidden, residual)`` runs decoder layer i (attention over the draft KV + MLP) in SGLang's
    fused-residual convention. After every layer the residual stream is read out, injected, and handed to
    the next layer as a fresh stream (residual None), exactly like ``DSpineDraft.backbone``.
    """
    N, H = embeds.shape
    bs = N // block_size
    x = embeds
    pre = feat = None
    for i in range(num_layers):
        hidden, residual = layer_call(i, x, None)
        h = stream(hidden, residual).view(bs, block_size, H)
        pre, feat = h, injection.features(i, h)
        h = inject_block(injection, i, h, feat, anchor_pred, offsets[i])
        x = h.reshape(N, H)
    normed = norm(x)
    return pack_hidden(normed, pre.reshape(N, H), feat.reshape(N, -1))


def pack_hidden(normed: torch.Tensor, pre: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
    return torch.cat([normed, pre, feat.to(normed.dtype)], dim=-1)


def unpack_hidden(packed: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., 2H + r] -> (normed [..., H], pre [..., H], feat [..., r])."""
    H = hidden_size
    return packed[..., :H], packed[..., H : 2 * H], packed[..., 2 * H :]


def candidates(normed: torch.Tensor, head_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k backbone candidates: normed [N, H] -> (ids [N, k], logits [N, k] float32) over the target head."""
    logits = (normed.to(head_weight.dtype) @ head_weight.T).float()
    vals, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    return ids, vals


def vocab_candidates(normed: torch.Tensor, head_rows: torch.Tensor, vocab: torch.Tensor, top_k: int,
                     pad_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over a draft vocabulary: head_rows [V', H] = head[vocab] -> (target ids [N, k], logits [N, k]).

    Always ``top_k`` columns (the selector's output buffers, CUDA graphs included, have that width): with a
    draft vocabulary smaller than top_k the extra columns hold ``pad_ids`` (target ids outside the draft
    vocabulary, so the dense q scatter never overwrites a real candidate) with logit -inf, which
    ``transition_scores`` keeps at -inf so the walk never picks them (q = 0 there).
    """
    logits = (normed.to(head_rows.dtype) @ head_rows.T).float()
    vals, idx = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    ids = vocab.to(idx.device)[idx]
    missing = top_k - ids.shape[-1]
    if missing > 0:
        if pad_ids is None or pad_ids.numel() < missing:
            raise ValueError(f"draft vocabulary of {logits.shape[-1]} < top_k {top_k} needs {missing} pad ids")
        pad = pad_ids[:missing].to(ids.device)
        ids = torch.cat([ids, pad.expand(ids.shape[0], missing)], dim=-1)
        vals = torch.cat([vals, vals.new_full((vals.shape[0], missing), float("-inf"))], dim=-1)
    return ids, vals


def pad_candidate_ids(vocab: torch.Tensor, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` smallest target ids outside the draft vocabulary (padding for ``vocab_candidates``)."""
    outside = torch.ones(vocab_size, dtype=torch.bool, device=vocab.device)
    outside[vocab] = False
    return outside.nonzero()[:count, 0]


def transition_scores(injection, norm, num_layers: int, pre: torch.Tensor, feat: torch.Tensor,
                      cand: torch.Tensor, anchor: torch.Tensor, codes: torch.Tensor,
                      head_weight: torch.Tensor, unary: torch.Tensor | None = None) -> torch.Tensor:
    """The transition cache (docs/design.md, "The DSpine draft") in the selector's lattice layout.

    pre [bs, n, H], feat [bs, n, r] of slots 1..n; cand [bs, n, k]; anchor [bs] ->
    scores [bs, n, k(pred row), k(cand)] float32. Row p of slot i (i >= 2) is "slot i-1 chose cand[i-1, p]";
    slot 1's rows all use the anchor (identical rows), as in ``DSpineDraft.transition``. Candidate columns
    whose backbone logit ``unary`` [bs, n, k] is -inf (padding, see ``vocab_candidates``) score -inf.
    """
    bs, n, k = cand.shape
    pred = torch.cat([anchor[:, None, None].expand(bs, 1, k), cand[:, :-1]], dim=1)  # [bs, n, k]
    p = injection.code(codes, pred)  # [bs, n, k, r]
    refined = injection.refine(norm, num_layers - 1, pre[:, :, None], feat[:, :, None], p)
    w = head_weight[cand]  # [bs, n, k, H]
    scores = (refined.to(w.dtype) @ w.transpose(-1, -2)).float()
    if unary is not None:
        scores = scores.masked_fill(torch.isneginf(unary.float())[:, :, None, :], float("-inf"))
    return scores


def walk(cand: torch.Tensor, scores: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor,
         greedy_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the lattice: greedy rows take the argmax, sampled rows draw from softmax(scores/T) by inverse CDF.

    cand [bs, n, k], scores [bs, n, k, k], uniforms [bs, n] in [0, 1), temperatures [bs] (> 0; ignored for
    greedy rows), greedy_mask [bs] bool -> (tokens [bs, n], q_rows [bs, n, k] float32: the distribution each
    token was drawn from over the k candidates, one-hot for greedy rows). Same draws as
    ``dspine.draft.proposal.sample_path`` given the same uniforms, with no host sync.
    """
    bs, n, k = cand.shape
    temps = torch.where(greedy_mask, torch.ones_like(temperatures), temperatures).float()[:, None]  # [bs, 1]
    prev = torch.zeros(bs, dtype=torch.long, device=cand.device)
    tokens, qs = [], []
    for i in range(n):
        s = scores[:, i].gather(1, prev[:, None, None].expand(bs, 1, k))[:, 0]  # [bs, k]
        pick, q = choose(s.float(), uniforms[:, i], temps, ~greedy_mask)
        qs.append(q)
        tokens.append(cand[:, i].gather(1, pick[:, None])[:, 0])
        prev = pick
    return torch.stack(tokens, 1), torch.stack(qs, 1)


# ----------------------------------------------------------------------------------------------------------
# verify bookkeeping for the GDN ReplaySSM commit


def chain_accept_index(commit_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """accept_index [bs, B] of a linear chain: row i holds i*B + j for j < commit_lens[i], else -1."""
    bs = commit_lens.shape[0]
    j = torch.arange(block_size, device=commit_lens.device)
    idx = torch.arange(bs, device=commit_lens.device)[:, None] * block_size + j[None, :]
    return torch.where(j[None, :] < commit_lens[:, None].to(j.dtype), idx, torch.full_like(idx, -1))


def replayssm_step_indices(seq_lens_pre: torch.Tensor, commit_lens: torch.Tensor,
                           track_interval: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(last accepted step per request, interval-crossing step to snapshot or -1 / None without tracking).

    A linear chain's last accepted verify step is ``commit_lens - 1`` (the bonus included, so >= 0). With
    prefix-cache tracking (``extra_buffer``) the state at the last multiple of ``track_interval`` crossed by
    this commit is snapshotted: step ``tracking_point - seq_lens_pre - 1`` when it lies within the commit.
    """
    commit = commit_lens.to(torch.int64)
    last = commit - 1
    if track_interval is None:
        return last, None
    pre = seq_lens_pre.to(torch.int64)
    post = pre + commit
    crosses = pre // track_interval != post // track_interval
    point = post // track_interval * track_interval
    ith = torch.clamp(point - pre - 1, min=0)
    steps = torch.where(crosses & (ith < commit), ith, torch.full_like(ith, -1))
    return last, steps
