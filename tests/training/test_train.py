"""DSpine trainer: mask parity with inference, schedules, anchors, a smoke run.

Tiny random Qwen3 target (hidden 64, vocab 256) saved by transformers; tiny drafts (2 layers, rank 16).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # noqa: F401  (the test extra: missing, the file must fail, not skip)
from helpers import TINY_VOCAB as V
from helpers import TRAIN_BS as BS
from helpers import TRAIN_DRAFT_KW as DRAFT_KW
from helpers import load_train_target, save_train_qwen3, train_stats
from helpers import randomize_train_draft as randomize

from dspine.draft.io import init_draft, load_draft
from dspine.draft.model import block_causal_mask
from dspine.training.train import (
    TrainConfig,
    alignment_beta,
    block_targets,
    capture,
    lr_factor,
    make_example,
    replacement_probability,
    sample_anchors,
    schedule_step,
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_train_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_train_target(target_dir)


def _sequence(T: int = 40, prompt: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (T,), generator=g)
    return make_example(ids[:prompt].tolist(), ids[prompt:].tolist())


@pytest.mark.parametrize("window", [None, 7])
def test_mask_parity_with_incremental_inference(target, window):
    """train_forward's block-causal (+SWA) mask gives the slot logits of extend_context + backbone."""
    draft = randomize(init_draft(target, **DRAFT_KW, sliding_window=window or 8192))
    if window is None:
        draft.windows = [None] * len(draft.layers)
    ex = _sequence()
    cap = capture(target, ex.ids, draft.target_layer_ids)
    anchors = torch.tensor([3, 11, 20, 33])
    block = torch.full((len(anchors), BS), draft.mask_token_id)
    block[:, 0] = ex.ids[anchors]
    with torch.no_grad():
        out = draft.train_forward(cap.taps, anchors, block, target)
        train_logits = target.logits(out.hidden[:, 1:])
        truth = ex.ids[(anchors[:, None] + torch.arange(BS)).clamp(max=len(ex.ids) - 1)]
        refined = draft.refine_slots(out, truth[:, :-1])
    for n, a in enumerate(anchors.tolist()):
        cache = draft.new_cache(1, 64)
        draft.extend_context(cache, cap.taps[None, :a])
        ref = draft.backbone(cache, ex.ids[a : a + 1], target)
        torch.testing.assert_close(train_logits[n], ref.logits[0], rtol=1e-4, atol=1e-4)
        for slot in (1, BS - 1):
            want = draft.refine_slots(ref, truth[n : n + 1, :-1])[:, slot - 1]
            torch.testing.assert_close(refined[n, slot - 1], want[0], rtol=1e-4, atol=1e-4)


def test_block_causal_mask_shape_and_rules():
    m = block_causal_mask(torch.tensor([4]), 10, 3, window=None)[0, 0]  # [bs, T + bs]
    assert m.shape == (3, 13)
    assert m[:, :4].all() and not m[:, 4:10].any()  # context strictly before the anchor
    assert torch.equal(m[:, 10:], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    w = block_causal_mask(torch.tensor([4]), 10, 3, window=3)[0, 0]
    assert w[0, :4].tolist() == [False, False, True, True]  # slot 0 at pos 4 sees 2, 3
    assert w[2, :4].tolist() == [False, False, False, False]  # slot 2 at pos 6 sees > 3 only


def test_schedules_match_formulas():
    S = 600
    assert replacement_probability(0, S) == 0.5
    assert replacement_probability(100, S) == 0.5  # = hold (1/6)
    assert replacement_probability(150, S) == pytest.approx(0.5 * (1 / 3 - 0.25) / (1 / 3 - 1 / 6))
    assert replacement_probability(200, S) == 0.0
    assert replacement_probability(599, S) == 0.0
    assert alignment_beta(0, 146) == 0.0
    assert alignment_beta(73, 146) == pytest.approx(0.25)
    assert alignment_beta(146, 146) == alignment_beta(1000, 146) == 0.5


def test_time_budget_paces_the_schedule():
    assert schedule_step(10, 100, elapsed_s=5.0, time_budget_s=None) == 10
    assert schedule_step(10, 100, elapsed_s=5.0, time_budget_s=100.0) == 10  # steps ahead of the clock
    assert schedule_step(10, 100, elapsed_s=50.0, time_budget_s=100.0) == 50  # clock ahead of the steps
    assert schedule_step(10, 100, elapsed_s=500.0, time_budget_s=100.0) == 100
    assert lr_factor(schedule_step(10, 100, 99.9, 100.0), 100, 4) < 1e-3  # lr ~0 when the budget ends


def test_anchors_respect_loss_mask():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        mask = torch.rand(60, generator=g) < 0.7
        a = sample_anchors(mask, 8, g)
        assert len(a) <= 8 and torch.equal(a, a.sort().values) and len(set(a.tolist())) == len(a)
        assert all(mask[i] and mask[i + 1] and i >= 1 for i in a.tolist())
    full = sample_anchors(torch.tensor([False] * 5 + [True] * 6), 100, g)
    assert full.tolist() == [5, 6, 7, 8, 9]  # every valid position when under the cap


def test_labels_cut_at_first_unsupervised_slot():
    ex = make_example([1, 2, 3], [4, 5, 6, 7, 8])
    ex.loss_mask[6] = False  # token 7 unsupervised
    labels, w = block_targets(ex, torch.tensor([3]), 5, gamma=7.0)
    assert labels.tolist() == [[5, 6, 7, 8]]
    assert w[0, :2].tolist() == pytest.approx([1.0, math.exp(-1 / 7)])
    assert w[0, 2:].tolist() == [0.0, 0.0]  # cut at token 7 and everything after it


def _train_losses(draft, target, batch, cfg: TrainConfig) -> list[float]:
    """Backbone + refine loss per step of ``train_stats``."""
    return [s["backbone"] + s["refine"] for s in train_stats(draft, target, batch, cfg)]


def test_training_smoke_loss_falls(target):
    torch.manual_seed(0)
    draft = init_draft(target, **DRAFT_KW)
    draft.train()
    cfg = TrainConfig(steps=20, lr=3e-3, anchors_per_seq=64, replacement_probability=0.0, alignment_warmup_steps=5)
    batch = [(ex, capture(target, ex.ids, draft.target_layer_ids)) for ex in (_sequence(seed=1), _sequence(seed=2))]
    head_before = target.head_weight.clone()
    losses = _train_losses(draft, target, batch, cfg)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert torch.equal(target.head_weight, head_before)  # the target's head/embeddings never train
    assert target.head_weight.grad is None


def test_bf16_autocast_trains_fp32_weights(target, tmp_path):
    """Autocast changes the GEMM precision only: weights, grads and the saved draft stay fp32, losses fall,
    and the first step's losses stay close to the fp32 ones (same batch, same init)."""
    exs = [_sequence(seed=1), _sequence(seed=2)]
    cfg = TrainConfig(steps=20, lr=3e-3, anchors_per_seq=64, replacement_probability=0.0, alignment_warmup_steps=5)
    runs = {}
    for mode in (None, "bfloat16"):
        torch.manual_seed(0)
        draft = init_draft(target, **DRAFT_KW)
        draft.train()
        batch = [(ex, capture(target, ex.ids, draft.target_layer_ids)) for ex in exs]
        cfg.autocast = mode
        runs[mode] = (_train_losses(draft, target, batch, cfg), draft)
    losses, draft = runs["bfloat16"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    grads = [p.grad for p in draft.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    assert losses != runs[None][0]  # bf16 GEMMs really ran (bit-equal losses would mean autocast did nothing)
    assert abs(losses[0] - runs[None][0][0]) < 0.05 * runs[None][0][0]
    # the train() loop applies it too and writes an fp32 draft
    cfg2 = TrainConfig(steps=2, batch_size=2, anchors_per_seq=4, autocast="bfloat16", log_every=1)
    train(target, exs, tmp_path / "d", cfg2, num_layers=1, block_size=4, log=lambda s: None,
          draft_overrides=dict(transfer_rank=16, message_size=32, top_k=4, intermediate_size=96))  # fmt: skip
    saved = load_draft(tmp_path / "d").state_dict().values()
    assert all(t.dtype in (torch.float32, torch.long, torch.bool) for t in saved)


def test_train_writes_loadable_draft(target, tmp_path):
    exs = [_sequence(seed=s) for s in range(3)]
    cfg = TrainConfig(steps=3, batch_size=2, anchors_per_seq=4, save_every=2, log_every=1)
    draft = train(target, exs, tmp_path / "d", cfg, num_layers=1, block_size=4,
                  draft_overrides=dict(transfer_rank=16, message_size=32, top_k=4, intermediate_size=96),
                  log=lambda s: None)  # fmt: skip
    loaded = load_draft(tmp_path / "d")
    assert (tmp_path / "d" / "training.json").is_file()
    for (n, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n


def test_cli_train_writes_loadable_draft(target_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from dspine.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [1, 2, 3, 4], "response_ids": list(range(10, 40))}) + "\n"
                            for _ in range(2)))  # fmt: skip
    out = tmp_path / "draft"
    args = ["train", str(target_dir), str(data), str(out), "--steps", "2", "--layers", "1", "--block-size", "4",
            "--transfer-rank", "16", "--intermediate-size", "64", "--anchors", "4", "--batch-size", "1"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    d = load_draft(out)
    assert d.block_size == 4 and len(d.layers) == 1 and d.transfer_rank == 16
    bad = CliRunner().invoke(main, ["train", str(target_dir), str(data), str(out), "--init", str(tmp_path / "nope")])
    assert bad.exit_code != 0 and "nope" in bad.output


def test_choose_draft_vocab_frequency_then_low_ids():
    from dspine.training.train import choose_draft_vocab

    exs = [make_example([200, 201], [50, 50, 50, 60, 60, 70]), make_example([202], [60, 90])]
    assert choose_draft_vocab(exs, 6, V).tolist() == [0, 1, 50, 60, 70, 90]  # every response id, then fill 0, 1
    assert choose_draft_vocab(exs, 3, V).tolist() == [50, 60, 70]  # 50, 60 (3x each); 70 and 90 tie -> lower id
    assert 200 not in choose_draft_vocab(exs, 8, V).tolist()  # prompt tokens are not counted


def test_training_with_draft_vocab(target, tmp_path):
    """The losses on a draft vocabulary: finite, falling, and labels outside it never reach the CE."""
    from dspine.training.train import choose_draft_vocab

    exs = [_sequence(seed=s) for s in range(2)]
    vocab = choose_draft_vocab(exs, 64, V)
    torch.manual_seed(0)
    draft = init_draft(target, draft_vocab=vocab, **DRAFT_KW)
    draft.train()
    cfg = TrainConfig(steps=30, lr=3e-3, anchors_per_seq=64, replacement_probability=0.0, alignment_warmup_steps=5)
    batch = [(ex, capture(target, ex.ids, draft.target_layer_ids)) for ex in exs]
    losses = _train_losses(draft, target, batch, cfg)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    draft.save(tmp_path)
    assert torch.equal(load_draft(tmp_path).draft_vocab, vocab)


def test_cli_train_resume_and_teacher_forced(target_dir, tmp_path):
    """``--resume`` continues OUT's run (a changed setting is a one-line error); ``--teacher-forced`` trains."""
    import json

    from click.testing import CliRunner

    from dspine.cli import main
    from dspine.training.train_state import read_state

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [1, 2, 3, 4], "response_ids": list(range(10 + i, 40))}) + "\n"
                            for i in range(3)))  # fmt: skip
    out = tmp_path / "draft"
    base = ["train", str(target_dir), str(data), str(out), "--layers", "1", "--block-size", "4", "--transfer-rank",
            "16", "--intermediate-size", "64", "--anchors", "4", "--batch-size", "1", "--teacher-forced"]  # fmt: skip
    r = CliRunner().invoke(main, [*base, "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert read_state(out).step == 2 and json.loads((out / "training.json").read_text())["teacher_forced_examples"] == 3
    r = CliRunner().invoke(main, [*base, "--steps", "3", "--resume"])
    assert r.exit_code == 0, r.output
    assert "resuming" in r.output and read_state(out).step == 3
    bad = CliRunner().invoke(main, [*base, "--steps", "4", "--resume", "--lr", "0.1"])
    assert bad.exit_code != 0 and "lr=" in bad.output and "Traceback" not in bad.output
    other = CliRunner().invoke(main, [*base[:-1], "--steps", "4", "--resume"])  # same tokens, other label mode
    assert other.exit_code != 0 and "other data" in other.output


def test_short_training_block_is_the_first_slots_of_the_long_one(target):
    """``TrainConfig.block_size`` trains blocks of k < bs slots; that is sound only because in-block attention is
    causal: a k-slot block's outputs are the first k slots of the full block's (features, refinement)."""
    from dspine.training.train import train_block_size

    draft = randomize(init_draft(target, **DRAFT_KW))
    ex = _sequence()
    cap = capture(target, ex.ids, draft.target_layer_ids)
    anchors = torch.tensor([3, 11, 20, 33])
    truth = ex.ids[(anchors[:, None] + torch.arange(BS)).clamp(max=len(ex.ids) - 1)]
    outs = {}
    for bs in (BS, 3):
        block = torch.full((len(anchors), bs), draft.mask_token_id)
        block[:, 0] = ex.ids[anchors]
        with torch.no_grad():
            out = draft.train_forward(cap.taps, anchors, block, target)
            outs[bs] = (out.hidden, draft.refine_slots(out, truth[:, : bs - 1]))
    torch.testing.assert_close(outs[3][0], outs[BS][0][:, :3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[3][1], outs[BS][1][:, :2], rtol=1e-5, atol=1e-5)
    assert train_block_size(draft, TrainConfig(block_size=3)) == 3
    assert train_block_size(draft, TrainConfig()) == BS
    with pytest.raises(ValueError, match="out of range"):
        train_block_size(draft, TrainConfig(block_size=BS + 1))


def test_training_on_a_short_block_keeps_the_draft_block(target, tmp_path):
    """Training with a shorter block trains (losses fall) and leaves the draft's own block (its decode maximum)."""
    exs = [_sequence(seed=1), _sequence(seed=2)]
    torch.manual_seed(0)
    draft = init_draft(target, **DRAFT_KW)
    draft.train()
    cfg = TrainConfig(steps=20, lr=3e-3, anchors_per_seq=64, replacement_probability=0.0, alignment_warmup_steps=5,
                      block_size=3)  # fmt: skip
    batch = [(ex, capture(target, ex.ids, draft.target_layer_ids)) for ex in exs]
    losses = _train_losses(draft, target, batch, cfg)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    cfg2 = TrainConfig(steps=2, batch_size=2, anchors_per_seq=4, block_size=3, log_every=1)
    train(target, exs, tmp_path / "d", cfg2, num_layers=1, block_size=4, log=lambda s: None,
          draft_overrides=dict(transfer_rank=16, message_size=32, top_k=4, intermediate_size=96))  # fmt: skip
    assert load_draft(tmp_path / "d").block_size == 4


def test_backbone_gradient_flows_through_a_kernel_target(target_dir):
    """A draft without a draft vocabulary is scored by ``target.logits``; on a target packed for inference
    (``use_kernels``, the ``load_target`` default on CPU) that head has no autograd formula, so training once got
    no backbone gradient at all (torch only warned). The gradients must equal those through torch's head."""
    import copy

    from dspine.models.registry import load_target
    from dspine.training.train import train_step

    ex = _sequence(seed=3)
    grads = {}
    for kernels in (False, True):
        t = load_target(target_dir, kernels=kernels).requires_grad_(False)
        torch.manual_seed(0)
        draft = copy.deepcopy(randomize(init_draft(t, **DRAFT_KW))).train()
        cap = capture(t, ex.ids, draft.target_layer_ids)
        cfg = TrainConfig(anchors_per_seq=8, replacement_probability=0.0, alignment_weight=0.0)
        train_step(draft, t, [(ex, cap)], 10, cfg, torch.Generator().manual_seed(0))
        grads[kernels] = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    assert any(g.abs().sum() > 0 for n, g in grads[True].items() if n.startswith("layers.0.mlp"))
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-3, atol=1e-5, msg=n)
