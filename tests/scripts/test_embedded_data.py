"""scripts/train/embedded_data.py helpers that need no source package: teacher-forced records, resumable data files,
the exported prompt file (what the GPU recipe carries instead of the source packages)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "train"))

import embedded_data as ed  # noqa: E402


class FakeTokenizer:
    """Bytes as ids: enough to check what lands in the records."""

    def __init__(self):
        self.tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: SimpleNamespace(ids=[*text.encode()]))

    def render_chat(self, messages):
        return [1] + list(messages[0]["content"].encode()) + [2]

    def eos_ids(self):
        return [0]


def _prompts():
    return [
        ed.Prompt("chat", "train", "hi", "hello there"),
        ed.Prompt("code", "train", "def f", "x" * 50),  # longer than the cap: cut, no EOS
        ed.Prompt("math", "train", "1+1?", None),  # no reference: skipped
        ed.Prompt("math", "train", "q" * 40, "2"),  # prompt too long: skipped
    ]


def test_teacher_forced_records_and_resume(tmp_path):
    out = tmp_path / "tf.jsonl"
    n = ed.teacher_forced_records(FakeTokenizer(), _prompts(), out, max_response_tokens=20, max_prompt_tokens=30,
                                  log=lambda s: None)  # fmt: skip
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 and [r["text"] for r in recs] == ["hi", "def f"]
    assert recs[0]["prompt_ids"] == [1, *b"hi", 2] and recs[0]["response_ids"] == [*b"hello there", 0]
    assert recs[1]["response_ids"] == [ord("x")] * 20  # truncated: no EOS (the answer goes on)
    assert all(r["teacher_forced"] is True for r in recs)
    # a run killed mid-line: the partial record is dropped, finished ones are not written twice
    out.write_text(out.read_text() + '{"dataset": "chat", "text": "par')
    n = ed.teacher_forced_records(FakeTokenizer(), _prompts(), out, 20, 30, log=lambda s: None)
    assert n == 0 and len(out.read_text().splitlines()) == 2


def test_written_records_train_as_teacher_forced(tmp_path):
    from dspine.training.train import load_examples

    out = tmp_path / "tf.jsonl"
    ed.teacher_forced_records(FakeTokenizer(), _prompts(), out, 20, 30, log=lambda s: None)
    exs = load_examples(out)
    assert [e.teacher_forced for e in exs] == [True, True]
    assert int(exs[0].loss_mask.sum()) == len(b"hello there") + 1


def test_prompt_file_round_trip_and_errors(tmp_path):
    f = tmp_path / "prompts.jsonl"
    prompts = [ed.Prompt("chat", "eval", "q1"), *_prompts()]
    ed.write_prompts(f, prompts)
    ev, tr = ed.read_prompts(f)
    assert ev == prompts[:1] and tr == prompts[1:]
    f.write_text('{"dataset": "chat", "split": "eval", "text": "ok"}\n{"dataset": "chat"}\n')
    with pytest.raises(SystemExit, match=r"prompts\.jsonl:2: not a prompt record"):
        ed.read_prompts(f)
    f.write_text('{"dataset": "poetry", "split": "eval", "text": "ok"}\n')
    with pytest.raises(SystemExit, match=r"prompts\.jsonl:1: split must be"):
        ed.read_prompts(f)


def test_first_per_dataset_keeps_order():
    ps = [ed.Prompt(d, "train", f"{d}{i}") for i in range(3) for d in ("chat", "code")]
    assert [p.text for p in ed.first_per_dataset(ps, 2)] == ["chat0", "code0", "chat1", "code1"]
