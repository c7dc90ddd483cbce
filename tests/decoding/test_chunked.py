"""Chunked prefill: a row ends bit-identical however its prompt was cut, and rows in flight decode between chunks.

The state tests compare what prefill leaves (keys/values, GDN state, final hidden state, the draft's taps) bit for
bit; the decoding tests compare tokens with whole-prompt prefill for chunk sizes 1, 5 and 64 (plain, the DSpine
draft, suffix proposals, the prefix cache; greedy and sampled); the interleaving test reads a log of the target's
forwards and the rows' commits, never a clock. Dense targets only: a hybrid prefills whole prompts
(``prefill.chunking_exact`` says why), which the last tests check.
"""

from __future__ import annotations

import pytest
import torch
from helpers import token_prompts

from dspine import generate
from dspine.decoding import rows as rows_mod
from dspine.decoding.config import StreamConfig
from dspine.decoding.cost import CostModel
from dspine.decoding.prefill import Pace, chunking_exact, fill
from dspine.decoding.prefix import PrefixCache
from dspine.models.cache import KVCache, SSMState

CHEAP = CostModel.flat(target_s=1.0, per_token_s=0.01, draft_s=0.05)
CHUNKS = [1, 5, 64]


@pytest.fixture(params=["llama", "qwen3"])
def target(request, llama_target, qwen3_target):
    """The dense targets: where chunking is exact (``chunking_exact``). A hybrid prefills whole prompts."""
    return {"llama": llama_target, "qwen3": qwen3_target}[request.param]


def _run(gen):
    """Drive a prefill generator to its end; its return value."""
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


def _fill_state(target, prompts, chunk, tree=None):
    """What ``prefill.fill`` leaves for ``prompts``: per row (KV up to its length, GDN state, final hidden, taps)."""
    cfg = StreamConfig(None, 1, None, "fixed", None, len(prompts), (0, 1), prefix=tree, chunk=chunk)
    pace = Pace()
    cache, last, taps, served = _run(fill(target, [list(p) for p in prompts], cfg, max(map(len, prompts)) + 4,
                                           pace))
    rows = []
    for b, p in enumerate(prompts):
        n = len(p)
        assert int(cache.lengths[b]) == n
        kv = [(x.k[b, :, :n].clone(), x.v[b, :, :n].clone()) for x in cache.layers if isinstance(x, KVCache)]
        ssm = [(x.conv[b].clone(), x.rec[b].clone()) for x in cache.layers if isinstance(x, SSMState)]
        rows.append((kv, ssm, last[b].clone(), taps[b, :n].clone()))
    return rows, served, pace.forwards


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def test_chunking_is_exact_on_our_kernels_for_dense_targets(target, llama_dir, hybrid_target):
    from dspine import load_target

    assert chunking_exact(target)  # the fixtures run our kernels
    assert not chunking_exact(load_target(llama_dir, kernels=False))
    assert hybrid_target.kernel.startswith("dspine-") and not chunking_exact(hybrid_target)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_state_bit_identical_in_chunks_alone_and_beside_others(target, chunk):
    """Keys, values, GDN state, final hidden state and taps of every row: equal for whole prompts, chunks of
    any size, a row prefilled alone or beside others."""
    prompts = token_prompts(4, target.vocab_size, seed=chunk, lo=1, hi=70)
    prompts[0] = token_prompts(1, target.vocab_size, seed=99, lo=90, hi=90)[0]  # several chunks for every size
    whole, _, n_whole = _fill_state(target, prompts, 0)
    chunked, _, n_chunked = _fill_state(target, prompts, chunk)
    assert n_whole == 1 and n_chunked >= 2  # it really was cut
    for b in range(len(prompts)):
        assert _same(chunked[b], whole[b]), f"row {b} differs with chunk {chunk}"
        alone, _, _ = _fill_state(target, [prompts[b]], chunk)
        assert _same(alone[0], whole[b]), f"row {b} alone differs with chunk {chunk}"


def test_prefill_state_bit_identical_after_a_prefix_cache_hit(target):
    """A row continuing in chunks from a prefix-cache hit holds what a whole-prompt prefill from scratch holds."""
    base = token_prompts(1, target.vocab_size, seed=7, lo=40, hi=40)[0]
    longer = base + token_prompts(1, target.vocab_size, seed=8, lo=33, hi=33)[0]
    scratch, _, _ = _fill_state(target, [longer], 0)
    tree = PrefixCache()
    tree.bind(target, target.new_cache(1, 1), 2)  # as decode_stream does
    _fill_state(target, [base], 5, tree)
    hit, served, _ = _fill_state(target, [longer], 5, tree)
    assert served == [40]
    assert _same(hit[0], scratch[0])


def _long_mix(vocab: int, seed: int) -> list[list[int]]:
    """Short and long prompts (long ones span several chunks), in an order where long ones join running rows."""
    short = token_prompts(5, vocab, seed=seed, lo=2, hi=12)
    long = token_prompts(3, vocab, seed=seed + 1, lo=60, hi=110)
    return [short[0], long[0], short[1], short[2], long[1], short[3], long[2], short[4]]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_plain_greedy_and_sampled_identical_for_any_chunk(target, chunk):
    prompts = _long_mix(target.vocab_size, seed=chunk)
    for kw in (dict(), dict(temperature=0.9, top_p=0.95, seed=list(range(len(prompts))))):
        whole = generate(target, None, prompts, max_new_tokens=12, batch_size=3, **kw)
        cut = generate(target, None, prompts, max_new_tokens=12, batch_size=3, prefill_chunk=chunk, **kw)
        assert [o.token_ids for o in cut] == [o.token_ids for o in whole]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("proposers", ["dspine", "auto"])
def test_speculative_identical_for_any_chunk(target, chunk, proposers):
    """The draft's context is the target's taps over the prompt: chunked, it ends identical, so the draft proposes
    the same (same accept histograms with the draft alone), greedy output stays the plain output, and sampled rows
    keep their tokens."""
    from test_generate import _random_dspine

    prompts = _long_mix(target.vocab_size, seed=3)
    plain = generate(target, None, prompts, max_new_tokens=12)
    d = _random_dspine(target, 4, seed=3)
    for sampled in (False, True):
        kw = dict(max_new_tokens=12, verify="cost", cost=CHEAP, prices="static", proposers=proposers, batch_size=3)
        if sampled:
            kw.update(temperature=0.8, seed=list(range(len(prompts))))
        whole = generate(target, d, prompts, **kw)
        cut = generate(target, d, prompts, prefill_chunk=chunk, **kw)
        assert [o.token_ids for o in cut] == [o.token_ids for o in whole]
        if proposers == "dspine":  # under auto a row's suffix proposals also read the rows finished before it,
            # which chunks change (the rows in flight finish at other moments): its histogram may differ
            assert [o.stats.accept_histogram for o in cut] == [o.stats.accept_histogram for o in whole]
        if not sampled:
            assert [o.token_ids for o in cut] == [o.token_ids for o in plain]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_suffix_proposals_identical_for_any_chunk(target, chunk):
    prompts = _long_mix(target.vocab_size, seed=11)
    prompts += [p[:] for p in prompts[:3]]  # repeated text: suffix matches find something to propose
    for kw in (dict(), dict(temperature=0.9, seed=list(range(len(prompts))))):
        whole = generate(target, None, prompts, max_new_tokens=16, batch_size=4, verify="cost", cost=CHEAP,
                         prices="static", proposers="suffix", **kw)
        cut = generate(target, None, prompts, max_new_tokens=16, batch_size=4, verify="cost", cost=CHEAP,
                       prices="static", proposers="suffix", prefill_chunk=chunk, **kw)
        assert [o.token_ids for o in cut] == [o.token_ids for o in whole]
    assert sum(o.stats.suffix_steps for o in cut) > 0


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_prefix_cache_sharing_and_credit_with_chunks(target, chunk, batch):
    """Rows behind one system prompt, siblings and a long unrelated prompt, with the prefix cache: the tokens are
    the whole-prompt (and cache-off) tokens; Σ (prompt − cached) is what the tree computed; a dense target computes
    every distinct prompt prefix once, as without chunks. Rows admitted in one group (batch 16) get the same
    per-row credit as with whole prompts; with fewer slots, chunks change which rows are admitted together (the
    rows in flight finish at other moments), so the credit may sit on another row of a shared prefix."""
    from test_prefix import _unique_tokens

    g = torch.Generator().manual_seed(batch)
    system = torch.randint(1, target.vocab_size, (40,), generator=g).tolist()
    users = [[1 + (i * 7 + j * 3) % (target.vocab_size - 1) for j in range(5 + i % 4)] for i in range(6)]
    prompts = [system + u for u in users] + [system + users[0]] * 2
    prompts.insert(2, token_prompts(1, target.vocab_size, seed=5, lo=95, hi=95)[0])
    whole_tree, cut_tree = PrefixCache(), PrefixCache()
    kw = dict(max_new_tokens=8, batch_size=batch, temperature=0.7, seed=list(range(len(prompts))))
    whole = generate(target, None, prompts, prefix_cache=whole_tree, **kw)
    cut = generate(target, None, prompts, prefix_cache=cut_tree, prefill_chunk=chunk, **kw)
    off = generate(target, None, prompts, **kw)
    assert [o.token_ids for o in cut] == [o.token_ids for o in whole] == [o.token_ids for o in off]
    assert cut_tree.computed == sum(o.prompt_tokens - o.cached_prompt_tokens for o in cut)
    assert cut_tree.computed == whole_tree.computed == _unique_tokens(prompts)
    if batch >= len(prompts):
        assert [o.cached_prompt_tokens for o in cut] == [o.cached_prompt_tokens for o in whole]


class _Log:
    """Records, in order, every target forward (its batch rows and tokens per row) and every commit of tokens
    to a row (``Row.push``): the interleaving of prefill and decoding, without a clock."""

    def __init__(self, monkeypatch, target):
        self.events: list[tuple] = []
        forward, push = target.forward, rows_mod.Row.push

        def rec_forward(ids, cache, *a, **kw):
            self.events.append(("forward", ids.shape[0], ids.shape[1]))
            return forward(ids, cache, *a, **kw)

        def rec_push(row, new, logprobs=None):
            kept = push(row, new, logprobs)
            self.events.append(("push", row.index, kept))
            return kept

        monkeypatch.setattr(target, "forward", rec_forward)
        monkeypatch.setattr(rows_mod.Row, "push", rec_push)


def _committed_during_prefill(events, newcomer: int) -> tuple[int, dict[int, int]]:
    """The newcomer's prefill forwards (the only one-row forwards: from its first one to its first token) and the
    tokens each other row committed in between."""
    start = next(i for i, e in enumerate(events) if e[0] == "forward" and e[1] == 1)
    end = next(i for i, e in enumerate(events) if e[0] == "push" and e[1] == newcomer)
    window = events[start:end]
    forwards = sum(1 for e in window if e[0] == "forward" and e[1] == 1)
    got: dict[int, int] = {}
    for e in window:
        if e[0] == "push":
            got[e[1]] = got.get(e[1], 0) + e[2]
    return forwards, got


@pytest.mark.parametrize("chunk", [0, 16])
def test_rows_in_flight_commit_tokens_while_a_long_prompt_is_prefilled(llama_target, monkeypatch, chunk):
    """Batch 3: two short rows decode, a third finishes at its first token, and a 200-token newcomer takes its
    slot. Chunked, the two rows commit a token per round between the newcomer's chunks (at least one per chunk
    after the first); whole, they wait for all of it."""
    v = llama_target.vocab_size
    shorts = token_prompts(3, v, seed=1, lo=5, hi=5)  # one forward of 3 x 5 tokens, chunked or whole
    long = token_prompts(1, v, seed=2, lo=200, hi=200)[0]
    n_new = [60, 60, 1, 4]
    log = _Log(monkeypatch, llama_target)
    outs = generate(llama_target, None, [*shorts, long], max_new_tokens=n_new, batch_size=3, prefill_chunk=chunk)
    forwards, got = _committed_during_prefill(log.events, newcomer=3)
    assert [len(o.token_ids) for o in outs] == n_new
    if chunk:
        assert forwards == 200 // 16 + 1  # 12 chunks of 16 tokens and one of 8
        assert got.get(0, 0) >= forwards - 1 and got.get(1, 0) >= forwards - 1
    else:
        assert forwards == 1 and got == {}
    monkeypatch.undo()
    whole = generate(llama_target, None, [*shorts, long], max_new_tokens=n_new, batch_size=3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]


def test_a_forward_holds_at_most_the_chunk(llama_target, monkeypatch):
    """Activation memory is bounded: no prefill forward holds more than ``prefill_chunk`` tokens, padding included
    (when the chunk is at least the rows being prefilled). One new token per row: every forward is a prefill."""
    prompts = token_prompts(7, llama_target.vocab_size, seed=4, lo=20, hi=90)
    log = _Log(monkeypatch, llama_target)
    generate(llama_target, None, prompts, max_new_tokens=1, batch_size=3, prefill_chunk=24)
    sizes = [e[1] * e[2] for e in log.events if e[0] == "forward"]
    assert max(sizes) <= 24 and sum(map(len, prompts)) <= sum(sizes) < sum(map(len, prompts)) + 7 * 24
    log.events.clear()
    generate(llama_target, None, prompts, max_new_tokens=1, batch_size=3)
    assert max(e[1] * e[2] for e in log.events if e[0] == "forward") > 24  # whole prompts: no bound


def test_kernels_off_prompts_stay_whole(llama_dir, monkeypatch):
    """With torch's GEMMs chunking is not known to be exact: prompts go whole whatever ``prefill_chunk`` says."""
    from dspine import load_target

    t = load_target(llama_dir, kernels=False)
    prompts = token_prompts(3, t.vocab_size, seed=6, lo=30, hi=40)
    log = _Log(monkeypatch, t)
    generate(t, None, prompts, max_new_tokens=2, prefill_chunk=4)
    assert [e for e in log.events if e[0] == "forward" and e[2] > 1] == [("forward", 3, max(map(len, prompts)))]


def test_hybrid_prompts_stay_whole(hybrid_target, monkeypatch):
    """A hybrid's GDN norms and gated attention are torch ops, not shape-invariant to the last bit: prompts go
    whole whatever ``prefill_chunk`` says (same forwards, same tokens)."""
    prompts = token_prompts(3, hybrid_target.vocab_size, seed=6, lo=30, hi=40)
    log = _Log(monkeypatch, hybrid_target)
    cut = generate(hybrid_target, None, prompts, max_new_tokens=3, prefill_chunk=4)
    events = list(log.events)
    log.events.clear()
    whole = generate(hybrid_target, None, prompts, max_new_tokens=3)
    assert events == log.events and [e for e in events if e[0] == "forward" and e[2] > 1] == [
        ("forward", 3, max(map(len, prompts)))]
    assert [o.token_ids for o in cut] == [o.token_ids for o in whole]


def test_negative_chunk_is_refused(llama_target):
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        generate(llama_target, None, [[1, 2, 3]], max_new_tokens=2, prefill_chunk=-1)
