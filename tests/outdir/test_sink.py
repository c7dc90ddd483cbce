"""The Parquet sink: typed schema, atomic part commits, and OUTDIR readable as-is by common readers."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from helpers import prompts, run_cli, write_jsonl

from dspine_batch.engines.base import Result
from dspine_batch.outdir.layout import KEYS, STAGING, part_name
from dspine_batch.outdir.output import open_output
from dspine_batch.outdir.schema import BASE_NAMES, output_schema
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.run.sink import PartSink


def _sink(tmp_path, commits, **kw):
    schema = output_schema([pa.field("topic", pa.string())], save_token_ids=True)
    args = {"commit_rows": 2, "commit_seconds": 3600.0, "attempt": 0} | kw
    return PartSink(str(tmp_path), schema, "00000-of-00001", 0, 2, on_commit=commits.append, **args)


def test_rows_commit_whole_with_typed_nulls(tmp_path):
    commits = []
    sink = _sink(tmp_path, commits)
    ok = [Result("a", s, [5, 6], "xy", "stop", 3, 2, latency_s=0.1) for s in range(2)]
    sink.add(WorkItem("a", [], ("math",)), ok)
    assert not sink.due()
    sink.add(WorkItem("b", [], (None,), error="in.jsonl: row 1, field 'prompt': missing"), None)
    assert sink.due()
    assert sink.commit() and not sink.commit()
    t = pq.read_table(tmp_path / part_name("00000-of-00001", 0))
    assert t.num_rows == 4 and t.schema.names[: len(BASE_NAMES)] == BASE_NAMES
    assert t.schema.field("verify_steps").type == pa.int32()  # all null, still typed
    assert t.schema.field("accept_histogram").type == pa.list_(pa.int32())
    rows = t.to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok", "error", "error"]
    assert rows[2]["finish_reason"] == "error" and "field 'prompt'" in rows[2]["error"]
    assert rows[0]["output_token_ids"] == [5, 6] and rows[0]["topic"] == "math"
    assert commits[-1].rows == 2 and commits[-1].error_rows == 1 and commits[-1].outputs == 4


def test_cached_prompt_tokens_are_written_as_the_engine_reported_them(tmp_path):
    """A reported count is written as is, an unreported one (None) stays null rather than becoming 0 (0 would
    read as "no cache hit"), and an error row without prompt tokens has no cache count either."""
    sink = _sink(tmp_path, [], commit_rows=100)
    sink.add(WorkItem("a", [], ("x",)), [Result("a", 0, [5], "y", "stop", 300, 1, cached_prompt_tokens=256),
                                         Result("a", 1, [5], "y", "stop", 300, 1, cached_prompt_tokens=0)])
    sink.add(WorkItem("b", [], ("x",)), [Result("b", s, [5], "y", "stop", 4, 1) for s in range(2)])
    sink.add(WorkItem("c", [], (None,), error="in.jsonl: row 2, field 'prompt': missing"), None)
    assert sink.commit()
    t = pq.read_table(tmp_path / part_name("00000-of-00001", 0))
    assert t.schema.field("cached_prompt_tokens").type == pa.int32()
    assert t.schema.names.index("cached_prompt_tokens") == t.schema.names.index("prompt_tokens") + 1
    assert t.column("cached_prompt_tokens").to_pylist() == [256, 0, None, None, None, None]


def test_time_based_commit(tmp_path):
    sink = _sink(tmp_path, [], commit_rows=1000, commit_seconds=0.0001)
    sink.add(WorkItem("a", [], (None,), error="x"), None)
    time.sleep(0.01)
    assert sink.due()


@pytest.mark.parametrize("call", ["link", "rename"])
def test_a_failed_commit_is_all_or_nothing(tmp_path, monkeypatch, call):
    """The record's create-only write (a link) is the commit: a failure up to it leaves no visible part, no staged
    bytes, no record. Past it the part is committed: a failed publish (the rename) leaves it invisible to readers
    until the next start's recovery publishes it, exactly once."""
    table = pa.table({"x": [1, 2]})
    name = part_name("00000-of-00001", 0)

    def boom(*a):
        raise OSError(f"{call} failed")

    monkeypatch.setattr(os, call, boom)
    with pytest.raises(OSError, match=f"{call} failed"):
        open_output(str(tmp_path)).commit_part(name, table)
    monkeypatch.undo()
    assert ds.dataset(str(tmp_path), format="parquet").count_rows() == 0
    committed = call == "rename"
    assert len(os.listdir(tmp_path / KEYS)) == len(os.listdir(tmp_path / STAGING)) == int(committed)
    if committed:
        assert open_output(str(tmp_path)).remove_staging("00000-of-00001") == 0  # nothing uncommitted: published
    else:
        open_output(str(tmp_path)).commit_part(name, table)
    assert ds.dataset(str(tmp_path), format="parquet").count_rows() == 2 and not os.listdir(tmp_path / STAGING)


def test_keep_column_clash_is_usage_error():
    from dspine_batch.errors import UsageError

    with pytest.raises(UsageError, match="clashes"):
        output_schema([pa.field("output", pa.string())], False)


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readers")
    src = write_jsonl(tmp / "in.jsonl", prompts(30) + [{"id": "bad", "prompt": 3}])
    out = tmp / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "8", "--max-error-rate", "1",
                    "--keep-columns", "prompt", "--save-token-ids"]) == 0
    (out / ".train-00000-of-00001-000099.parquet.inprogress").write_bytes(b"partial garbage")  # a crash leftover
    return out


def test_read_back_with_pyarrow_dataset(outdir):
    t = ds.dataset(str(outdir), format="parquet").to_table()
    assert t.num_rows == 31 and t.column("status").to_pylist().count("error") == 1
    assert t.column("id").to_pylist() == t.column("row_id").to_pylist()  # the input's id keeps its name


def test_the_id_column_keeps_its_name_and_type(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"qid": [7, 8, 9], "question": ["a", "b", ""]}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    assert run_cli(["generate", str(tmp_path / "in.parquet"), "-o", str(out), "--id-column", "qid",
                    "--prompt-column", "question", "--max-error-rate", "1"]) == 0
    t = ds.dataset(str(out), format="parquet").to_table()
    assert t.schema.field("qid").type == pa.int64() and t.schema.names.index("qid") > t.schema.names.index("row_id")
    rows = sorted(zip(t.column("qid").to_pylist(), t.column("row_id").to_pylist(), t.column("status").to_pylist()))
    assert rows == [(7, "7", "ok"), (8, "8", "ok"), (9, "9", "error")]


def test_json_lines_ids_of_mixed_types_stay_rows_not_errors(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": "two", "prompt": "b"}])
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out")]) == 0
    t = ds.dataset(str(tmp_path / "out"), format="parquet").to_table()
    assert sorted(zip(t.column("row_id").to_pylist(), t.column("id").to_pylist()), key=str) == [("1", 1), ("two", None)]


def test_read_back_with_pandas(outdir):
    pd = pytest.importorskip("pandas")
    df = pd.read_parquet(outdir)
    assert len(df) == 31 and set(df["row_id"]) >= {"r00000", "bad"}


def test_read_back_with_datasets(outdir):
    datasets = pytest.importorskip("datasets")
    d = datasets.load_dataset("parquet", data_dir=str(outdir), split="train")
    assert len(d) == 31 and "output" in d.column_names and "accept_histogram" in d.column_names


def test_read_back_with_polars_and_duckdb(outdir):
    pl = pytest.importorskip("polars")
    assert pl.scan_parquet(str(outdir) + "/**/*.parquet").collect().height == 31
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"select count(*) from read_parquet('{outdir}/*.parquet')").fetchall()[0][0] == 31
