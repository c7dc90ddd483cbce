"""Bad rows said where they are seen (issue 40, item 1): the run log names the first row of each kind of error as it
happens (file, 1-based line, custom_id, field, what was expected), counts the kinds at the end and names the top
ones when the error budget is exceeded; the report, the Parquet ``error`` column and ``export`` carry the same
words."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
from helpers import run_cli, write_jsonl

from dspine_batch.errors import RowError, error_kind, split_error
from dspine_batch.ops.report import format_report, summarize


def _line(cid: str, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"question {cid}"}], **body}}


def batch_with_three_bad_rows(path):
    rows = [_line(f"req-{i}") for i in range(10)]
    rows[3] = _line("req-3", temperature="hot")  # line 4
    rows[6] = _line("req-6", frobnicate=1)  # line 7
    rows[8] = _line("req-8", temperature="cold")  # line 9: the same kind as line 4
    rows[9] = {"custom_id": "req-9", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "m", "messages": []}}  # line 10
    return write_jsonl(path, rows)


def test_three_kinds_of_bad_row_are_named_once_and_counted_in_the_same_words_everywhere(tmp_path, capfd):
    src = batch_with_three_bad_rows(tmp_path / "batch.jsonl")
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--max-error-rate", "0.1"]) == 3
    err = capfd.readouterr().err
    temp = "batch.jsonl: line 4 (custom_id 'req-3'), field 'body.temperature': expected a number"
    assert err.count(temp) == 1 and "line 9 (custom_id 'req-8')" not in err  # the first of its kind only
    assert err.count("batch.jsonl: line 7 (custom_id 'req-6'), field 'body.frobnicate': not a request field") == 1
    assert err.count("batch.jsonl: line 10 (custom_id 'req-9'), field 'body.messages'") == 1
    assert "4 error row(s) this run, by kind:" in err
    assert "     2 x field 'body.temperature': expected a number" in err
    over = next(line for line in err.splitlines() if "is over --max-error-rate" in line)
    assert "error rate 40.0% (4 of 10 rows)" in over and "top kinds: 2 x field 'body.temperature'" in over

    table = ds.dataset(out, format="parquet").to_table().to_pylist()
    stored = {r["row_id"]: r["error"] for r in table if r["status"] == "error"}
    assert sorted(stored) == ["req-3", "req-6", "req-8", "req-9"]
    for message in stored.values():  # the log's first line of each kind is the stored message, word for word
        if error_kind(message) != error_kind(stored["req-8"]) or message == stored["req-3"]:
            assert message in err

    report = format_report(summarize(str(out)))
    assert "  error rows  2 x field 'body.temperature': expected a number" in report
    assert f"first: {stored['req-3']}" in report
    exported = tmp_path / "results.jsonl"
    assert run_cli(["export", str(out), "-o", str(exported)]) == 0
    errors = {x["custom_id"]: x["error"]["message"] for x in map(json.loads, exported.read_text().splitlines())
              if x["error"]}
    assert errors == stored


def test_parquet_rows_are_named_by_index_and_their_id_column(tmp_path, capfd):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"qid": ["a", "b", "c"], "prompt": ["hi", "", "there"]}), tmp_path / "in.parquet")
    assert run_cli(["generate", str(tmp_path / "in.parquet"), "-o", str(tmp_path / "out"), "--id-column", "qid",
                    "--max-error-rate", "1"]) == 0
    assert "error row: in.parquet: row 1 (qid 'b'), field 'prompt': empty prompt" in capfd.readouterr().err


def test_error_kind_drops_where_and_value_and_engine_errors_are_their_own_kind():
    a = str(RowError("x.jsonl", 0, "body.top_p", "expected a number in (0, 1], got 7").with_id("custom_id", "q"))
    b = str(RowError("y.jsonl", 41, "body.top_p", "expected a number in (0, 1], got 'x'"))
    assert a.startswith("x.jsonl: line 1 (custom_id 'q'), field 'body.top_p'")
    assert error_kind(a) == error_kind(b) == "field 'body.top_p': expected a number in (0, 1]"
    assert error_kind("x.jsonl: line 3: malformed JSON (Expecting ',' (char 9))") == "malformed JSON"
    assert split_error(b) == ("y.jsonl: line 42", "body.top_p", "expected a number in (0, 1], got 'x'")
    assert str(RowError("t.parquet", 41, None, "undecodable value")) == "t.parquet: row 41: undecodable value"
    assert error_kind("scripted engine error") == "scripted engine error"
