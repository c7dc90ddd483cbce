"""``export --format openai`` streaming: a row's samples stay one line across record-batch boundaries and after
compaction; every line passes the ``openai`` package's types."""

from __future__ import annotations

import json

from helpers import prompts, run_cli, write_jsonl
from openai.types.chat import ChatCompletion

from dspine_batch.ops import export


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_samples_straddling_batches_and_parts_stay_one_line(tmp_path, monkeypatch):
    rows = prompts(40)
    rows[9]["prompt"] = ""  # an error row: one error line
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--num-samples", "3", "--temperature", "0.9",
                    "--commit-rows", "7", "--max-error-rate", "1"]) == 0
    monkeypatch.setattr(export, "BATCH_ROWS", 4)  # 3 samples a row: rows straddle every other batch
    res = tmp_path / "a.jsonl"
    stats = export.export_openai(str(out), str(res))
    lines = _lines(res)
    assert (stats.lines, stats.ok, stats.errors) == (40, 39, 1)
    assert [x["custom_id"] for x in lines] == [r["id"] for r in rows]
    for x in lines:
        if x["custom_id"] == rows[9]["id"]:
            assert x["response"] is None and "field 'prompt': empty prompt" in x["error"]["message"]
            continue
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert [c.index for c in body.choices] == [0, 1, 2] and body.choices[0].logprobs is None
    assert run_cli(["finalize", str(out), "--compact"]) == 0
    again = tmp_path / "b.jsonl"
    export.export_openai(str(out), str(again))

    def strip(xs):
        return [{**x, "response": x["response"] and {**x["response"], "body": {**x["response"]["body"],
                                                                               "created": 0}}} for x in xs]

    assert strip(_lines(again)) == strip(lines)  # compaction changes the commit time only


def test_export_of_a_folder_that_is_not_an_output_is_one_line(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert run_cli(["export", str(tmp_path / "x"), "-o", str(tmp_path / "r.jsonl")]) == 2
    assert "no _manifest.json (not a dspine-batch output)" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()
