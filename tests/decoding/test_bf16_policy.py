"""Decoding under the bf16 policy (bf16 family of linears, bf16 KV cache; dense targets on AVX512-BF16 CPUs): greedy
speculative output is the plain output (scripted, random DSpine draft and suffix proposers), and the prefix cache
changes no output -- the fp32 tests of test_generate.py / test_prefix.py, mirrored on a bf16 target."""

from __future__ import annotations

import pytest
import torch
from helpers import ScriptedDraft, random_mistakes, save_tiny_hf, token_prompts
from test_generate import CHEAP, _random_dspine, _repetitive_prompts
from test_prefix import _prefix_heavy

from dspine import generate, load_target
from dspine.cpu import kernels
from dspine.decoding.prefix import PrefixCache

pytestmark = pytest.mark.skipif(kernels.disabled() or kernels.load() is None or not kernels.bf16dp_ok(),
                                reason="no AVX512-BF16 on this CPU (or the kernels are off)")


@pytest.fixture(scope="module", params=["llama-d32", "qwen3"])
def target(request, tmp_path_factory):
    """llama with head_dim 32 (attention on bf16 dot products), qwen3 with head_dim 16 (attention over the bf16
    cache in fp32, the per-query loop, q/k norms)."""
    where = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        path = save_tiny_hf(where, "qwen3")
    else:
        path = save_tiny_hf(where, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    t = load_target(path, dtype=torch.bfloat16)
    kv = "-kvbf16dp" if request.param == "llama-d32" else "-kvbf16"
    assert t.kernel.endswith("-bf16" + kv) and t.kv_dtype == torch.bfloat16
    return t


@pytest.mark.parametrize("batch,bs", [(1, 4), (3, 16), (8, 2)])
def test_greedy_speculative_equals_ar(target, batch, bs):
    prompts = token_prompts(batch, target.vocab_size, seed=batch * 100 + bs)
    ar = generate(target, None, prompts, max_new_tokens=24)
    script = [o.token_ids for o in ar]
    for rate in (0.0, 0.3, 1.0):
        draft = ScriptedDraft(prompts, script, block_size=bs, mistake=random_mistakes(bs, rate))
        spec = generate(target, draft, prompts, max_new_tokens=24)
        assert [s.token_ids for s in spec] == script
        if rate == 0.0:
            assert sum(s.stats.draft_tokens_accepted for s in spec) > 0


@pytest.mark.parametrize("bs,dyn", [(4, None), (16, 0.5)])
def test_dspine_draft_greedy_equals_ar(target, bs, dyn):
    prompts = token_prompts(5, target.vocab_size, seed=bs)
    ar = generate(target, None, prompts, max_new_tokens=20)
    spec = generate(target, _random_dspine(target, bs, seed=1), prompts, max_new_tokens=20, dynamic_threshold=dyn)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]


@pytest.mark.parametrize("proposers", ["suffix", "auto"])
def test_suffix_greedy_equals_ar(target, proposers):
    prompts = _repetitive_prompts(target, 5, seed=7)
    ar = generate(target, None, prompts, max_new_tokens=30)
    d = _random_dspine(target, 4, seed=1) if proposers == "auto" else None
    spec = generate(target, d, prompts, max_new_tokens=30, verify="cost", cost=CHEAP, prices="static",
                    proposers=proposers, batch_size=3)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    assert sum(s.stats.suffix_accepted for s in spec) > 0  # suffix proposals were really verified and accepted


@pytest.mark.parametrize("batch", [1, 4])
def test_prefix_cache_changes_no_output(target, batch):
    """bf16 keys and values copied from the tree are the ones a fresh prefill writes: greedy, sampled and
    speculative (draft context from the tree) outputs are the same with sharing on and off."""
    prompts = _prefix_heavy(target.vocab_size, seed=batch)
    off = generate(target, None, prompts, max_new_tokens=10, batch_size=batch)
    tree = PrefixCache()
    on = generate(target, None, prompts, max_new_tokens=10, batch_size=batch, prefix_cache=tree)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.cached_prompt_tokens for o in on) > 0
    held = [kv for node in tree._nodes() for kv in node.kv if kv is not None]
    assert held and {t.dtype for kv in held for t in kv} == {torch.bfloat16}  # stored in the cache's dtype
    again = generate(target, None, prompts, max_new_tokens=10, batch_size=batch, prefix_cache=tree)
    assert [o.token_ids for o in again] == [o.token_ids for o in off]
    kw = dict(max_new_tokens=12, verify="cost", cost=CHEAP, prices="static", proposers="auto", batch_size=3)
    d = _random_dspine(target, 4, seed=3)
    spec = generate(target, d, prompts, prefix_cache=PrefixCache(), **kw)
    assert [o.token_ids for o in spec] == [o.token_ids for o in generate(target, None, prompts, max_new_tokens=12)]
    seeds = list(range(len(prompts)))
    skw = dict(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=seeds, batch_size=batch)
    assert [o.token_ids for o in generate(target, None, prompts, prefix_cache=PrefixCache(), **skw)] == \
        [o.token_ids for o in generate(target, None, prompts, **skw)]


def test_tree_never_mixes_kv_dtypes(tmp_path):
    """One target switched between fp32 and bf16 keys and values: the tree is emptied, never read across."""
    path = save_tiny_hf(tmp_path, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                        num_key_value_heads=2)
    t = load_target(path, dtype=torch.bfloat16)
    p = token_prompts(1, t.vocab_size, seed=1, lo=20, hi=21)[0]
    tree = PrefixCache()
    generate(t, None, [p], max_new_tokens=1, prefix_cache=tree)
    assert tree.match(p) == 20
    t.set_kv_dtype(torch.float32)
    out = generate(t, None, [p], max_new_tokens=3, prefix_cache=tree)[0]
    assert out.cached_prompt_tokens == 0  # the bf16 entries are gone, not copied into an fp32 cache
    assert {kv[0].dtype for node in tree._nodes() for kv in node.kv if kv is not None} == {torch.float32}


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_prefill_state_bit_identical_in_chunks_alone_and_after_a_hit(target, chunk):
    """test_chunked.py's invariance on the bf16 policy (bf16 linears, bf16 KV, bf16 attention where head_dim
    allows): every row's keys, values, final hidden state and taps are the same bits whole, in chunks, alone,
    beside others, and continuing from a prefix-cache hit."""
    from test_chunked import _fill_state, _same

    prompts = token_prompts(4, target.vocab_size, seed=chunk, lo=1, hi=70)
    prompts[0] = token_prompts(1, target.vocab_size, seed=99, lo=90, hi=90)[0]
    whole, _, _ = _fill_state(target, prompts, 0)
    chunked, _, n = _fill_state(target, prompts, chunk)
    assert n >= 2
    for b in range(len(prompts)):
        assert _same(chunked[b], whole[b]), f"row {b} differs with chunk {chunk}"
        alone, _, _ = _fill_state(target, [prompts[b]], chunk)
        assert _same(alone[0], whole[b]), f"row {b} alone differs with chunk {chunk}"
    tree = PrefixCache()
    tree.bind(target, target.new_cache(1, 1), 2)
    _fill_state(target, [prompts[0][:40]], chunk, tree)
    hit, served, _ = _fill_state(target, [prompts[0]], chunk, tree)
    assert served == [40] and _same(hit[0], whole[0])


def test_greedy_and_sampled_identical_for_any_chunk(target):
    from test_chunked import _long_mix

    prompts = _long_mix(target.vocab_size, seed=3)
    for kw in (dict(), dict(temperature=0.9, top_p=0.95, seed=list(range(len(prompts))))):
        whole = generate(target, None, prompts, max_new_tokens=12, batch_size=3, **kw)
        for chunk in (1, 7):
            cut = generate(target, None, prompts, max_new_tokens=12, batch_size=3, prefill_chunk=chunk, **kw)
            assert [o.token_ids for o in cut] == [o.token_ids for o in whole]
