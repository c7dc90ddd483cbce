"""Each input format, and each way an input can be unreadable, through ``dspine_batch.inputs.sources``."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.errors import FatalError, RowError, UsageError
from dspine_batch.inputs.sources import iter_inputs, peek_rows, resolve_inputs

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
    assert "malformed JSON" in str(errs[0]) and "bad.jsonl: line 2" in str(errs[0])
    assert "expected a JSON object, got list" in str(errs[1])
    assert "not valid UTF-8" in str(errs[2]) and "line 4" in str(errs[2])


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
             {"custom_id": "q2", "body": {"model": "x", "messages": [], "web_search_options": {}}}]
    p = write_jsonl(tmp_path / "batch.jsonl", lines)
    files = resolve_inputs([str(p)])
    assert files[0].kind == "openai"
    rows = [r for _, r in _all_rows(files)]
    assert rows[0] == {"custom_id": "q1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                       "temperature": 0.2}
    assert rows[1] == {"custom_id": "q2", "messages": [], "web_search_options": {}}  # the mapper refuses it


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


def _compress(fmt, data):
    if fmt == "gz":
        return gzip.compress(data)
    zstd = pytest.importorskip("zstandard")
    return zstd.ZstdCompressor(write_checksum=True).compress(data)


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_utf8_bom_is_stripped_and_the_first_row_kept(tmp_path, suffix):
    data = "\ufeff".encode() + b"".join(json.dumps(r).encode() + b"\n" for r in ROWS[:3])
    path = tmp_path / f"bom.{suffix}"
    path.write_bytes(data if suffix == "jsonl" else _compress(suffix.rsplit(".", 1)[1], data))
    files = resolve_inputs([str(path)])
    assert [(i, r) for i, r in _all_rows(files)] == list(enumerate(ROWS[:3]))


def test_utf8_bom_before_an_openai_batch_line_or_a_json_array(tmp_path):
    line = json.dumps({"custom_id": "q1", "body": {"prompt": "hi"}}).encode()
    (tmp_path / "batch.jsonl").write_bytes(b"\xef\xbb\xbf" + line + b"\n")
    files = resolve_inputs([str(tmp_path / "batch.jsonl")])
    assert files[0].kind == "openai" and [r for _, r in _all_rows(files)] == [{"custom_id": "q1", "prompt": "hi"}]
    (tmp_path / "arr.jsonl").write_bytes(b'\xef\xbb\xbf[{"prompt": "a"}]\n')
    with pytest.raises(UsageError, match="looks like a JSON array"):
        resolve_inputs([str(tmp_path / "arr.jsonl")])


def test_a_file_that_is_not_utf8_says_so(tmp_path, capsys):
    latin1 = [json.dumps({"prompt": f"caf\u00e9 {i}"}, ensure_ascii=False).encode("latin-1") for i in range(3)]
    path = write_jsonl(tmp_path / "latin1.jsonl", [], latin1)
    assert run_cli(["generate", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "latin1.jsonl: not UTF-8 text: 3 lines could not be decoded (first: latin1.jsonl: line 1" in err
    assert "empty" not in err and "Traceback" not in err
    (tmp_path / "u16.jsonl").write_bytes('{"prompt": "a"}\n'.encode("utf-16"))
    with pytest.raises(UsageError, match="u16.jsonl: UTF-16 text"):
        resolve_inputs([str(tmp_path / "u16.jsonl")])


def test_bad_rows_before_the_first_good_one_are_row_errors(tmp_path):
    path = write_jsonl(tmp_path / "late.jsonl", [], [b"{nope"] * 150 + [b'{"id": "x", "prompt": "ok"}'])
    out = tmp_path / "out"
    assert run_cli(["generate", str(path), "-o", str(out), "--max-error-rate", "1"]) == 0
    rows = read_output(out)
    assert [r["status"] for r in rows].count("error") == 150 and rows[-1]["row_id"] == "x"
    path = write_jsonl(tmp_path / "junk.jsonl", [], [b"{nope", b"[1]"])
    first = r"\(first: junk.jsonl: line 1: malformed"
    with pytest.raises(UsageError, match=r"junk.jsonl: no usable row: all 2 rows are errors " + first):
        peek_rows(resolve_inputs([str(path)])[0])


def _damage(fmt, how):
    data = _compress(fmt, b"".join(json.dumps(r).encode() + b"\n" for r in prompts(2000)))
    if how == "truncated":
        return data[: len(data) // 2]
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0x5A for b in data[mid:mid + 16]) + data[mid + 16:]


@pytest.mark.parametrize(("fmt", "how"), [("gz", "truncated"), ("gz", "corrupt"), ("zst", "truncated"),
                                          ("zst", "corrupt")])
def test_damaged_compressed_input_is_refused_before_any_work(tmp_path, capsys, fmt, how):
    path = tmp_path / f"d.jsonl.{fmt}"
    path.write_bytes(_damage(fmt, how))
    with pytest.raises(UsageError, match=f"d.jsonl.{fmt}: damaged {'gzip' if fmt == 'gz' else 'zstd'} data"):
        resolve_inputs([str(path)])
    out = tmp_path / "out"
    assert run_cli(["generate", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated or corrupt" in err[0] and str(path) in err[0]
    assert not out.exists()  # refused before the output folder, its lock or any part existed


def test_not_gzip_at_all_and_multi_frame_zstd(tmp_path):
    (tmp_path / "plain.jsonl.gz").write_bytes(b'{"prompt": "a"}\n')
    with pytest.raises(UsageError, match="plain.jsonl.gz: damaged gzip data.*Not a gzipped file"):
        resolve_inputs([str(tmp_path / "plain.jsonl.gz")])
    zstd = pytest.importorskip("zstandard")
    frames = [zstd.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in part))
              for part in (ROWS[:4], ROWS[4:])]  # as `cat a.zst b.zst` or pzstd make
    (tmp_path / "two.jsonl.zst").write_bytes(b"".join(frames))
    assert [r for _, r in _all_rows(resolve_inputs([str(tmp_path / "two.jsonl.zst")]))] == ROWS


def test_input_damaged_during_the_run_is_fatal_with_file_name(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(_compress("gz", b"".join(json.dumps(r).encode() + b"\n" for r in prompts(2000))))
    files = resolve_inputs([str(path)])
    path.write_bytes(_damage("gz", "truncated"))  # replaced after the up-front check
    with pytest.raises(FatalError, match="t.jsonl.gz: unreadable after row"):
        _all_rows(files)


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


# -- a resume's start at a watermark (``Start``) ------------------------------------------------------------------
def _from(files, starts):
    out = []
    for b in iter_inputs(files, None, starts=starts):
        rows = [str(r) if isinstance(r, RowError) else r for r in b.rows]
        out.extend(zip(b.indices, rows, b.ends or [None] * len(b), strict=True))
    return out


def test_parquet_start_skips_whole_row_groups_unread(tmp_path, monkeypatch):
    from dspine_batch.inputs import sources

    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(1000)]}), tmp_path / "a.parquet", row_group_size=64)
    files = resolve_inputs([str(tmp_path / "a.parquet")])
    read: list[int] = []
    real = sources.parquet_file

    def spy(path):
        pf = real(path)
        inner = pf.iter_batches

        def iter_batches(*args, row_groups, **kwargs):
            read.extend(row_groups)
            return inner(*args, row_groups=row_groups, **kwargs)

        pf.iter_batches = iter_batches
        return pf

    monkeypatch.setattr(sources, "parquet_file", spy)
    got = _from(files, {files[0].name: sources.Start(700)})
    assert [i for i, _, _ in got] == list(range(700, 1000))
    assert [r["prompt"] for _, r, _ in got] == [f"p{i}" for i in range(700, 1000)]
    assert read == list(range(700 // 64, 16))  # the 10 row groups before row 700 are never read


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_start_at_a_byte_offset_gives_the_same_rows(tmp_path, suffix):
    from dspine_batch.inputs.sources import Start

    lines = [json.dumps(r).encode() for r in prompts(50)]
    lines[20:20] = [b"", b"{broken"]  # a blank line and a bad one: line numbers, not rows, are positions
    data = b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n"  # a byte-order mark: not part of line 0, still counted
    if suffix == ".jsonl.gz":
        data = gzip.compress(data)
    elif suffix == ".jsonl.zst":
        data = pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    (tmp_path / f"a{suffix}").write_bytes(data)
    files = resolve_inputs([str(tmp_path / f"a{suffix}")])
    full = _from(files, None)
    name = files[0].name
    for k in (1, 19, 21, 30, len(full) - 1):
        index, _, _ = full[k]
        end_before = full[k - 1][2]
        assert _from(files, {name: Start(full[k - 1][0] + 1, end_before)}) == full[k:]
        assert index >= full[k - 1][0] + 1
    # an offset that does not sit after a newline is not trusted: everything is read, as without a start
    assert _from(files, {name: Start(full[5][0] + 1, full[5][2] - 3)}) == full


def test_arrow_and_hf_datasets_start_by_index(tmp_path):
    from dspine_batch.inputs.sources import Start

    datasets = pytest.importorskip("datasets")
    rows = prompts(30)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    _parquet(repo / "train-00000-of-00001.parquet", rows)
    for files in (resolve_inputs([str(tmp_path / "ds")]), resolve_inputs([str(tmp_path / "repo")], split="train")):
        got = _from(files, {files[0].name: Start(17)})
        assert [(i, r) for i, r, _ in got] == list(enumerate(rows))[17:]
