"""Confidence-head fitting (dspine/training/confidence.py): labels against the inference path, fit quality, round trip,
lossless decoding with the fitted head, and the ``dspine fit-confidence`` command."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # noqa: F401  (the test extra: missing, the file must fail, not skip)
from helpers import TINY_HIDDEN as H
from helpers import TINY_VOCAB as V
from helpers import TRAIN_BS as BS
from helpers import TRAIN_DRAFT_KW as DRAFT_KW
from helpers import load_train_target, randomize_train_draft, save_train_qwen3

from dspine import generate
from dspine.draft.io import init_draft, load_draft
from dspine.models.registry import load_target
from dspine.training.confidence import confidence_data, fit_confidence, fit_confidence_on_examples
from dspine.training.train import capture, make_example

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):  # tests/training/test_train.py's tiny peaky Qwen3 target, one instance per module
    return save_train_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_train_target(target_dir)


def _random_draft(target, seed: int = 1):
    return randomize_train_draft(init_draft(target, **DRAFT_KW, seed=seed), seed).eval()


def _greedy_example(target, prompt_len: int = 8, n: int = 40, seed: int = 0):
    """A target-regenerated sequence (greedy), as the real data is: the true predecessor is the target's token."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V - 1, (prompt_len,), generator=g).tolist()
    out = generate(target, None, [prompt], max_new_tokens=n)[0]
    return make_example(prompt, out.token_ids)


def test_labels_match_the_inference_path(target):
    """y(slot) = sum min(q, p) with q the refined candidate distribution that ``propose`` samples from (T=1)
    after a true prefix, and p the target's next-token distribution; greedy labels are argmax agreement."""
    draft = _random_draft(target)
    ex = _greedy_example(target)
    cap = capture(target, ex.ids, draft.target_layer_ids)
    data = confidence_data(draft, target, [(ex, cap)], anchors_per_seq=1000, seed=0)
    greedy = confidence_data(draft, target, [(ex, cap)], anchors_per_seq=1000, seed=0, greedy=True)
    assert set(greedy.y.unique().tolist()) <= {0.0, 1.0} and torch.equal(greedy.slot, data.slot)
    # every supervised anchor is used; rebuild the labels of one anchor from extend_context + backbone
    a = int(ex.loss_mask.nonzero()[0])  # the first supervised anchor: its block is entirely supervised
    with torch.no_grad():
        cache = draft.new_cache(1, 128)
        draft.extend_context(cache, cap.taps[None, :a])
        ref = draft.backbone(cache, ex.ids[a : a + 1], target)
        full = target.forward(ex.ids[None], target.new_cache(1, len(ex.ids)))
        p_all = torch.softmax(target.logits(full.hidden)[0].float(), dim=-1)  # [T, V]
    want, want_greedy = [], []
    for slot in range(1, BS):
        cand = ref.logits[0, slot - 1].topk(draft.top_k).indices
        refined = draft.refine_slots(ref, ex.ids[None, a : a + BS - 1])[0, slot - 1]
        q = torch.softmax((target.head_weight[cand] @ refined).float(), dim=-1)
        p = p_all[a + slot - 1]
        want.append(float(torch.minimum(q, p[cand]).sum().detach()))
        want_greedy.append(float(cand[q.argmax()] == p.argmax()))
    first = slice(0, BS - 1)  # anchors are sorted, so the first anchor's slots come first
    assert data.slot[first].tolist() == list(range(1, BS))
    torch.testing.assert_close(data.y[first], torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert greedy.y[first].tolist() == want_greedy
    assert 0.0 < float(data.y.min()) and float(data.y.max()) <= 1.0


def test_fit_recovers_a_logistic_rule_and_round_trips(target, tmp_path):
    """On features with a known logistic rule, the fit is close to the rule's own BCE and far below the constant
    predictor's; only the head changes, and the fitted head survives save/load."""
    from dspine.training.confidence import ConfidenceData

    draft = _random_draft(target)
    assert not draft.confidence_enabled
    g = torch.Generator().manual_seed(0)
    M, r = 4000, draft.transfer_rank
    refined, code = torch.randn(M, H, generator=g), torch.randn(M, r, generator=g)
    w_true = torch.randn(H + r, generator=g) * 0.3
    y = torch.sigmoid(torch.cat([refined, code], -1) @ w_true - 1.0)  # soft labels from the rule
    data = ConfidenceData(refined, code, y, torch.ones(M, dtype=torch.long))
    before = {n: p.clone() for n, p in draft.named_parameters() if not n.startswith("confidence_head")}
    r_ = fit_confidence(draft, data, data, log=lambda s: None)["train"]
    ideal = float(torch.nn.functional.binary_cross_entropy(y, y))
    assert r_["bce"] < ideal + 0.02 and r_["bce"] < r_["bce_constant"] - 0.1, r_
    assert abs(r_["mean_pred"] - r_["mean_label"]) < 0.02, r_
    assert draft.confidence_enabled
    for n, p in draft.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n  # the backbone is frozen
    draft.save(tmp_path / "d")
    back = load_draft(tmp_path / "d")
    assert back.confidence_enabled
    torch.testing.assert_close(back.confidence_head.proj.weight, draft.confidence_head.proj.weight)


def test_fitted_head_decodes_losslessly_and_stops_early(target):
    draft = _random_draft(target)
    exs = [_greedy_example(target, seed=s) for s in range(3)]
    fit_confidence_on_examples(draft, target, exs, sequences=3, eval_fraction=0.34, anchors_per_seq=64,
                               log=lambda s: None)  # fmt: skip
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    plain = generate(target, None, prompts, max_new_tokens=20)
    full = generate(target, draft, prompts, max_new_tokens=20)
    cut = generate(target, draft, prompts, max_new_tokens=20, dynamic_threshold=0.5)  # any threshold is exact
    for a, b, c in zip(plain, full, cut):
        assert a.token_ids == b.token_ids == c.token_ids
    assert sum(o.stats.draft_tokens_proposed for o in cut) < sum(o.stats.draft_tokens_proposed for o in full)


def test_cli_fit_confidence(target_dir, tmp_path):
    from click.testing import CliRunner

    from dspine.cli import main

    target = load_target(target_dir)
    d = _random_draft(target)
    d.save(tmp_path / "draft")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [1, 2, 3, s], "response_ids": list(range(10 + s, 40 + s))})
                            + "\n" for s in range(4)))  # fmt: skip
    out = tmp_path / "fitted"
    r = CliRunner().invoke(main, ["fit-confidence", str(target_dir), str(data), str(tmp_path / "draft"),
                                  "--out", str(out), "--sequences", "4", "--anchors", "8"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert load_draft(out).confidence_enabled and not load_draft(tmp_path / "draft").confidence_enabled
    report = json.loads((out / "confidence.json").read_text())
    assert report["sequences"] == 4 and report["eval_sequences"] == 1 and report["train"]["n"] > 0
    bad = CliRunner().invoke(main, ["fit-confidence", str(target_dir), str(data), str(tmp_path / "nope")])
    assert bad.exit_code != 0 and "nope" in bad.output
