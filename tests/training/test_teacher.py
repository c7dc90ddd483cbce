"""Teacher-forced targets (issue 14 item 1b): the target's argmax labels over text it did not write, cut at the
first in-block disagreement; identical to the regenerated path on the target's own greedy text."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import teacher_forced_batch, train_stats

from dspine.draft.io import init_draft
from dspine.training.teacher import greedy_next, teacher_forced_targets
from dspine.training.train import TrainConfig, block_targets, capture, make_example, train_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_labels_are_target_argmax_and_cut_at_first_disagreement():
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    mask = torch.tensor([False, False] + [True] * 8)
    greedy = torch.tensor([1, 2, 3, 9, 5, 6, 6, 8, 9, 0])  # greedy[j] predicts position j+1; disagrees at 4, 7
    labels, w = teacher_forced_targets(ids, mask, greedy, torch.tensor([2, 5]), bs=5, gamma=7.0)
    # anchor 2: slots predict positions 3..6 with labels greedy[2..5]; text agrees at 3 (3 == greedy[2]),
    # disagrees at 4 (4 != 9): slot 1 (pos 3) ok, slot 2 (pos 4, predecessor 3 agreed) ok, slot 3 cut
    assert labels[0].tolist() == [3, 9, 5, 6]
    assert (w[0] > 0).tolist() == [True, True, False, False]
    assert w[0, 1].item() == pytest.approx(math.exp(-1 / 7))
    # anchor 5: positions 6..9, labels greedy[5..8] = 6, 6, 8, 9; text 6 agrees, 7 != 6 -> slot 3 cut
    assert labels[1].tolist() == [6, 6, 8, 9]
    assert (w[1] > 0).tolist() == [True, True, False, False]


def test_cut_at_sequence_end_and_unsupervised_slot():
    ids = torch.arange(8)
    greedy = torch.arange(1, 9)  # the text is exactly the target's greedy path
    mask = torch.tensor([False, True, True, True, False, True, True, True])
    _, w = teacher_forced_targets(ids, mask, greedy, torch.tensor([1, 5]), bs=5, gamma=7.0)
    assert (w[0] > 0).tolist() == [True, True, False, False]  # position 4 unsupervised
    assert (w[1] > 0).tolist() == [True, True, False, False]  # past the end (T = 8)


def test_equals_regenerated_targets_on_greedy_text():
    """On the target's own greedy text both label paths agree slot for slot."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (30,), generator=g)
    greedy = torch.cat([ids[1:], torch.tensor([7])])
    ex = make_example(ids[:5].tolist(), ids[5:].tolist())
    anchors = torch.tensor([5, 9, 17, 26])
    want = block_targets(ex, anchors, 6, 4.0)
    got = teacher_forced_targets(ex.ids, ex.loss_mask, greedy, anchors, 6, 4.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_greedy_next_matches_full_logits(llama_target):
    ids = torch.randint(0, 255, (37,), generator=torch.Generator().manual_seed(1))
    cap = capture(llama_target, ids, [0], greedy=True)
    want = llama_target.logits(cap.hidden).argmax(-1)
    assert torch.equal(cap.greedy, want)
    assert torch.equal(greedy_next(llama_target, cap.hidden, chunk=5), want)  # chunking changes nothing
    assert capture(llama_target, ids, [0]).greedy is None


def test_teacher_forced_examples_train(llama_target):
    """Random text the target never wrote: the draft learns the target's labels (loss falls, accuracy rises)."""
    torch.manual_seed(0)
    draft = init_draft(llama_target, num_layers=1, block_size=4, transfer_rank=16, message_size=32, top_k=4,
                       intermediate_size=96)  # fmt: skip
    draft.train()
    batch = teacher_forced_batch(llama_target, draft, 48)
    cfg = TrainConfig(steps=25, lr=3e-3, anchors_per_seq=64, replacement_probability=0.0, alignment_warmup_steps=5)
    stats = train_stats(draft, llama_target, batch, cfg)
    loss = [s["backbone"] + s["refine"] for s in stats]
    assert all(math.isfinite(x) for x in loss)
    assert max(loss[-3:]) < 0.75 * loss[0], loss
    assert stats[-1]["acc"] > stats[0]["acc"]
    with pytest.raises(ValueError, match="greedy"):
        ex = batch[0][0]
        no_labels = capture(llama_target, ex.ids, draft.target_layer_ids)
        train_step(draft, llama_target, [(ex, no_labels)], 0, cfg, torch.Generator())


def test_load_examples_reads_teacher_forced_flag(tmp_path):
    import json

    from dspine.training.train import load_examples

    f = tmp_path / "d.jsonl"
    rows = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]},
            {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "teacher_forced": True}]  # fmt: skip
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [e.teacher_forced for e in load_examples(f)] == [False, True]
    assert [e.teacher_forced for e in load_examples(f, teacher_forced=True)] == [True, True]
    f.write_text(json.dumps({**rows[0], "teacher_forced": "yes"}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:1: teacher_forced"):
        load_examples(f)
