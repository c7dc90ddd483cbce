"""Rows to requests: column roles, row ids, per-row params, prompt checks, each row-level bad-input class."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import map_rows, write_jsonl

from dspine_batch.engines.base import SamplingParams
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.errors import UsageError
from dspine_batch.inputs.sources import resolve_inputs
from dspine_batch.requests.fields import Defaults, RowOptions
from dspine_batch.requests.mapping import MapSettings, RowMapper, resolve_columns


def _map(tmp_path, rows, raw=None, keep=(), samples=1, system=None, **eng):
    files = resolve_inputs([str(write_jsonl(tmp_path / "in.jsonl", rows, raw))])
    cols = resolve_columns(files, None, None, None, list(keep), True)
    engine = ScriptedEngine(**eng)
    defaults = Defaults(SamplingParams(max_new_tokens=16), RowOptions(n=samples), {})
    mapper = RowMapper(MapSettings(cols, defaults, system, True, engine.name, engine.features), engine.tokenizer,
                       engine.max_context)
    return map_rows(mapper, files, cols)


def test_ids_samples_seeds_and_row_params(tmp_path):
    items = _map(tmp_path, [{"id": 7, "prompt": "hi", "temperature": 0.5, "max_new_tokens": 3, "stop": "x"},
                            {"prompt": "no id col in this row"}], samples=2)
    a, b = items
    assert a.row_id == "7" and len(a.requests) == 2
    p = a.requests[0].params
    assert (p.temperature, p.max_new_tokens, p.stop) == (0.5, 3, ("x",))
    assert a.requests[0].params.seed != a.requests[1].params.seed
    assert b.row_id == "in.jsonl:1" and "field 'id': missing" in b.error


@pytest.mark.parametrize("row, field, text", [
    ({"id": "a"}, "prompt", "missing"),
    ({"id": "a", "prompt": None}, "prompt", "expected a string, got null"),
    ({"id": "a", "prompt": 5}, "prompt", "expected a string, got int"),
    ({"id": "a", "prompt": "  "}, "prompt", "empty prompt"),
    ({"id": "a", "prompt": "x", "temperature": -1}, "temperature", "expected a number >= 0"),
    ({"id": "a", "prompt": "x", "top_p": 2}, "top_p", "(0, 1]"),
    ({"id": "a", "prompt": "x", "max_new_tokens": 0}, "max_new_tokens", "integer >= 1"),
    ({"id": "a", "prompt": "x", "top_k": 1.5}, "top_k", "integer"),
    ({"id": "a", "prompt": "x", "seed": "s"}, "seed", "integer"),
    ({"id": "a", "prompt": "x", "stop": [1]}, "stop", "list of non-empty strings"),
    ({"id": ["a"], "prompt": "x"}, "id", "expected a string or int"),
    ({"id": "a", "prompt": "x" * 100}, "prompt", "context is 64"),
])
def test_row_level_bad_input(tmp_path, row, field, text):
    (item,) = _map(tmp_path, [{"id": "first", "prompt": "ok"}, row], max_context_len=64)[1:]
    assert item.error and not item.requests
    assert "in.jsonl: line 2" in item.error and f"field {field!r}" in item.error and text in item.error


def test_duplicate_ids_get_fallback_ids(tmp_path):
    items = _map(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    assert [i.row_id for i in items] == ["a", "in.jsonl:1"]
    assert "duplicate id 'a'" in items[1].error


def test_messages_column_and_system_prompt(tmp_path):
    good = {"id": "m", "messages": [{"role": "user", "content": "hi"}]}
    bad = {"id": "n", "messages": [{"role": "wizard", "content": "hi"}]}
    items = _map(tmp_path, [good, bad], system="be brief")
    text = "".join(chr(t) for t in items[0].requests[0].prompt_ids)
    assert text.startswith("<|system|>be brief") and "<|user|>hi" in text
    assert "field 'messages[0].role'" in items[1].error


def test_keep_column_type_mismatch_is_a_row_error(tmp_path):
    items = _map(tmp_path, [{"id": "a", "prompt": "x", "n": 1}, {"id": "b", "prompt": "y", "n": "one"}],
                 keep=["n"])
    assert items[0].keep == ("a", 1) and not items[0].error  # the id column first, kept under its own name
    assert "field 'n': expected int64, got str" in items[1].error and items[1].keep == ("b", None)


def test_unknown_columns_are_usage_errors(tmp_path):
    pq.write_table(pa.table({"question": ["a"], "qid": [1]}), tmp_path / "a.parquet")
    files = resolve_inputs([str(tmp_path / "a.parquet")])
    with pytest.raises(UsageError, match=r"no column 'prompt' or 'messages' \(columns: question, qid\); say where it "
                       r"is: --prompt-column question"):
        resolve_columns(files, None, None, None, [], True)
    with pytest.raises(UsageError, match="no column 'nope' for --keep-columns"):
        resolve_columns(files, "question", None, "qid", ["nope"], True)
    with pytest.raises(UsageError, match="exclusive"):
        resolve_columns(files, "question", "messages", None, [], True)
    cols = resolve_columns(files, "question", None, "qid", [], True)
    assert (cols.prompt, cols.id) == ("question", "qid")


def test_empty_file_is_a_usage_error(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(UsageError, match="empty file"):
        resolve_columns(resolve_inputs([str(tmp_path / "e.jsonl")]), None, None, None, [], True)
