"""scripts/train/train_embedded.py prompt order: what a time-boxed data stage regenerates first.

The end-to-end runs of the script are in ``test_gpu_train.py`` (the GPU recipe drives it); this file holds the
pure helpers.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "train"))

import embedded_data as ed  # noqa: E402
import train_embedded as te  # noqa: E402


def _sources(n_chat: int, n_code: int, n_math: int, **_) -> list[ed.Prompt]:
    """Like ``ed.train_prompts``: each dataset in a fixed order, a smaller request a prefix of a larger one."""
    return (
        [ed.Prompt("chat", "train", f"chat {i}") for i in range(n_chat)]
        + [ed.Prompt("code", "train", f"code {i}") for i in range(n_code)]
        + [ed.Prompt("math", "train", f"math {i}") for i in range(n_math)]
    )


def _args(**kw) -> Namespace:
    base = dict(prompts=None, prior_counts=None, eval_per_dataset=2, n_chat=40, n_code=5, n_math=20, seed=0,
                prompts_per_dataset=None)  # fmt: skip
    return Namespace(**{**base, **kw})


def test_interleave_round_robin_in_dataset_order():
    ps = _sources(3, 1, 2)
    got = [p.text for p in te.interleave(ps)]
    assert got == ["chat 0", "code 0", "math 0", "chat 1", "math 1", "chat 2"]


def test_new_prompts_first_and_interleaved_with_prior_counts(monkeypatch):
    # The bug this guards: interleaving by index first and moving the earlier stage's prompts last afterwards
    # left the new chat prompts (indices >= the earlier chat count) behind all new math and code, so a
    # time-boxed run regenerated no chat at all.
    monkeypatch.setattr(ed, "train_prompts", _sources)
    monkeypatch.setattr(ed, "eval_prompts", lambda n: [])
    _, mixed = te.prompt_lists(_args(prior_counts="20,0,10"))
    assert len(mixed) == 65 and len({p.text for p in mixed}) == 65
    head = Counter(p.dataset for p in mixed[:15])
    assert head == {"chat": 5, "code": 5, "math": 5}  # the first 15: all three datasets, new prompts only
    assert [p.text for p in mixed[:3]] == ["chat 20", "code 0", "math 10"]
    new = {f"chat {i}" for i in range(20, 40)} | {f"code {i}" for i in range(5)} | {f"math {i}" for i in range(10, 20)}
    assert {p.text for p in mixed[:35]} == new  # every new prompt before any seen one
    assert mixed[35].text == "chat 0"


def test_without_prior_counts_everything_is_interleaved(monkeypatch):
    monkeypatch.setattr(ed, "train_prompts", _sources)
    monkeypatch.setattr(ed, "eval_prompts", lambda n: [])
    _, mixed = te.prompt_lists(_args())
    assert [p.dataset for p in mixed[:6]] == ["chat", "code", "math"] * 2
    assert Counter(p.dataset for p in mixed) == {"chat": 40, "code": 5, "math": 20}
