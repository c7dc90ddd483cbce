"""Resumable training (issue 14 item 2): a run stopped or killed and resumed ends where an uninterrupted run ends.

Tiny Llama target from conftest (vocab 256, hidden 64), a one-layer draft, CPU fp32: resumed runs must give
bit-identical weights and per-step losses.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from dspine.draft.io import load_draft
from dspine.training.train import TrainConfig, make_example, save_checkpoint, train
from dspine.training.train_state import STATE_FILE, ResumeError, data_fingerprint, read_state

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(num_layers=1, block_size=4,
             draft_overrides=dict(transfer_rank=16, message_size=32, top_k=4, intermediate_size=64))  # fmt: skip


def _examples(n: int = 5):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        ids = torch.randint(0, 255, (24 + 3 * i,), generator=g).tolist()
        out.append(make_example(ids[:6], ids[6:], teacher_forced=i % 2 == 1))  # both label modes in one run
    return out


def _cfg(**kw) -> TrainConfig:
    # batch 2 over 5 examples: epochs end mid-batch, so the data cursor must survive across a resume
    base = dict(steps=6, batch_size=2, anchors_per_seq=4, lr=3e-3, save_every=0, log_every=1,
                replacement_probability=0.5, alignment_warmup_steps=2)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _run(target, out: Path, cfg: TrainConfig, resume: bool = False, log=lambda s: None):
    return train(target, _examples(), out, cfg, log=log, resume=resume, progress=False, **SHAPE)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "history.jsonl").read_text().splitlines()]


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def reference(llama_target, tmp_path_factory):
    """The uninterrupted run: 6 steps in one go."""
    out = tmp_path_factory.mktemp("ref") / "d"
    draft = _run(llama_target, out, _cfg())
    return draft, _losses(out)


def test_stop_and_resume_is_bit_identical(llama_target, reference, tmp_path):
    """SIGTERM after step 2 of 6 (a scheduler's stop), then resume: same weights, same loss at every step."""
    out = tmp_path / "d6"
    first = []

    def stop_after_three(msg: str) -> None:
        first.append(msg)
        if msg.startswith("loss=") and "step=2 " in msg + " ":
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop: finish the step, checkpoint, return

    _run(llama_target, out, _cfg(), log=stop_after_three)
    state = read_state(out)
    assert state.step == 3 and any("stopping after this step" in m for m in first)
    resumed = _run(llama_target, out, _cfg(), resume=True)
    _assert_same_weights(resumed, reference[0])
    assert _losses(out) == reference[1]
    assert read_state(out).step == 6


def test_killed_run_resumes_from_last_checkpoint(llama_target, reference, tmp_path):
    """A crash after step 5 (checkpoints every 2 steps) loses steps 4-5 only; the resume replays them exactly."""
    out = tmp_path / "d"

    def crash(msg: str) -> None:
        if msg.startswith("loss=") and "step=4 " in msg + " ":
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        _run(llama_target, out, _cfg(save_every=2), log=crash)
    assert read_state(out).step == 4
    # the crash could also have hit between the two renames of a save: only the .old sibling is left
    out.rename(out.with_name("d.old"))
    resumed = _run(llama_target, out, _cfg(save_every=2), resume=True)
    _assert_same_weights(resumed, reference[0])
    assert _losses(out) == reference[1]
    _assert_same_weights(load_draft(out), reference[0])


def test_resume_extends_a_finished_run(llama_target, tmp_path):
    """--steps raised on resume: the run continues from its checkpoint (the cosine now ends at the new total)."""
    out = tmp_path / "d"
    _run(llama_target, out, _cfg(steps=3))
    before = load_draft(out)
    _run(llama_target, out, _cfg(steps=5), resume=True)
    assert read_state(out).step == 5 and len(_losses(out)) == 5
    assert not torch.equal(load_draft(out).state_dict()["norm.weight"], before.state_dict()["norm.weight"])


def test_resume_without_checkpoint_starts_fresh_and_finished_run_is_kept(llama_target, reference, tmp_path):
    out = tmp_path / "d"
    first = _run(llama_target, out, _cfg(), resume=True)  # nothing to resume: a fresh run
    _assert_same_weights(first, reference[0])
    again = _run(llama_target, out, _cfg(), resume=True)  # already at `steps`: nothing more runs
    _assert_same_weights(again, reference[0])
    assert len(_losses(out)) == len(reference[1])


def test_resume_refuses_other_data_or_settings(llama_target, tmp_path):
    out = tmp_path / "d"
    _run(llama_target, out, _cfg(steps=1))
    with pytest.raises(ResumeError, match=r"lr=0\.003.*0\.001"):
        _run(llama_target, out, _cfg(steps=2, lr=1e-3), resume=True)
    with pytest.raises(ResumeError, match="other data"):
        train(llama_target, _examples(4), out, _cfg(steps=2), resume=True, progress=False, log=lambda s: None,
              **SHAPE)  # fmt: skip
    (out / STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ResumeError, match=STATE_FILE):
        _run(llama_target, out, _cfg(steps=2), resume=True)
    (out / STATE_FILE).unlink()  # a draft dir from before resumable checkpoints: never overwritten by a fresh run
    with pytest.raises(ResumeError, match="without trainer_state.pt"):
        _run(llama_target, out, _cfg(steps=2), resume=True)


def test_fingerprint_sees_label_mode_and_tokens():
    a = _examples()
    b = _examples()
    assert data_fingerprint(a) == data_fingerprint(b)
    b[0].teacher_forced = True
    assert data_fingerprint(a) != data_fingerprint(b)
    c = _examples()
    c[1].ids[3] += 1
    assert data_fingerprint(a) != data_fingerprint(c)


def test_save_checkpoint_replaces_stale_temp_dir(llama_target, tmp_path):
    from dspine.draft.io import init_draft

    d = init_draft(llama_target, num_layers=1, block_size=4, transfer_rank=16, intermediate_size=64)
    out = tmp_path / "d"
    stale = tmp_path / "d.tmp"
    stale.mkdir()
    (stale / "junk.bin").write_bytes(b"x")  # a run killed while writing
    save_checkpoint(d, out, {"steps_done": 0})
    assert not stale.exists() and not (out / "junk.bin").exists()
    assert json.loads((out / "training.json").read_text()) == {"steps_done": 0}
    save_checkpoint(d, out, {"steps_done": 1})
    assert not (tmp_path / "d.old").exists()
    _assert_same_weights(load_draft(out), d)
