"""``--retry-errors`` (issue 40, item 2): only the failed rows are generated again, from the same settings or from
fixed input lines; readers globbing OUTDIR see every id once; a change to a good line is refused before the model
loads; a kill -9 during the retry resumes exactly once."""

from __future__ import annotations

import json
import os
import signal
import time

import pyarrow.dataset as ds
import pytest
from helpers import Counting, prompts, read_output, run_cli, spawn, write_jsonl

from dspine_batch.outdir import supersede
from dspine_batch.outdir.layout import STAGING
from dspine_batch.outdir.output import list_parts, open_output

TAG = "00000-of-00001"


def _line(cid: str, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"question {cid}"}], **body}}


def _write(path, rows: list) -> None:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))


GOOD = [_line(f"req-{i}") for i in range(12)]
BAD = {3: _line("req-3", temperature="hot"), 6: _line("req-6", frobnicate=1), 9: b'{"custom_id": "req-9", oops'}


def _ids_every_reader_sees(out) -> dict[str, list[str]]:
    seen = {"pyarrow": ds.dataset(str(out), format="parquet").to_table().column("row_id").to_pylist()}
    pd = pytest.importorskip("pandas")
    seen["pandas"] = list(pd.read_parquet(out)["row_id"])
    pl = pytest.importorskip("polars")
    seen["polars"] = pl.scan_parquet(str(out) + "/*.parquet").collect()["row_id"].to_list()
    duckdb = pytest.importorskip("duckdb")
    seen["duckdb"] = [r[0] for r in duckdb.sql(f"select row_id from read_parquet('{out}/*.parquet')").fetchall()]
    datasets = pytest.importorskip("datasets")
    seen["datasets"] = datasets.load_dataset("parquet", data_dir=str(out), split="train")["row_id"]
    return {k: sorted(v) for k, v in seen.items()}


def test_fixed_lines_of_failed_rows_are_retried_alone_and_every_reader_sees_each_row_once(tmp_path, capfd):
    src = tmp_path / "batch.jsonl"
    _write(src, [BAD.get(i, r) for i, r in enumerate(GOOD)])
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--commit-rows", "5"]
    assert run_cli(args) == 3  # 3 of 12 rows failed: over the 5% budget
    before = {r["row_id"]: r for r in read_output(out)}
    assert sorted(r for r, x in before.items() if x["status"] == "error") == ["batch.jsonl:9", "req-3", "req-6"]

    _write(src, GOOD)  # the user fixes the three lines
    engine = Counting()
    capfd.readouterr()
    assert run_cli(args, loader=engine) == 2  # the same command: refused, before the model loads, with the way out
    err = capfd.readouterr().err
    assert "changed: inputs: batch.jsonl changed" in err and "add --retry-errors" in err and engine.opens == 0

    assert run_cli([*args, "--retry-errors"], loader=engine) == 0
    err = capfd.readouterr().err
    assert "accepted the fixed input(s): batch.jsonl (3 failed line(s) changed" in err
    assert "3 error rows taken out of" in err
    assert engine.opens == 1 and sorted(engine.rows) == ["req-3", "req-6", "req-9"]  # only the failed rows
    after = {r["row_id"]: r for r in read_output(out)}
    assert sorted(after) == sorted(f"req-{i}" for i in range(12)) and all(r["status"] == "ok" for r in after.values())
    for rid, row in before.items():  # the rows that had not failed: untouched
        if row["status"] == "ok":
            assert after[rid] == row
    for reader, ids in _ids_every_reader_sees(out).items():
        assert ids == sorted(f"req-{i}" for i in range(12)), reader
    assert run_cli(args, loader=engine) == 0 and engine.opens == 1  # a plain rerun now: nothing left, no model


def test_a_change_to_a_good_line_is_refused_before_the_model_loads(tmp_path, capfd):
    src = tmp_path / "batch.jsonl"
    _write(src, [BAD.get(i, r) for i, r in enumerate(GOOD)])
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--max-error-rate", "1"]
    assert run_cli(args) == 0 and (out / "_SUCCESS").exists()
    parts = sorted(p.path for p in list_parts(str(out)))
    fixed = [GOOD[i] if i in BAD else r for i, r in enumerate(GOOD)]
    fixed[4] = _line("req-4", temperature=0.3)  # a good row's line changed too
    _write(src, fixed)
    engine = Counting()
    capfd.readouterr()
    assert run_cli([*args, "--retry-errors"], loader=engine) == 2
    err = capfd.readouterr().err
    assert "batch.jsonl: line 5 changed, but its row did not fail" in err and engine.opens == 0
    assert sorted(p.path for p in list_parts(str(out))) == parts and len(read_output(out)) == 12  # as it was
    fixed[4] = GOOD[4]
    fixed.insert(0, _line("req-new"))  # rows moved: refused too
    _write(src, fixed)
    assert run_cli([*args, "--retry-errors"], loader=engine) == 2 and engine.opens == 0
    assert "rows were added, removed or moved" in capfd.readouterr().err


def test_retry_with_the_same_settings_and_rows_cut_by_length(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(21))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--max-error-rate", "1", "--max-new-tokens", "20",
            "--engine-arg", "latency=0.001"]
    assert run_cli([*args, "--request-timeout", "0.3", "--engine-arg", "hang_every=5"]) == 0
    rows = read_output(out)
    failed = sorted(r["row_id"] for r in rows if r["status"] == "error")
    cut = sorted(r["row_id"] for r in rows if r["finish_reason"] == "length")
    assert failed and cut
    engine = Counting()
    assert run_cli([*args, "--retry-errors"], loader=engine) == 0  # the engine no longer hangs
    assert sorted(engine.rows) == failed
    rows = read_output(out)
    assert len(rows) == 21 and all(r["status"] == "ok" for r in rows)
    cut = sorted(r["row_id"] for r in rows if r["finish_reason"] == "length")  # retried rows may be cut too
    engine.rows.clear()
    capfd.readouterr()
    longer = [a if a != "20" else "64" for a in args]
    assert run_cli([*longer, "--retry-length"], loader=engine) == 0  # more room for the rows cut by length
    assert "--max-new-tokens 20 -> 64 for the retried rows" in capfd.readouterr().err
    assert sorted(engine.rows) == cut
    assert len(read_output(out)) == 21 and not any(r["finish_reason"] == "length" for r in read_output(out))
    assert run_cli(longer, loader=engine) == 0  # the manifest took the new limit: a plain rerun resumes


def test_a_kill_during_the_retry_resumes_exactly_once(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--max-error-rate", "1", "--commit-rows", "1",
            "--max-in-flight", "1"]
    assert run_cli([*args, "--request-timeout", "0.2", "--engine-arg", "hang_every=3",
                    "--engine-arg", "latency=0.001"]) == 0
    failed = {r["row_id"] for r in read_output(out) if r["status"] == "error"}
    assert len(failed) > 5 and (out / "_SUCCESS").exists()
    first_new = max(p.seq for p in list_parts(str(out))) + 1
    p = spawn([*args, "--retry-errors", "--engine-arg", "latency=0.3"])
    deadline = time.monotonic() + 60
    while not any(q.seq >= first_new for q in list_parts(str(out))) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, "the retry ended before the kill"  # the kill hits a live worker, mid-retry
    assert any(q.seq >= first_new for q in list_parts(str(out))), "no retried part was committed before the kill"
    p.kill()
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    rows = read_output(out)
    ids = [r["row_id"] for r in rows]
    assert len(ids) == len(set(ids)) < 40  # mid-retry: each row at most once, the rest not committed yet
    assert not (out / "_SUCCESS").exists()  # not complete while failed rows are out
    assert run_cli([*args, "--engine-arg", "latency=0.001"]) == 0  # the same command resumes the retry
    rows = read_output(out)
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in prompts(40))
    assert all(r["status"] == "ok" for r in rows if r["row_id"] in failed)


def test_a_crash_inside_a_supersede_rolls_forward_or_back(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    part = list_parts(str(out))[0].path
    o = open_output(str(out))

    def crash(*a, **kw):
        raise KeyboardInterrupt("killed between the record swap and the publish")

    monkeypatch.setattr(o, "publish", crash)
    with pytest.raises(KeyboardInterrupt):
        supersede.drop_rows(o, TAG, os.path.basename(part), {"r00001", "r00002"})
    monkeypatch.undo()
    assert "finished replacing" in supersede.recover(open_output(str(out)), TAG)
    done = open_output(str(out)).load_done(TAG)
    assert (done.rows, done.damaged) == (8, 0)  # the part checks out against its new record

    def crash_on_the_swap(*a, **kw):
        raise KeyboardInterrupt("killed after the journal, before the swap")

    monkeypatch.setattr(supersede, "_swap", crash_on_the_swap)
    with pytest.raises(KeyboardInterrupt):
        supersede.drop_rows(open_output(str(out)), TAG, os.path.basename(part), {"r00003"})
    monkeypatch.undo()
    assert "left as it was" in supersede.recover(open_output(str(out)), TAG)
    assert not os.listdir(out / STAGING)
    assert open_output(str(out)).load_done(TAG).rows == 8
    assert supersede.recover(open_output(str(out)), TAG) is None
