"""DSpine draft: backbone parity, prefix property, transition cache, proposals, context, checkpoint format.

Tiny random targets (hidden 64, vocab 256) are written with transformers' ``save_pretrained`` and loaded with
``dspine.models.registry.load_target``; drafts are tiny too (3 layers, rank 16, top-k 4, block 8).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import DRAFT_BS as BS
from helpers import DRAFT_KW, fill_context, make_draft, save_hf_init_qwen3
from helpers import DRAFT_VOCAB as VOCAB
from helpers import randomize_draft as randomize
from safetensors.torch import load_file, save_file

from dspine.draft.config import parse_draft_config
from dspine.draft.io import init_draft, load_draft
from dspine.draft.proposal import candidates, sample_path
from dspine.models.checkpoint import ModelLoadError
from dspine.models.registry import load_target
from dspine.models.target import default_tap_ids

transformers = pytest.importorskip("transformers")

V, H = 256, 64


def _save_llama(path):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=V, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_init_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory):
    return load_target(_save_llama(tmp_path_factory.mktemp("llama")))


def greedy(draft, cache, anchor, target, **kw):
    B = anchor.shape[0]
    return draft.propose(cache, anchor, target, torch.zeros(B), [None] * B, **kw)


# ----------------------------------------------------------------------------------------------------------
# 1. zero writes == causal DFlash backbone; full forward == an independent naive reference


def test_zero_writes_equal_causal_dflash_bit_exact(target):
    draft = make_draft(target, random_writes=False)
    with torch.no_grad():  # everything but the writes random and non-zero, so only W_l = 0 can explain equality
        for name, p in draft.injection.named_parameters():
            if not name.startswith(("writes", "readouts")):
                p.normal_(0.0, 0.3)
    cache, _ = fill_context(draft, [11, 5, 8])
    anchor = torch.tensor([3, 17, 250])
    a = draft.backbone(cache, anchor, target, inject=True)
    b = draft.backbone(cache, anchor, target, inject=False)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
    # ... and the whole proposal then is DFlash's: refinement is a no-op, the walk takes each slot's argmax
    assert torch.equal(greedy(draft, cache, anchor, target).tokens, a.logits.argmax(-1))
    # non-zero writes do change the output (the comparison above is not vacuous)
    randomize(draft)
    c = draft.backbone(cache, anchor, target, inject=True)
    d = draft.backbone(cache, anchor, target, inject=False)
    assert not torch.allclose(c.hidden[:, 1:], d.hidden[:, 1:], atol=1e-3)
    assert torch.equal(c.hidden[:, 0], d.hidden[:, 0])  # slot 0 is never written


def _rope(x, pos, theta):
    # x [T, heads, D], pos [T]: rotate-half RoPE, written out independently of dspine.models.layers
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x.double().chunk(2, -1)
    return (x.double() * cos + torch.cat([-x2, x1], -1) * sin).float()


@torch.no_grad()
def reference_block(draft, target, taps, block_tokens, window):
    """One row, one block, no cache: explicit mask (context < anchor, causal block, window), naive injection."""
    S, bs = taps.shape[0], block_tokens.shape[0]
    r = draft.transfer_rank
    ctx = draft.hidden_norm(draft.fc(taps))  # [S, H]
    x = target.embed(block_tokens)  # [bs, H]
    pos_k = torch.arange(S + bs)
    pos_q = S + torch.arange(bs)
    visible = torch.zeros(bs, S + bs, dtype=torch.bool)
    for i in range(bs):
        for j in range(S + bs):
            in_ctx_or_prefix = j < S or j - S <= i
            visible[i, j] = in_ctx_or_prefix and (window is None or pos_k[j] > pos_q[i] - window)
    anchor_code = math.sqrt(r) * draft.transfer_codes[block_tokens[0]]
    for l, layer in enumerate(draft.layers):
        at = layer.self_attn
        nh, nkv, D = at.n_heads, at.n_kv, at.head_dim
        h = layer.input_layernorm(x)
        q = _rope(at.q_norm(at.q_proj(h).view(bs, nh, D)), pos_q, 10000.0)
        k = torch.cat([at.k_norm(at.k_proj(ctx).view(S, nkv, D)), at.k_norm(at.k_proj(h).view(bs, nkv, D))])
        k = _rope(k, pos_k, 10000.0)
        v = torch.cat([at.v_proj(ctx).view(S, nkv, D), at.v_proj(h).view(bs, nkv, D)])
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)  # [S+bs, nh, D]
        att = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)
        att = att.masked_fill(~visible[None], float("-inf")).softmax(-1)
        o = torch.einsum("hij,jhd->ihd", att, v).reshape(bs, nh * D)
        x = x + at.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        inj = draft.injection
        f = [math.sqrt(r) * torch.nn.functional.normalize(inj.readouts[l](x[i]), dim=0) for i in range(bs)]
        d = draft.injection_offsets[l]
        new = x.clone()
        for i in range(1, bs):
            p = f[i - d] if i - d >= 1 else anchor_code
            g = torch.sigmoid(inj.receiver_gate(f[i]) + inj.predecessor_gate(p) + inj.bias)
            new[i] = x[i] + x[i].norm() / math.sqrt(x.shape[-1]) * inj.writes[l](g * inj.message(p))
        x = new
    return draft.norm(x)


@pytest.mark.parametrize("window,offsets", [(None, [1, 1, 1]), (5, [1, 2, 4])])
def test_backbone_matches_naive_reference(target, window, offsets):
    draft = make_draft(target, sliding_window=window, injection_offsets=offsets)
    lengths = [12, 3, 9]
    cache, taps = fill_context(draft, lengths)
    g = torch.Generator().manual_seed(5)
    block = torch.randint(0, V, (3, BS), generator=g)
    out = draft.backbone(cache, block[:, 0], target, block_tokens=block)
    for b, n in enumerate(lengths):
        ref = reference_block(draft, target, taps[b, :n], block[b], window)
        torch.testing.assert_close(out.hidden[b], ref, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# 2. prefix property and batch independence


def test_prefix_property_later_slots_never_matter(target):
    draft = make_draft(target)
    cache, _ = fill_context(draft, [10, 4])
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, V, (2, BS), generator=g)
    ref = draft.backbone(cache, base[:, 0], target, block_tokens=base)
    for k in range(BS - 1):
        other = base.clone()
        other[:, k + 1 :] = torch.randint(0, V, (2, BS - k - 1), generator=g)
        out = draft.backbone(cache, other[:, 0], target, block_tokens=other)
        assert torch.equal(out.hidden[:, : k + 1], ref.hidden[:, : k + 1]), k
        assert torch.equal(out.logits[:, :k], ref.logits[:, :k]), k  # logits[:, i-1] belong to slot i
        # slot k+1 changed input, and through injection (and attention) slot k+2 sees it
        if k + 2 < BS:
            assert not torch.allclose(out.hidden[:, k + 2], ref.hidden[:, k + 2])


def test_injection_into_later_slots_never_reaches_earlier_ones(target, monkeypatch):
    """Bump only slot j's injected write (every layer): slots < j are bit-identical, slot j moves."""
    draft = make_draft(target, injection_offsets=[1, 2, 1])
    cache, _ = fill_context(draft, [7, 12])
    anchor = torch.tensor([9, 99])
    ref = draft.backbone(cache, anchor, target)
    write = draft.injection.write
    for j in range(1, BS):

        def bumped(layer, h, f, p, j=j):
            out = write(layer, h, f, p)
            if h.dim() == 3:  # the block's write covers slots 1..bs-1 (refinement calls it with 4 dims)
                out = out.clone()
                out[:, j - 1] += 0.5
            return out

        monkeypatch.setattr(draft.injection, "write", bumped)
        out = draft.backbone(cache, anchor, target)
        assert torch.equal(out.hidden[:, :j], ref.hidden[:, :j]), j
        assert torch.equal(out.logits[:, : j - 1], ref.logits[:, : j - 1]), j
        assert not torch.allclose(out.hidden[:, j], ref.hidden[:, j]), j


def test_rows_do_not_depend_on_batch_neighbours(target):
    draft = make_draft(target)
    lengths = [10, 3, 14]
    cache, taps = fill_context(draft, lengths)
    anchor = torch.tensor([5, 77, 200])
    together = greedy(draft, cache, anchor, target)
    out_together = draft.backbone(cache, anchor, target)
    for b, n in enumerate(lengths):
        alone_cache = draft.new_cache(1, 16)
        draft.extend_context(alone_cache, taps[b : b + 1, :n], torch.tensor([n]))
        alone = greedy(draft, alone_cache, anchor[b : b + 1], target)
        assert torch.equal(alone.tokens[0], together.tokens[b])
        out_alone = draft.backbone(alone_cache, anchor[b : b + 1], target)
        torch.testing.assert_close(out_alone.hidden[0], out_together.hidden[b], atol=1e-5, rtol=1e-5)


def test_shorter_block_is_a_prefix_of_the_longer_one(target):
    draft = make_draft(target)
    cache, _ = fill_context(draft, [9, 6])
    anchor = torch.tensor([1, 2])
    full = greedy(draft, cache, anchor, target)
    for bs in (2, 4, 7):
        short = greedy(draft, cache, anchor, target, block_size=bs)
        assert short.tokens.shape == (2, bs - 1) and torch.equal(short.tokens, full.tokens[:, : bs - 1])
        assert torch.equal(short.n_draft, torch.full((2,), bs - 1))
    with pytest.raises(ValueError, match="block_size"):
        greedy(draft, cache, anchor, target, block_size=BS + 1)


# ----------------------------------------------------------------------------------------------------------
# 3. transition cache == sequential refinement


@torch.no_grad()
def refine_one(draft, out, slot: int, pred: torch.Tensor) -> torch.Tensor:
    """h~(slot | pred) [B, H]: one slot's refined, normed state given predecessor tokens ``pred`` [B] -- the
    sequential definition the transition cache batches (every slot is refined with ``pred``; one is kept)."""
    return draft.refine_slots(out, pred[:, None].expand(-1, out.hidden.shape[1] - 1))[:, slot - 1]


def test_transition_walk_equals_sequential_refinement(target):
    draft = make_draft(target, top_k=6)
    cache, _ = fill_context(draft, [12, 5, 8, 1])
    anchor = torch.tensor([4, 100, 31, 255])
    out = draft.backbone(cache, anchor, target)
    tr = draft.transition(out, target)
    prop = greedy(draft, cache, anchor, target)
    head = target.head_weight
    B, n, k = tr.cand.shape
    rows = torch.arange(B)
    prev, prev_idx = anchor, torch.zeros(B, dtype=torch.long)
    seq = []
    for i in range(1, n + 1):
        h = refine_one(draft, out, i, prev)  # [B, H]
        s = torch.einsum("bh,bkh->bk", h, head[tr.cand[:, i - 1]])
        torch.testing.assert_close(s, tr.scores[rows, i - 1, prev_idx], atol=1e-5, rtol=1e-5)
        prev_idx = s.argmax(-1)
        prev = tr.cand[rows, i - 1, prev_idx]
        seq.append(prev)
    assert torch.equal(torch.stack(seq, 1), prop.tokens)
    # slot 1's refinement uses the anchor as predecessor, exactly like the backbone's last write did
    torch.testing.assert_close(tr.scores[:, 0, 0], out.logits[:, 0].gather(-1, tr.cand[:, 0]), atol=1e-5, rtol=1e-5)
    assert torch.equal(tr.scores[:, 0], tr.scores[:, 0, :1].expand(-1, k, -1))
    # later slots: the chosen predecessor's code replaces the predicted feature, so scores really move
    backbone_scores = out.logits[:, 1:].gather(-1, tr.cand[:, 1:])[:, :, None, :].expand(-1, -1, k, -1)
    assert not torch.allclose(tr.scores[:, 1:], backbone_scores, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------
# 6. context extension, determinism, sampling


def test_extend_context_ragged_chunks_equal_one_call(target):
    draft = make_draft(target)
    lengths = [13, 6, 9]
    one, taps = fill_context(draft, lengths)
    chunks = [[5, 2, 4], [6, 4, 0], [2, 0, 5]]
    many = draft.new_cache(3, 4)  # small capacity: the cache must grow
    offset = [0, 0, 0]
    g = torch.Generator().manual_seed(9)
    for nv in chunks:
        T = max(nv)
        x = torch.randn(3, T, taps.shape[-1], generator=g) * 100  # garbage beyond n_valid
        for b in range(3):
            x[b, : nv[b]] = taps[b, offset[b] : offset[b] + nv[b]]
            offset[b] += nv[b]
        draft.extend_context(many, x, torch.tensor(nv))
    assert many.lengths.tolist() == lengths == one.lengths.tolist()
    for a, b in zip(one.layers, many.layers, strict=True):
        for r, n in enumerate(lengths):
            torch.testing.assert_close(a.k[r, :, :n], b.k[r, :, :n], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(a.v[r, :, :n], b.v[r, :, :n], atol=1e-6, rtol=1e-6)
    anchor = torch.tensor([7, 8, 9])
    assert torch.equal(greedy(draft, one, anchor, target).tokens, greedy(draft, many, anchor, target).tokens)


def test_extend_context_from_real_target_taps(target):
    """Feeding the target's own taps works end to end (prefill in two ragged pieces == one)."""
    draft = make_draft(target)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    tc = target.new_cache(2, 32)
    taps = target.forward(ids, tc, taps=tuple(draft.target_layer_ids)).taps
    assert taps.shape == (2, 12, len(draft.target_layer_ids) * H)
    cache = draft.new_cache(2, 32)
    draft.extend_context(cache, taps, torch.tensor([12, 7]))
    p = greedy(draft, cache, ids[:, -1], target)
    assert p.tokens.shape == (2, BS - 1) and p.q is None and p.confidence is None


def test_greedy_propose_is_deterministic_and_leaves_cache_alone(target):
    draft = make_draft(target)
    cache, _ = fill_context(draft, [8, 3])
    lengths = cache.lengths.clone()
    kv = [(layer.k[:, :, :8].clone(), layer.v[:, :, :8].clone()) for layer in cache.layers]
    anchor = torch.tensor([11, 12])
    a = greedy(draft, cache, anchor, target)
    b = greedy(draft, cache, anchor, target)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.n_draft, torch.full((2,), BS - 1))
    assert a.q is None and a.confidence is None
    assert torch.equal(cache.lengths, lengths)
    for (k, v), layer in zip(kv, cache.layers, strict=True):
        for r, n in enumerate(lengths.tolist()):
            assert torch.equal(layer.k[r, :, :n], k[r, :, :n]) and torch.equal(layer.v[r, :, :n], v[r, :, :n])


def _gens(seeds):
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def test_sampled_propose_reproducible_and_q_is_the_sampled_distribution(target):
    draft = make_draft(target)
    cache, _ = fill_context(draft, [10, 6, 3])
    anchor = torch.tensor([1, 2, 3])
    temp = torch.tensor([0.0, 0.7, 1.5])
    a = draft.propose(cache, anchor, target, temp, _gens([None, 11, 12]))
    b = draft.propose(cache, anchor, target, temp, _gens([None, 11, 12]))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)
    assert a.q.shape == (3, BS - 1, V) and a.q.dtype == torch.float32
    torch.testing.assert_close(a.q.sum(-1), torch.ones(3, BS - 1))
    assert (a.q.gather(-1, a.tokens[..., None]) > 0).all()  # every sampled token has q > 0
    assert ((a.q > 0).sum(-1) <= draft.top_k).all()  # q lives on the k candidates only
    # the greedy row in a mixed batch: one-hot q on its (greedy) tokens
    assert torch.equal(a.q[0], torch.nn.functional.one_hot(a.tokens[0], V).float())
    assert torch.equal(a.tokens[0], greedy(draft, cache, anchor, target).tokens[0])
    # q is exactly softmax(scores[row of the previous pick] / T) over the candidates
    tr = draft.transition(draft.backbone(cache, anchor, target), target)
    for b_ in (1, 2):
        prev_idx = 0
        for i in range(BS - 1):
            q = torch.softmax(tr.scores[b_, i, prev_idx] / temp[b_], -1)
            torch.testing.assert_close(a.q[b_, i, tr.cand[b_, i]], q)
            prev_idx = int((tr.cand[b_, i] == a.tokens[b_, i]).nonzero())


def test_sampling_uses_exactly_one_rand_per_sampled_row_and_ignores_neighbours(target):
    draft = make_draft(target)
    lengths = [10, 6, 3]
    cache, taps = fill_context(draft, lengths)
    anchor = torch.tensor([1, 2, 3])
    gens = _gens([21, 22, 23])
    batch = draft.propose(cache, anchor, target, torch.tensor([1.0, 0.0, 1.0]), gens)
    for g, sampled in zip(gens, [True, False, True], strict=True):
        fresh = torch.Generator().manual_seed(int(g.initial_seed()))
        if sampled:
            torch.rand(BS - 1, generator=fresh)
        assert torch.equal(g.get_state(), fresh.get_state())
    # row 2 alone (same seed) draws the same tokens as inside the batch
    alone_cache = draft.new_cache(1, 16)
    draft.extend_context(alone_cache, taps[2:3, :3], torch.tensor([3]))
    alone = draft.propose(alone_cache, anchor[2:], target, torch.tensor([1.0]), _gens([23]))
    assert torch.equal(alone.tokens[0], batch.tokens[2])
    # dynamic stopping does not change how many uniforms are drawn
    g = _gens([5])
    draft.propose(alone_cache, anchor[2:], target, torch.tensor([1.0]), g, block_size=4)
    ref = torch.Generator().manual_seed(5)
    torch.rand(3, generator=ref)
    assert torch.equal(g[0].get_state(), ref.get_state())


def test_sampled_slot1_frequencies_match_q(target):
    """400 identical rows with their own generators: slot-1 draws follow q_1 (chi-square, fixed seeds)."""
    draft = make_draft(target, top_k=4)
    N = 400
    one, _ = fill_context(draft, [6])
    cache = one.select([0] * N)
    p = draft.propose(cache, torch.full((N,), 42), target, torch.full((N,), 1.0), _gens(range(N)), block_size=2)
    q = p.q[0, 0]
    assert torch.allclose(p.q[:, 0], q.expand(N, -1))
    support = q.nonzero().squeeze(-1)
    counts = torch.stack([(p.tokens[:, 0] == t).sum() for t in support]).double()
    assert counts.sum() == N  # never outside the support
    expected = q[support].double() * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # p > 1e-3 with <= 3 degrees of freedom


# ----------------------------------------------------------------------------------------------------------
# confidence head and dynamic stopping


def test_dynamic_threshold_stops_at_first_low_confidence(target):
    draft = make_draft(target, confidence_trained=True)
    assert draft.confidence_enabled
    cache, _ = fill_context(draft, [9, 4, 12])
    anchor = torch.tensor([6, 60, 160])
    free = greedy(draft, cache, anchor, target)
    assert free.confidence.shape == (3, BS - 1) and torch.equal(free.n_draft, torch.full((3,), BS - 1))
    # c_i = sigma(w . [h~(i | x_{i-1}); code(x_{i-1})] + b) along the chosen path, before x_i is chosen
    out = draft.backbone(cache, anchor, target)
    prev = anchor
    for i in range(1, BS):
        c = draft.confidence(refine_one(draft, out, i, prev), prev)
        torch.testing.assert_close(free.confidence[:, i - 1], c, atol=1e-6, rtol=1e-6)
        prev = free.tokens[:, i - 1]
    theta = float(free.confidence.median())
    cut = greedy(draft, cache, anchor, target, dynamic_threshold=theta)
    assert torch.equal(cut.tokens, free.tokens)  # stopping never changes the walk
    for b in range(3):
        low = (free.confidence[b] < theta).nonzero()
        expected = int(low[0]) if len(low) else BS - 1
        assert int(cut.n_draft[b]) == expected
    assert 0 < int(cut.n_draft.min()) or int(cut.n_draft.max()) < BS - 1
    assert torch.equal(greedy(draft, cache, anchor, target, dynamic_threshold=0.0).n_draft, torch.full((3,), 7))
    assert torch.equal(greedy(draft, cache, anchor, target, dynamic_threshold=1.01).n_draft, torch.zeros(3).long())


def test_untrained_or_missing_head_never_stops(target):
    anchor = torch.tensor([6, 60])
    for kw in (dict(confidence_trained=False), dict(use_confidence_head=False)):
        draft = make_draft(target, **kw)
        assert not draft.confidence_enabled
        cache, _ = fill_context(draft, [9, 4])
        p = greedy(draft, cache, anchor, target, dynamic_threshold=1.01)
        assert p.confidence is None and torch.equal(p.n_draft, torch.full((2,), BS - 1))
    assert draft.confidence_head is None


# ----------------------------------------------------------------------------------------------------------
# 5. checkpoint format


EXPECTED_NAMES = {
    "fc.weight", "hidden_norm.weight", "norm.weight", "transfer_codes", "transfer_ready",
    "injection.message.weight", "injection.receiver_gate.weight", "injection.predecessor_gate.weight",
    "injection.bias", "confidence_head.proj.weight", "confidence_head.proj.bias",
}  # fmt: skip
for _i in range(3):
    EXPECTED_NAMES |= {f"injection.readouts.{_i}.weight", f"injection.writes.{_i}.weight"}
    EXPECTED_NAMES |= {f"layers.{_i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    EXPECTED_NAMES |= {f"layers.{_i}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    EXPECTED_NAMES |= {f"layers.{_i}.self_attn.{n}.weight" for n in ("q_norm", "k_norm")}
    EXPECTED_NAMES |= {f"layers.{_i}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}


def test_save_writes_section4_layout(target, tmp_path):
    draft = make_draft(target)
    draft.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == EXPECTED_NAMES
    r, m = 16, 32
    assert tensors["fc.weight"].shape == (H, len(draft.target_layer_ids) * H)
    assert tensors["injection.readouts.0.weight"].shape == (r, H)
    assert tensors["injection.writes.2.weight"].shape == (H, m)
    assert tensors["injection.message.weight"].shape == (m, r) and tensors["injection.bias"].shape == (m,)
    assert tensors["transfer_codes"].shape == (V, r)
    assert tensors["transfer_ready"].shape == () and tensors["transfer_ready"].dtype == torch.bool
    assert tensors["confidence_head.proj.weight"].shape == (1, H + r)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DSpineDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["is_causal"] is True and cfg["num_hidden_layers"] == 3 and cfg["block_size"] == BS
    assert list(cfg["dflash_config"]) == ["block_size", "mask_token_id", "target_layer_ids", "num_target_layers"]
    assert list(cfg["dspine_config"]) == [
        "transfer_rank", "message_size", "top_k", "ce_weight", "alignment_weight", "alignment_warmup_steps",
        "replacement_layers", "replacement_probability", "replacement_hold_ratio", "replacement_end_ratio",
        "candidate_mass_threshold", "injection_offsets", "use_confidence_head", "confidence_trained",
    ]  # fmt: skip
    assert cfg["dflash_config"]["mask_token_id"] == V - 1  # the tiny target config has no mask token
    assert cfg["layer_types"] == ["sliding_attention"] * 3 and cfg["sliding_window"] == 8192
    hf = transformers.AutoConfig.from_pretrained(tmp_path)  # model_type must stay transformers-parsable
    assert hf.model_type == "qwen3" and hf.num_hidden_layers == 3


def test_save_load_round_trip_exact(target, tmp_path):
    draft = make_draft(target, confidence_trained=True)
    draft.save(tmp_path)
    back = load_draft(tmp_path)
    assert back.config == json.loads((tmp_path / "config.json").read_text())
    assert back.confidence_trained and back.confidence_enabled
    a, b = draft.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    cache, _ = fill_context(draft, [7, 3])
    cache2, _ = fill_context(back, [7, 3])
    anchor = torch.tensor([1, 2])
    p1 = draft.propose(cache, anchor, target, torch.tensor([0.0, 1.0]), _gens([None, 4]), dynamic_threshold=0.5)
    p2 = back.propose(cache2, anchor, target, torch.tensor([0.0, 1.0]), _gens([None, 4]), dynamic_threshold=0.5)
    for f in ("tokens", "q", "n_draft", "confidence"):
        assert torch.equal(getattr(p1, f), getattr(p2, f)), f


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    save_file(fn(tensors), str(path / "model.safetensors"))


def test_loader_prefix_borrowed_tensors_and_strictness(target, tmp_path):
    draft = make_draft(target)
    draft.save(tmp_path)
    ref = draft.state_dict()
    extra = {"embed_tokens.weight": torch.zeros(V, H), "lm_head.weight": torch.zeros(V, H)}
    _rewrite(tmp_path, lambda t: {**{f"model.{k}": v for k, v in t.items()}, **extra})
    back = load_draft(tmp_path)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.items())

    _rewrite(tmp_path, lambda t: {**t, "model.layers.0.self_attn.extra.weight": torch.zeros(2)})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_draft(tmp_path)
    _rewrite(tmp_path, lambda t: {k: v for k, v in t.items() if "extra" not in k and k != "model.norm.weight"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'norm\.weight'"):
        load_draft(tmp_path)
    _rewrite(tmp_path, lambda t: {**t, "model.norm.weight": torch.ones(H + 1)})
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \[65\]"):
        load_draft(tmp_path)


def test_confidence_head_is_optional(target, tmp_path):
    draft = make_draft(target)
    draft.save(tmp_path)
    _rewrite(tmp_path, lambda t: {k: v for k, v in t.items() if not k.startswith("confidence_head.")})
    back = load_draft(tmp_path)
    assert back.confidence_head is None and not back.confidence_enabled
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dspine_config"]["confidence_trained"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json.*confidence_trained.*confidence_head\.proj\.weight"):
        load_draft(tmp_path)


BAD_CONFIGS = [
    ("dspine_config", "transfer_rank", 0),
    ("dspine_config", "transfer_rank", H + 1),
    ("dspine_config", "top_k", 0),
    ("dspine_config", "top_k", V + 1),
    ("dspine_config", "message_size", 0),
    ("dspine_config", "replacement_hold_ratio", 0.5),  # == end ratio 0.5 below
    ("dspine_config", "replacement_end_ratio", 1.5),
    ("dspine_config", "injection_offsets", [1, 1]),
    ("dspine_config", "injection_offsets", [1, 0, 1]),
    ("dspine_config", "use_confidence_head", "yes"),
    ("dflash_config", "block_size", 1),
    ("dflash_config", "mask_token_id", V),
    ("dflash_config", "target_layer_ids", [0, 9]),
    ("dflash_config", "target_layer_ids", []),
    (None, "dspine_config", None),
    (None, "is_causal", False),
]


@pytest.mark.parametrize("block,key,value", BAD_CONFIGS)
def test_loader_rejects_bad_config_values(target, tmp_path, block, key, value):
    draft = make_draft(target)
    draft.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if key == "replacement_hold_ratio":
        cfg["dspine_config"]["replacement_end_ratio"] = 0.5
    if block is None:
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    else:
        cfg[block][key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_draft(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and key in str(e.value)


def test_dflash_keys_fall_back_to_top_level(target, tmp_path):
    draft = make_draft(target)
    draft.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    flash = cfg.pop("dflash_config")
    cfg.update(flash)
    spec = parse_draft_config(cfg)
    assert spec.block_size == BS and list(spec.target_layer_ids) == draft.target_layer_ids
    cfg["dflash_config"] = {"block_size": 4}  # dflash_config wins over the top level
    assert parse_draft_config(cfg).block_size == 4


def test_load_in_bfloat16_runs(target, tmp_path):
    draft = make_draft(target, confidence_trained=True)
    draft.save(tmp_path)
    back = load_draft(tmp_path, dtype=torch.bfloat16)
    assert back.transfer_codes.dtype == torch.bfloat16 and back.transfer_ready.dtype == torch.bool
    cache, _ = fill_context(back, [5, 2])
    p = back.propose(cache, torch.tensor([1, 2]), target, torch.tensor([0.0, 0.8]), _gens([None, 1]))
    assert p.tokens.shape == (2, BS - 1) and torch.isfinite(p.q).all() and torch.isfinite(p.confidence).all()


# ----------------------------------------------------------------------------------------------------------
# init_draft and 7. tap ids


TAP_TABLE = [  # known target depths and their tap layers, plus the one-tap rule
    (36, 5, [1, 9, 17, 25, 33]),
    (64, 5, [1, 16, 31, 46, 61]),
    (32, 5, [1, 8, 15, 22, 29]),
    (30, 5, [1, 8, 14, 20, 27]),
    (9, 1, [4]),
]


@pytest.mark.parametrize("L,n,ids", TAP_TABLE)
def test_default_tap_ids_match_design_table(L, n, ids):
    assert default_tap_ids(L, n) == ids


def test_init_draft_defaults_and_overrides(target, tied_target):
    draft = init_draft(target)
    assert draft.target_layer_ids == default_tap_ids(target.num_layers, min(5, target.num_layers))
    assert draft.fc.in_features == len(draft.target_layer_ids) * H
    assert len(draft.layers) == 5 and draft.block_size == 16 and draft.top_k == 16
    assert draft.transfer_rank == min(1024, H, V - 1) and draft.injection.message.out_features == min(512, H)
    assert draft.mask_token_id == V - 1 and draft.windows == [8192] * 5
    a = draft.layers[0].self_attn
    assert (a.n_heads, a.n_kv, a.head_dim) == (4, 2, 16) and draft.layers[0].mlp.up_proj.out_features == 128
    assert all(torch.equal(w.weight, torch.zeros_like(w.weight)) for w in draft.injection.writes)
    assert torch.equal(draft.injection.predecessor_gate.weight, torch.zeros(H, H))
    small = init_draft(target, num_layers=2, intermediate_size=32, target_layer_ids=[0, 3], sliding_window=None,
                       mask_token_id=7, top_k=3, seed=4)  # fmt: skip
    assert small.layers[0].mlp.up_proj.out_features == 32 and small.fc.in_features == 2 * H
    assert small.windows == [None, None] and small.mask_token_id == 7 and small.top_k == 3
    same_seed = [init_draft(target, seed=4, **DRAFT_KW) for _ in range(2)]
    assert torch.equal(same_seed[0].fc.weight, same_seed[1].fc.weight)
    with pytest.raises(TypeError, match="unknown override"):
        init_draft(target, hidden_size=32)
    with pytest.raises(ModelLoadError, match="init_draft: dspine_config.top_k"):
        init_draft(target, top_k=0)
    # a tied-embedding Llama target works too (codes from the embedding matrix)
    d2 = make_draft(tied_target)
    cache, _ = fill_context(d2, [4])
    assert greedy(d2, cache, torch.tensor([3]), tied_target).tokens.shape == (1, BS - 1)


def test_target_taps_are_layer_outputs(target_dir, target):
    """A tap id is that layer's output: HF ``hidden_states[id + 1]``."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    tap_ids = (0, 2, 1)
    taps = target.forward(ids, target.new_cache(1, 16), taps=tap_ids).taps
    for j, i in enumerate(tap_ids):
        torch.testing.assert_close(taps[..., j * H : (j + 1) * H], hs[i + 1], atol=1e-5, rtol=1e-5)


def test_mismatched_target_is_refused(target, tied_target, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=V)  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    other = load_target(tmp_path)
    draft = make_draft(target)
    cache, _ = fill_context(draft, [3])
    with pytest.raises(ValueError, match="does not match the draft"):
        greedy(draft, cache, torch.tensor([1]), other)


def _propose_refining_chosen_only(draft, cache, anchor, target, temperature, generators, threshold):
    """Oracle: the sampled path with refinement computed only for the predecessor actually chosen, slot by slot
    (the sequential definition the transition cache batches; k x fewer refinements, one slot at a time)."""
    out = draft.backbone(cache, anchor, target)
    cand = candidates(draft, out)  # [B, n, k] target ids
    w = target.head_weight[cand]  # [B, n, k, H]
    rows = torch.arange(cand.shape[0])

    def slot_scores(i: int, prev: torch.Tensor):
        pred = out.anchor if i == 0 else cand[rows, i - 1, prev]  # [B]
        refined = refine_one(draft, out, 1 + i, pred)  # [B, H]
        scores = (w[:, i] @ refined.to(w.dtype)[:, :, None])[..., 0].float()  # [B, k]
        return scores, draft.confidence(refined, pred) if draft.confidence_enabled else None

    return sample_path(cand, slot_scores, temperature, generators, threshold, draft.vocab_size)


def test_refining_chosen_only_equals_transition_cache():
    """Refining only the chosen predecessor, slot by slot == walking the full transition cache (``propose``)."""
    import torch as _t
    from helpers import save_tiny_hf  # not `conftest`: with a conftest.py in tests/objstore/ too that name is ambiguous

    from dspine import init_draft
    from dspine.models.registry import load_target

    tgt = load_target(save_tiny_hf(__import__("tempfile").mkdtemp(), "qwen3", layers=4))
    d = init_draft(tgt, num_layers=2, block_size=8, seed=3, top_k=5)
    g = _t.Generator().manual_seed(0)
    with _t.no_grad():
        for name, p in d.named_parameters():
            if "injection" in name or "confidence" in name:
                p.copy_(_t.randn(p.shape, generator=g) * 0.3)
    d.confidence_trained = True
    cache = d.new_cache(3, 64)
    d.extend_context(cache, _t.randn(3, 10, len(d.target_layer_ids) * tgt.hidden_size), _t.tensor([10, 4, 7]))
    anchor = _t.tensor([5, 9, 11])
    temps = _t.tensor([0.0, 0.8, 1.3])
    outs = {}
    for walk in ("cache", "lazy"):
        gens = [None, _t.Generator().manual_seed(1), _t.Generator().manual_seed(2)]
        if walk == "cache":
            outs[walk] = d.propose(cache, anchor, tgt, temps, gens, dynamic_threshold=0.5)
        else:
            outs[walk] = _propose_refining_chosen_only(d, cache, anchor, tgt, temps, gens, threshold=0.5)
    a, b = outs["cache"], outs["lazy"]
    assert _t.equal(a.tokens, b.tokens) and _t.equal(a.n_draft, b.n_draft)
    assert _t.allclose(a.q, b.q, atol=1e-5) and _t.allclose(a.confidence, b.confidence, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# draft vocabulary: the proposal head over a subset of the target's ids

def test_draft_vocab_logits_are_the_full_logits_restricted(target):
    full = make_draft(target)
    sub = make_draft(target, draft_vocab=list(reversed(VOCAB)))  # any order in: stored sorted
    assert sub.draft_vocab.tolist() == VOCAB and sub.config["dspine_config"]["draft_vocab_size"] == len(VOCAB)
    cache, _ = fill_context(full, [5, 9])
    cache2, _ = fill_context(sub, [5, 9])
    anchor = torch.tensor([3, 7])
    a, b = full.backbone(cache, anchor, target), sub.backbone(cache2, anchor, target)
    assert b.logits.shape == (2, BS - 1, len(VOCAB))
    torch.testing.assert_close(b.logits, a.logits[..., VOCAB])
    p = greedy(sub, cache2, anchor, target)
    assert set(p.tokens.flatten().tolist()) <= set(VOCAB)
    ps = sub.propose(cache2, anchor, target, torch.ones(2), _gens([1, 2]))
    assert set(ps.tokens.flatten().tolist()) <= set(VOCAB)
    off = torch.ones(V, dtype=torch.bool)
    off[VOCAB] = False
    assert ps.q[..., off].abs().sum() == 0 and torch.allclose(ps.q.sum(-1), torch.ones(2, BS - 1))


def test_draft_vocab_index_round_trip(target):
    sub = make_draft(target, draft_vocab=VOCAB)
    ids = torch.tensor([[0, 3, 4], [255, 6, 254]])
    idx, present = sub.vocab_index(ids)
    assert present.tolist() == [[True, True, False], [True, True, False]]
    assert torch.equal(sub.vocab_ids(idx)[present], ids[present])


def test_draft_vocab_save_load_and_bad_vocab(target, tmp_path):
    sub = make_draft(target, draft_vocab=VOCAB)
    sub.save(tmp_path)
    back = load_draft(tmp_path)
    assert torch.equal(back.draft_vocab, sub.draft_vocab)
    back_bf16 = load_draft(tmp_path, dtype=torch.bfloat16)
    assert back_bf16.draft_vocab.dtype == torch.long and torch.equal(back_bf16.draft_vocab, sub.draft_vocab)
    for bad, msg in (([5, 3] + VOCAB[2:], "increasing"), (VOCAB[:-1] + [V + 4], "outside")):
        _rewrite(tmp_path, lambda t, bad=bad: {**t, "draft_vocab": torch.tensor(bad)})
        with pytest.raises(ModelLoadError, match=msg):
            load_draft(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dspine_config"]["draft_vocab_size"] = 2  # < top_k
    with pytest.raises(ModelLoadError, match="draft_vocab_size"):
        parse_draft_config(cfg)


def test_with_draft_vocab_keeps_every_weight(target):
    from dspine.draft.io import with_draft_vocab

    full = make_draft(target, confidence_trained=True)
    sub = with_draft_vocab(full, VOCAB)
    assert sub.draft_vocab.tolist() == VOCAB and sub.confidence_trained
    for name, t in full.state_dict().items():
        assert torch.equal(t, sub.state_dict()[name]), name
    cache, _ = fill_context(full, [6])
    cache2, _ = fill_context(sub, [6])
    a, b = full.backbone(cache, torch.tensor([4]), target), sub.backbone(cache2, torch.tensor([4]), target)
    torch.testing.assert_close(b.logits, a.logits[..., VOCAB])
