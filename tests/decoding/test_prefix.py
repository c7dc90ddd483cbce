"""Prefix cache: a row's output never depends on what was cached; shared prefixes are computed once."""

from __future__ import annotations

import pytest
import torch
from helpers import token_prompts

from dspine import generate
from dspine.decoding.cost import CostModel
from dspine.decoding.prefix import PrefixCache, shared_prefixes

CHEAP = CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=0.05)


@pytest.fixture(params=["llama", "qwen3", "hybrid"])
def target(request, llama_target, qwen3_target, hybrid_target):
    return {"llama": llama_target, "qwen3": qwen3_target, "hybrid": hybrid_target}[request.param]


def _prefix_heavy(vocab: int, seed: int) -> list[list[int]]:
    """Rows behind one shared 'system prompt', two rows sharing a longer template, siblings (identical
    prompts), a prompt that is a prefix of another, and unrelated rows."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, vocab, (37,), generator=g).tolist()
    template = system + torch.randint(1, vocab, (21,), generator=g).tolist()
    users = token_prompts(5, vocab, seed=seed, lo=3, hi=12)
    out = [system + u for u in users[:3]]
    out += [template + users[3], template + users[4]]
    out += [out[0], out[0], out[3]]  # siblings
    out += [template]  # a prefix of two other prompts
    out += token_prompts(2, vocab, seed=seed + 1, lo=5, hi=30)  # nothing shared
    return out


def _unique_tokens(prompts: list[list[int]]) -> int:
    """Distinct prefixes = nodes of a trie over the prompts = the tokens a perfect prefix cache computes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_output_identical_with_and_without_sharing(target, batch):
    prompts = _prefix_heavy(target.vocab_size, seed=batch)
    off = generate(target, None, prompts, max_new_tokens=10, batch_size=batch)
    tree = PrefixCache()
    on = generate(target, None, prompts, max_new_tokens=10, batch_size=batch, prefix_cache=tree)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert all(o.cached_prompt_tokens == 0 for o in off)
    computed = sum(o.prompt_tokens - o.cached_prompt_tokens for o in on)
    assert computed == tree.computed < sum(map(len, prompts)) / 2
    # a second pass over the same prompts computes nothing at all and still writes the same
    again = generate(target, None, prompts, max_new_tokens=10, batch_size=batch, prefix_cache=tree)
    assert [o.token_ids for o in again] == [o.token_ids for o in off]
    assert [o.cached_prompt_tokens for o in again] == [len(p) for p in prompts]


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_computed_equals_unique_tokens(target, batch):
    """Rows behind one system prompt and the siblings of a prompt: every prompt token is computed once, whatever
    the admission order (one row at a time: only the tree shares; all together: only the waves of shared
    prefixes). A hybrid computes the system prompt twice at one row at a time: once inside the first row, and
    once more to put its recurrent state into the tree."""
    g = torch.Generator().manual_seed(batch)
    system = torch.randint(1, target.vocab_size, (40,), generator=g).tolist()
    users = [[1 + (i * 7 + j * 3) % (target.vocab_size - 1) for j in range(5 + i % 4)] for i in range(8)]
    prompts = [system + u for u in users] + [system + users[0]] * 3
    tree = PrefixCache()
    on = generate(target, None, prompts, max_new_tokens=3, batch_size=batch, prefix_cache=tree)
    computed = sum(o.prompt_tokens - o.cached_prompt_tokens for o in on)
    twice = 40 if batch == 1 and getattr(target, "layer_types", None) else 0
    assert computed == tree.computed == _unique_tokens(prompts) + twice
    assert [o.token_ids for o in on] == [o.token_ids for o in generate(target, None, prompts, max_new_tokens=3)]


@pytest.mark.parametrize("proposers", ["dspine", "auto"])
def test_speculative_with_draft_context_from_the_cache(target, proposers):
    """The draft's context (the target's taps over the prompt) comes from the tree on a hit: greedy speculative
    output stays the plain output, and the draft proposes the same as without sharing."""
    from test_generate import _random_dspine

    prompts = _prefix_heavy(target.vocab_size, seed=5)
    plain = generate(target, None, prompts, max_new_tokens=12)
    d = _random_dspine(target, 4, seed=3)
    kw = dict(max_new_tokens=12, verify="cost", cost=CHEAP, prices="static", proposers=proposers, batch_size=3)
    off = generate(target, d, prompts, **kw)
    on = generate(target, d, prompts, prefix_cache=PrefixCache(), **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in plain]
    assert [o.stats.accept_histogram for o in on] == [o.stats.accept_histogram for o in off]


def test_sampled_output_identical_with_and_without_sharing(target):
    """Keyed randomness: a sampled row's tokens depend on its state and seed only, so the cache changes none."""
    prompts = _prefix_heavy(target.vocab_size, seed=9)
    seeds = list(range(len(prompts)))
    kw = dict(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=seeds, batch_size=4)
    off = generate(target, None, prompts, **kw)
    on = generate(target, None, prompts, prefix_cache=PrefixCache(), **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    spec = generate(target, None, prompts, prefix_cache=PrefixCache(), verify="cost", cost=CHEAP,
                    proposers="suffix", **kw)
    assert [o.token_ids for o in spec] == [o.token_ids for o in off]


def test_siblings_share_one_prefill(target):
    """N samples of one prompt admitted together: the prompt is computed once, credited to the first sample."""
    prompt = token_prompts(1, target.vocab_size, seed=3, lo=30, hi=31)[0]
    tree = PrefixCache()
    outs = generate(target, None, [prompt] * 4, max_new_tokens=6, temperature=0.8, seed=[1, 2, 3, 4],
                    prefix_cache=tree)
    assert [o.cached_prompt_tokens for o in outs] == [0, 30, 30, 30]
    assert tree.computed == 30 and tree.served == 30 * 4  # the leader's copy comes from the tree too
    alone = [generate(target, None, [prompt], max_new_tokens=6, temperature=0.8, seed=s)[0] for s in (1, 2, 3, 4)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]


def test_hybrid_hits_only_where_a_prefill_ended(hybrid_target):
    """A GDN layer's state exists only at the end of a prefill: a prompt extending a cached one is served up to
    that end, one diverging inside it is served nothing (the attention layers' keys alone are not enough)."""
    base = token_prompts(1, hybrid_target.vocab_size, seed=4, lo=20, hi=21)[0]
    tree = PrefixCache()
    generate(hybrid_target, None, [base], max_new_tokens=2, prefix_cache=tree)
    longer = base + [5, 6, 7]
    diverging = base[:10] + [(base[10] + 1) % hybrid_target.vocab_size] + base[11:]
    outs = generate(hybrid_target, None, [longer, diverging], max_new_tokens=4, batch_size=1, prefix_cache=tree)
    assert [o.cached_prompt_tokens for o in outs] == [20, 0]
    assert [o.token_ids for o in outs] == [o.token_ids for o in generate(hybrid_target, None, [longer, diverging],
                                                                          max_new_tokens=4)]


def test_dense_hits_inside_a_node(llama_target):
    """Keys and values are per position: a prompt diverging inside a cached one is served up to the divergence,
    and a prompt that is a strict prefix of a cached one is served all but its last token."""
    base = token_prompts(1, llama_target.vocab_size, seed=4, lo=20, hi=21)[0]
    tree = PrefixCache()
    generate(llama_target, None, [base], max_new_tokens=2, prefix_cache=tree)
    diverging = base[:10] + [(base[10] + 1) % llama_target.vocab_size] + base[11:]
    outs = generate(llama_target, None, [diverging, base[:15]], max_new_tokens=4, batch_size=1, prefix_cache=tree)
    assert [o.cached_prompt_tokens for o in outs] == [10, 14]


def test_cap_bounds_memory_and_evicts_least_recently_used(llama_target):
    prompts = token_prompts(6, llama_target.vocab_size, seed=8, lo=30, hi=31)
    probe = PrefixCache()
    generate(llama_target, None, prompts[:1], max_new_tokens=1, prefix_cache=probe)
    one = probe.nbytes  # one 30-token prompt's keys, values and final hidden state
    tree = PrefixCache(cap_bytes=int(2.5 * one))
    off = generate(llama_target, None, prompts, max_new_tokens=4, batch_size=1)
    on = generate(llama_target, None, prompts, max_new_tokens=4, batch_size=1, prefix_cache=tree)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert tree.peak_bytes <= tree.cap_bytes and len(tree) == 2
    held = [tree.match(p) == len(p) for p in prompts]
    assert held == [False] * 4 + [True] * 2
    # a lookup refreshes: the older of the two survives the next insertion, the other goes
    tree.lookup(prompts[-2])
    generate(llama_target, None, prompts[:1], max_new_tokens=1, prefix_cache=tree)
    assert [tree.match(p) == len(p) for p in prompts] == [True] + [False] * 3 + [True, False]
    off_tree = PrefixCache(cap_bytes=0)
    outs = generate(llama_target, None, prompts[:2] * 2, max_new_tokens=2, prefix_cache=off_tree)
    assert all(o.cached_prompt_tokens == 0 for o in outs) and off_tree.nbytes == 0


def test_another_layout_empties_the_tree(llama_target, qwen3_target):
    tree = PrefixCache()
    p = token_prompts(1, 200, seed=1, lo=20, hi=21)[0]
    generate(llama_target, None, [p], max_new_tokens=1, prefix_cache=tree)
    assert tree.match(p) == 20
    generate(qwen3_target, None, [p[:5]], max_new_tokens=1, prefix_cache=tree)
    assert tree.match(p) == 5  # only the new model's entry


def test_shared_prefixes_come_in_waves():
    a = list(range(100, 140))
    prompts = [a + [1, 2], a + [1, 3], a[:20] + [9], a[:20] + [8], [7] * 3, [7] * 3, [5, 6]]
    tree = PrefixCache()
    waves = shared_prefixes(prompts, tree)
    assert [set(w) for w in waves] == [{tuple(a[:20]), (7, 7, 7)}, {tuple(a + [1])}]
    assert [set(w) for w in shared_prefixes(prompts, tree, min_len=30)] == [{(7, 7, 7), tuple(a + [1])}]
