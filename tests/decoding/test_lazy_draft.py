"""The draft read on first use (``dspine.draft.lazy``, issue 44 item 3): a stream that retires it before its first
prefill never reads its weights, one that keeps it reads them once and decodes exactly as the eagerly loaded draft
does, a released handle reads them again, and a broken draft directory still fails before any stream (what needs no
tensor) or in one line at the first use (what does)."""

from __future__ import annotations

import json
import threading
import time
import weakref

import pytest
from helpers import random_dspine, token_prompts
from safetensors.torch import load_file, save_file
from test_auto_quiet import CAL, _dear

from dspine import generate, load_draft
from dspine.decoding.decode import decode_stream
from dspine.decoding.prices import StaticPrices
from dspine.decoding.sampling import SamplingParams
from dspine.draft.lazy import LazyDraft
from dspine.models.checkpoint import ModelLoadError

KW = dict(max_new_tokens=24, temperature=0.0)


def _stream(target, draft, prompts, prices, decisions=None):
    out = decode_stream(target, draft, [(p, SamplingParams(**KW)) for p in prompts], 4, verify="cost", cost=CAL,
                        proposers="auto", prices=prices, decisions=decisions, release_retired=True)
    return [(o.token_ids, o.stats.dspine_steps, o.stats.verify_steps) for _, o in sorted(out)]


@pytest.fixture
def saved(llama_target, tmp_path):
    draft = random_dspine(llama_target, 4, seed=6)
    draft.save(tmp_path / "d")
    return tmp_path / "d"


def test_config_now_weights_at_first_use(llama_target, saved):
    lazy = LazyDraft(saved, load_draft)
    eager = load_draft(saved)
    assert lazy.loads == 0 and not lazy.loaded  # nothing read yet
    assert lazy.block_size == eager.block_size and lazy.target_layer_ids == eager.target_layer_ids
    assert lazy.confidence_enabled == eager.confidence_enabled and lazy.config == eager.config
    assert lazy.hidden_size == eager.hidden_size and lazy.loads == 1  # anything else is the draft's: read once
    lazy.hidden_size  # noqa: B018
    assert lazy.loads == 1


def test_a_draft_retired_before_the_prefill_is_never_read(llama_target, saved):
    """Under prices where the draft cannot pay at the rows admitted, the stream runs without reading a tensor of
    it, and its tokens are plain decoding's; under prices where it may pay it is read once, and the stream is the
    eagerly loaded draft's round for round; released (as a retiring stream leaves it), the next stream reads it
    again and decodes the same."""
    prompts = token_prompts(4, llama_target.vocab_size, seed=45)
    plain = _stream(llama_target, None, prompts, _dear(llama_target))
    lazy = LazyDraft(saved, load_draft)
    decisions: dict = {}
    assert _stream(llama_target, lazy, prompts, _dear(llama_target), decisions) == plain
    assert decisions["dspine"]["why"].startswith("retired before the first prefill"), decisions["dspine"]
    assert lazy.loads == 0 and not lazy.loaded

    paying = StaticPrices(CAL, packed=llama_target.packs)
    want = _stream(llama_target, load_draft(saved), prompts, paying)
    assert sum(d for _, d, _ in want) > 0  # the draft ran: the comparison below compares its proposals
    assert _stream(llama_target, lazy, prompts, paying) == want
    assert lazy.loads == 1
    held = weakref.ref(lazy.model())
    lazy.release()
    assert not lazy.loaded and held() is None  # its weights went with it, at once (no garbage collection)
    assert _stream(llama_target, lazy, prompts, paying) == want
    assert lazy.loads == 2


def test_a_release_never_pulls_the_draft_from_under_another_stream(llama_target, saved):
    """Two streams of one engine share the handle: one retires the draft (``release``) while the other holds it
    mid-proposal. The holder's draft stays whole (its tokens are the eagerly loaded draft's), the handle forgets it
    (the next use reads it again), and the weights go when the holder lets go."""
    lazy = LazyDraft(saved, load_draft)
    prompts = token_prompts(3, llama_target.vocab_size, seed=46)
    want = [o.token_ids for o in generate(llama_target, load_draft(saved), prompts, max_new_tokens=12)]
    held = lazy.model()  # what a stream mid-proposal holds (``lazy.propose`` is the loaded draft's method)
    lazy.release()  # another stream retires it
    assert not any(t.is_meta for t in [*held.parameters(), *held.buffers()])
    assert [o.token_ids for o in generate(llama_target, held, prompts, max_new_tokens=12)] == want
    gone = weakref.ref(held)
    del held
    assert gone() is None and not lazy.loaded
    lazy.block_size, lazy.hidden_size  # noqa: B018
    assert lazy.loads == 2


def test_two_streams_asking_at_once_read_the_draft_once(saved):
    """The handle's load is locked: two threads asking for the draft while it is being read get one draft."""
    opened = []

    def slow_open(path):
        time.sleep(0.3)  # both threads are inside ``model()`` while the first read is under way
        opened.append(load_draft(path))
        return opened[-1]

    lazy = LazyDraft(saved, slow_open)
    got = []
    threads = [threading.Thread(target=lambda: got.append(lazy.model())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lazy.loads == 1 and len(opened) == 1 and got[0] is got[1]


def test_a_broken_draft_fails_before_the_stream_or_in_one_line_at_first_use(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["dspine_config"]["confidence_trained"] = True  # a trained head promised, none saved: refused at once
    tensors = load_file(saved / "model.safetensors")
    heads = {k: v for k, v in tensors.items() if k.startswith("confidence_head.")}
    save_file({k: v for k, v in tensors.items() if k not in heads}, str(saved / "model.safetensors"))
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="confidence_trained is true"):
        LazyDraft(saved, load_draft)
    (saved / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LazyDraft(saved, load_draft)
    # what only the tensors can tell (a weight missing) is found when the draft is first needed, in one line
    cfg["dspine_config"]["confidence_trained"] = False
    (saved / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, str(saved / "model.safetensors"))
    lazy = LazyDraft(saved, load_draft)
    with pytest.raises(RuntimeError, match=r"cannot load the draft .*missing tensor 'norm\.weight'"):
        lazy.new_cache(1, 8)
