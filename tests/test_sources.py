"""Each input format, and each way an input can be unreadable, through ``dspine_batch.sources``."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.errors import FatalError, RowError, UsageError
from dspine_batch.sources import iter_inputs, resolve_inputs

ROWS = prompts(10)


def _all_rows(files):
    out = []
    for b in iter_inputs(files, None):
        out.extend(zip(b.indices, b.rows, strict=True))
    return out


def test_jsonl_plain_gz_zst(tmp_path):
    zstd = pytest.importorskip("zstandard")
    data = b"".join(json.dumps(r).encode() + b"\n" for r in ROWS)
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "c.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(data))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        files = resolve_inputs([str(tmp_path / name)])
        assert files[0].kind == "jsonl" and files[0].name == name
        assert [r for _, r in _all_rows(files)] == ROWS


def test_blank_lines_keep_line_numbers(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n\n')
    assert [(i, r["prompt"]) for i, r in _all_rows(resolve_inputs([str(p)]))] == [(0, "a"), (2, "b")]


def test_bad_lines_become_row_errors(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", ROWS[:1], [b"{not json", b"[1, 2]", b'{"prompt": "caf\xe9"}'])
    rows = _all_rows(resolve_inputs([str(p)]))
    assert isinstance(rows[0][1], dict)
    errs = [r for _, r in rows[1:]]
    assert all(isinstance(e, RowError) for e in errs)
    assert "malformed JSON" in str(errs[0]) and "bad.jsonl: row 1" in str(errs[0])
    assert "expected a JSON object, got list" in str(errs[1])
    assert "not valid UTF-8" in str(errs[2]) and "row 3" in str(errs[2])


def _parquet(path, rows, row_group_size=4):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def test_parquet_file_dir_glob_stream_by_row_group(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    _parquet(d / "a.parquet", ROWS[:6])
    _parquet(d / "b.parquet", ROWS[6:])
    (d / "_ignored.parquet").write_bytes(b"junk")  # hidden/underscore files are not inputs
    batches = list(iter_inputs(resolve_inputs([str(d / "a.parquet")]), None))
    assert [len(b.rows) for b in batches] == [4, 2]  # one batch per row group
    for arg in (str(d), str(d / "*.parquet")):
        files = resolve_inputs([arg])
        assert [f.name for f in files] == ["a.parquet", "b.parquet"]
        assert [r for _, r in _all_rows(files)] == ROWS
    projected = next(iter_inputs(resolve_inputs([str(d / "a.parquet")]), ["prompt"]))
    assert set(projected.rows[0]) == {"prompt"}


def test_limit_counts_rows_across_files(tmp_path):
    _parquet(tmp_path / "a.parquet", ROWS[:6])
    _parquet(tmp_path / "b.parquet", ROWS[6:])
    files = resolve_inputs([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert len([r for b in iter_inputs(files, None, limit=8) for r in b.rows]) == 8


def test_save_to_disk_dataset_and_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_list(ROWS)
    d.save_to_disk(str(tmp_path / "ds"))
    files = resolve_inputs([str(tmp_path / "ds")])
    assert files[0].kind == "arrow"
    assert [r for _, r in _all_rows(files)] == ROWS
    datasets.DatasetDict({"train": d, "test": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UsageError, match="--split"):
        resolve_inputs([str(tmp_path / "dd")])
    files = resolve_inputs([str(tmp_path / "dd")], split="test")
    assert [r for _, r in _all_rows(files)] == ROWS[:3]


def test_local_hf_dataset_with_split(tmp_path):
    pytest.importorskip("datasets")
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    _parquet(repo / "train-00000-of-00001.parquet", ROWS)
    _parquet(repo / "test-00000-of-00001.parquet", ROWS[:2])
    files = resolve_inputs([str(tmp_path / "repo")], split="test")
    assert files[0].kind == "hf" and files[0].name.endswith("/test")
    assert [r for _, r in _all_rows(files)] == ROWS[:2]


def test_openai_batch_jsonl_is_recognised(tmp_path):
    lines = [{"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                       "temperature": 0.2}},
             {"custom_id": "q2", "body": {"model": "x", "messages": [], "logprobs": True}}]
    p = write_jsonl(tmp_path / "batch.jsonl", lines)
    files = resolve_inputs([str(p)])
    assert files[0].kind == "openai"
    rows = [r for _, r in _all_rows(files)]
    assert rows[0] == {"custom_id": "q1", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 5,
                       "temperature": 0.2}
    assert isinstance(rows[1], RowError) and rows[1].field == "body.logprobs"


def test_unusable_inputs_are_usage_errors(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "empty").mkdir()
    for args, match in [([str(tmp_path / "nope.jsonl")], "no such file"), ([str(tmp_path / "x.csv")], "unknown input"),
                        ([str(tmp_path / "*.jsonl")], "matches no files"), ([str(tmp_path / "empty")], "no Parquet"),
                        ([str(tmp_path / "x.csv")] * 2, "unknown input")]:
        with pytest.raises(UsageError, match=match):
            resolve_inputs(args)
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    with pytest.raises(UsageError, match="more than once"):
        resolve_inputs([str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl")])


def test_truncated_gzip_is_fatal_with_file_name(tmp_path):
    data = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in prompts(2000)))
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(FatalError, match="t.jsonl.gz: unreadable"):
        _all_rows(resolve_inputs([str(tmp_path / "t.jsonl.gz")]))


@pytest.mark.parametrize("fmt", ["jsonl", "gz", "parquet", "dataset", "openai"])
def test_each_format_end_to_end(tmp_path, fmt):
    rows = prompts(6)
    if fmt == "jsonl":
        src = write_jsonl(tmp_path / "in.jsonl", rows)
    elif fmt == "gz":
        src = tmp_path / "in.jsonl.gz"
        src.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows)))
    elif fmt == "parquet":
        src = tmp_path / "in.parquet"
        _parquet(src, rows)
    elif fmt == "dataset":
        datasets = pytest.importorskip("datasets")
        src = tmp_path / "in_ds"
        datasets.Dataset.from_list(rows).save_to_disk(str(src))
    else:
        src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": r["id"], "body": {"prompt": r["prompt"]}}
                                                  for r in rows])
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    got = read_output(out)
    assert [r["row_id"] for r in got] == [r["id"] for r in rows]
    assert all(r["status"] == "ok" and r["output"] for r in got)


def test_json_array_and_empty_inputs(tmp_path, capsys):
    (tmp_path / "arr.jsonl").write_text('[{"prompt": "a"}]\n')
    with pytest.raises(UsageError, match="looks like a JSON array"):
        resolve_inputs([str(tmp_path / "arr.jsonl")])
    (tmp_path / "a_empty.jsonl").write_text("")
    write_jsonl(tmp_path / "b.jsonl", ROWS[:3])
    assert run_cli(["generate", str(tmp_path / "a_empty.jsonl"), str(tmp_path / "b.jsonl"), "-o",
                    str(tmp_path / "out")]) == 0
    assert "a_empty.jsonl: empty file" in capsys.readouterr().err
    assert len(read_output(tmp_path / "out")) == 3
    assert run_cli(["generate", str(tmp_path / "a_empty.jsonl"), "-o", str(tmp_path / "out2")]) == 2
    assert "a_empty.jsonl: no rows (empty file)" in capsys.readouterr().err


def test_corrupt_row_group_mid_run_is_fatal_and_keeps_earlier_rows(tmp_path, capsys):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(prompts(20)), path, row_group_size=10, compression="none")
    col = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    data[col.data_page_offset: col.data_page_offset + 40] = b"\xff" * 40  # clobber a page header
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert run_cli(["generate", str(path), "-o", str(out), "--commit-rows", "5"]) == 1
    err = capsys.readouterr().err
    assert "c.parquet: unreadable Parquet at row 10" in err and "Traceback" not in err
    assert len(read_output(out)) == 10  # the good row group was committed
