"""The device-independent math of the SGLang DSPINE backend (dspine/sglang/draft_math.py) against dspine's
reference draft, on CPU. Needs no SGLang: the same functions run inside the SGLang draft model and worker.

The SGLang draft runs its decoder layers in the fused-residual convention over flat tokens; here the
reference ``DraftLayer`` (attention over the reference context cache) stands in for SGLang's layer, so what
is compared is everything DSpine adds around the layers: injection after every layer, the packed output,
candidates, the transition cache (last-write refinement) and the walk (greedy and sampled).
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (the test extra: missing, the file must fail, not skip)
from helpers import DRAFT_VOCAB as VOCAB
from helpers import fill_context, make_draft, save_hf_init_qwen3

from dspine.draft.model import CachedKeys
from dspine.sglang import draft_math as dm


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dspine.models.registry import load_target

    return load_target(save_hf_init_qwen3(tmp_path_factory.mktemp("qwen3")))


def _sglang_style_block(draft, cache, anchor, bs_block=None):
    """Run draft_math.block_forward with reference layers in SGLang's fused-residual convention."""
    B = anchor.shape[0]
    bs = bs_block or draft.block_size
    tokens = torch.full((B, bs), draft.mask_token_id, dtype=torch.long)
    tokens[:, 0] = anchor
    pos = cache.lengths[:, None] + torch.arange(bs)
    span = (int(cache.lengths.min()), int(cache.lengths.max()) + bs)
    cos, sin = draft.rotary(pos, draft.dtype)
    H = draft.hidden_size

    def layer_call(i, hidden, residual):
        x = dm.stream(hidden, residual).view(B, bs, H)
        y = draft.layers[i](x, cos, sin, CachedKeys(cache.layers[i], pos, draft.windows[i], span))
        return (y - x).reshape(B * bs, H), x.reshape(B * bs, H)  # SGLang: (mlp_out, residual)

    return tokens, layer_call


@torch.no_grad()
@pytest.mark.parametrize("offsets", [None, [1, 2, 3]])
def test_block_forward_matches_reference_backbone(target, offsets):
    kw = {} if offsets is None else {"injection_offsets": offsets}
    draft = make_draft(target, **kw)
    cache, _ = fill_context(draft, [9, 4, 13])
    anchor = torch.tensor([5, 77, 201])
    ref = draft.backbone(cache, anchor, target)
    tokens, layer_call = _sglang_style_block(draft, cache, anchor)
    embeds = target.embed(tokens).reshape(-1, draft.hidden_size)
    anchor_pred = dm.anchor_predecessor(draft.injection, draft.transfer_codes, anchor)
    packed = dm.block_forward(layer_call, len(draft.layers), embeds, draft.block_size, draft.injection, anchor_pred,
                              draft.injection_offsets, draft.norm)
    B, bs, H = ref.hidden.shape
    assert packed.shape == (B * bs, 2 * H + draft.transfer_rank)
    normed, pre, feat = (t.view(B, bs, -1) for t in dm.unpack_hidden(packed, H))
    torch.testing.assert_close(normed, ref.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre, ref.last_pre, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feat, ref.last_feat, atol=1e-5, rtol=1e-5)
    ids, vals = dm.candidates(normed[:, 1:].reshape(-1, H), target.head_weight, draft.top_k)
    ref_vals, ref_ids = ref.logits.topk(draft.top_k, dim=-1)
    assert torch.equal(ids.view(B, bs - 1, -1), ref_ids)
    torch.testing.assert_close(vals.view(B, bs - 1, -1), ref_vals, atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_transition_scores_match_reference_cache(target):
    draft = make_draft(target)
    cache, _ = fill_context(draft, [6, 10])
    anchor = torch.tensor([12, 140])
    out = draft.backbone(cache, anchor, target)
    ref = draft.transition(out, target)
    scores = dm.transition_scores(draft.injection, draft.norm, len(draft.layers), out.last_pre[:, 1:],
                                  out.last_feat[:, 1:], ref.cand, anchor, draft.transfer_codes, target.head_weight)
    torch.testing.assert_close(scores, ref.scores, atol=1e-5, rtol=1e-5)
    assert torch.equal(scores[:, 0, 0], scores[:, 0, -1])  # slot 1: every row is "after the anchor"


def _gens(seeds):
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


@torch.no_grad()
@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0], [0.7, 0.0, 1.3], [1.0, 0.5, 2.0]])
def test_walk_matches_reference_proposal(target, temps):
    draft = make_draft(target)
    cache, _ = fill_context(draft, [7, 3, 11])
    anchor = torch.tensor([9, 33, 180])
    B = anchor.shape[0]
    seeds = [None if t == 0 else 100 + b for b, t in enumerate(temps)]
    temperature = torch.tensor(temps)
    ref = draft.propose(cache, anchor, target, temperature, _gens(seeds))
    # the same draws the reference consumed: one rand(n) per sampled row from its generator
    n = draft.block_size - 1
    u = torch.stack([torch.zeros(n) if s is None else torch.rand(n, generator=torch.Generator().manual_seed(s))
                     for s in seeds])
    out = draft.backbone(cache, anchor, target)
    tr = draft.transition(out, target)
    greedy = temperature == 0
    tokens, q_rows = dm.walk(tr.cand, tr.scores, u, temperature.clamp_min(1e-5), greedy)
    assert torch.equal(tokens, ref.tokens)
    if ref.q is not None:
        torch.testing.assert_close(q_rows, ref.q.gather(-1, tr.cand), atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(q_rows.argmax(-1), (tr.cand == tokens[..., None]).int().argmax(-1))
        assert torch.all(q_rows.sum(-1) == 1)
    assert tokens.shape == (B, n)


def _sglang_block_hidden(draft, target, cache, anchor):
    """The plugin's block forward for ``anchor`` [B]: (normed, pre, feat) of slots 1..bs-1."""
    B, bs, H = anchor.shape[0], draft.block_size, draft.hidden_size
    tokens_in, layer_call = _sglang_style_block(draft, cache, anchor)
    embeds = target.embed(tokens_in).reshape(-1, H)
    anchor_pred = dm.anchor_predecessor(draft.injection, draft.transfer_codes, anchor)
    packed = dm.block_forward(layer_call, len(draft.layers), embeds, bs, draft.injection, anchor_pred,
                              draft.injection_offsets, draft.norm).view(B, bs, -1)[:, 1:]
    return dm.unpack_hidden(packed, H)


def _sglang_greedy_walk(draft, target, pre, feat, cand, anchor):
    """The plugin's transition scores and greedy walk over candidates ``cand`` [B, bs-1, k] -> tokens."""
    B, n = cand.shape[:2]
    scores = dm.transition_scores(draft.injection, draft.norm, len(draft.layers), pre, feat, cand, anchor,
                                  draft.transfer_codes, target.head_weight)
    tokens, _ = dm.walk(cand, scores, torch.zeros(B, n), torch.ones(B), torch.ones(B, dtype=torch.bool))
    return tokens


@torch.no_grad()
def test_full_sglang_style_proposal_equals_reference_greedy(target):
    """block_forward -> candidates -> transition_scores -> walk reproduces DSpineDraft.propose (greedy)."""
    draft = make_draft(target, seed=3)
    cache, _ = fill_context(draft, [5, 12, 8, 2])
    anchor = torch.tensor([1, 2, 254, 100])
    B, bs, H = anchor.shape[0], draft.block_size, draft.hidden_size
    ref = draft.propose(cache, anchor, target, torch.zeros(B), [None] * B)
    normed, pre, feat = _sglang_block_hidden(draft, target, cache, anchor)
    ids, _ = dm.candidates(normed.reshape(-1, H), target.head_weight, draft.top_k)
    assert torch.equal(_sglang_greedy_walk(draft, target, pre, feat, ids.view(B, bs - 1, -1), anchor), ref.tokens)


def test_chain_accept_index_and_replayssm_steps():
    commit = torch.tensor([1, 4, 2])
    idx = dm.chain_accept_index(commit, 4)
    assert idx.tolist() == [[0, -1, -1, -1], [4, 5, 6, 7], [8, 9, -1, -1]]
    last, track = dm.replayssm_step_indices(torch.tensor([10, 254, 255]), commit, None)
    assert last.tolist() == [0, 3, 1] and track is None
    # interval 256: row 1 goes 254 -> 258 (crosses at 256: state after step 256-254-1 = 1); row 2 255 -> 257
    last, track = dm.replayssm_step_indices(torch.tensor([10, 254, 255]), commit, 256)
    assert track.tolist() == [-1, 1, 0]


@torch.no_grad()
def test_draft_vocab_candidates_equal_reference_greedy(target):
    """With a draft vocabulary the SGLang path takes candidates from head[vocab] and maps them back to ids."""
    draft = make_draft(target, seed=4, draft_vocab=VOCAB)
    cache, _ = fill_context(draft, [5, 12, 3])
    anchor = torch.tensor([1, 2, 250])
    B, bs, H = anchor.shape[0], draft.block_size, draft.hidden_size
    ref = draft.propose(cache, anchor, target, torch.zeros(B), [None] * B)
    normed, pre, feat = _sglang_block_hidden(draft, target, cache, anchor)
    rows = target.head_weight[draft.draft_vocab]
    ids, _ = dm.vocab_candidates(normed.reshape(-1, H), rows, draft.draft_vocab, draft.top_k)
    assert set(ids.flatten().tolist()) <= set(VOCAB)
    assert torch.equal(_sglang_greedy_walk(draft, target, pre, feat, ids.view(B, bs - 1, -1), anchor), ref.tokens)
