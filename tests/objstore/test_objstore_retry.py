"""``--retry-errors`` / ``--retry-length`` on an ``s3://`` OUTDIR (issue 39 with issue 40's retries), against a real
S3 server on 127.0.0.1: only the failed rows are generated again, every reader sees each row once (its latest
attempt), the records check out afterwards; a kill -9 during the retry resumes exactly once (started at once); a
crash inside a part's take-out rolls forward or back (``remote_supersede``); a lost answer to a record swap or to
the manifest's update is read back, never taken for a conflict; a fixed input is refused in one line."""

from __future__ import annotations

import json
import signal
import time

import pytest
from faultproxy import FaultProxy
from helpers import Counting, prompts, run_cli, spawn, write_jsonl
from test_objstore_crash import _assert_clean
from test_objstore_generate import read_s3_output

from dspine_batch.outdir import supersede as remote_supersede
from dspine_batch.outdir.output import open_output

TAG = "00000-of-00001"


def _ids(s3, prefix: str) -> list[str]:
    return [r["row_id"] for r in read_s3_output(s3, prefix)]


def test_retry_errors_and_length_on_s3(tmp_path, s3, bucket, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(21))
    prefix = f"{bucket}/retry"
    args = ["generate", str(src), "-o", f"s3://{prefix}", "--max-error-rate", "1", "--max-new-tokens", "20",
            "--engine-arg", "latency=0.001", "--commit-rows", "4"]
    assert run_cli([*args, "--request-timeout", "0.3", "--engine-arg", "hang_every=5"]) == 0
    rows = read_s3_output(s3, prefix)
    failed = sorted(r["row_id"] for r in rows if r["status"] == "error")
    assert failed and s3.exists(f"{prefix}/_SUCCESS")
    engine = Counting()
    capfd.readouterr()
    assert run_cli([*args, "--retry-errors"], loader=engine) == 0  # the engine no longer hangs
    assert f"{len(failed)} error rows taken out of" in capfd.readouterr().err
    assert sorted(engine.rows) == failed  # only the failed rows went to the engine
    rows = read_s3_output(s3, prefix)
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in prompts(21))  # each row once
    assert all(r["status"] == "ok" for r in rows)
    assert s3.exists(f"{prefix}/_SUCCESS")  # the run that finished the retry wrote it again
    _assert_clean(s3, prefix)
    duckdb = pytest.importorskip("duckdb")  # a reader we did not write, through the same server
    con = duckdb.connect()
    files = [f"s3://{p}" for p in s3.glob(f"{prefix}/*.parquet")]
    local = tmp_path / "copy"
    local.mkdir()
    for f in files:
        s3.get_file(f, str(local / f.rsplit("/", 1)[-1]))
    n, distinct = con.execute(f"select count(*), count(distinct row_id) from '{local}/*.parquet'").fetchone()
    assert n == distinct == 21

    cut = sorted(r["row_id"] for r in rows if r["finish_reason"] == "length")
    assert cut
    engine.rows.clear()
    capfd.readouterr()
    longer = [a if a != "20" else "64" for a in args]
    assert run_cli([*longer, "--retry-length"], loader=engine) == 0
    assert "--max-new-tokens 20 -> 64 for the retried rows" in capfd.readouterr().err
    assert sorted(engine.rows) == cut
    rows = read_s3_output(s3, prefix)
    assert len(rows) == 21 and not any(r["finish_reason"] == "length" for r in rows)
    manifest = json.loads(s3.cat_file(f"{prefix}/_manifest.json"))
    assert manifest["fingerprint_fields"]["settings"]["max_new_tokens"] == 64 and len(manifest["retries"]) == 1
    engine.rows.clear()
    capfd.readouterr()
    assert run_cli([*longer, "--on-damaged-part", "fail"], loader=engine) == 0  # records check out; nothing left
    assert engine.rows == [] and "(0 this run, 21 were already committed)" in capfd.readouterr().err


def test_a_kill_during_the_retry_on_s3_resumes_exactly_once(tmp_path, s3, s3env, bucket):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    prefix = f"{bucket}/kill"
    args = ["generate", str(src), "-o", f"s3://{prefix}", "--max-error-rate", "1", "--commit-rows", "1",
            "--max-in-flight", "1"]
    assert run_cli([*args, "--request-timeout", "0.2", "--engine-arg", "hang_every=3",
                    "--engine-arg", "latency=0.001"]) == 0
    failed = {r["row_id"] for r in read_s3_output(s3, prefix) if r["status"] == "error"}
    assert len(failed) > 5
    before = set(s3.glob(f"{prefix}/*.parquet"))
    p = spawn([*args, "--retry-errors", "--engine-arg", "latency=0.3"], **s3env)
    deadline = time.monotonic() + 90
    while not (set(s3.glob(f"{prefix}/*.parquet")) - before) and time.monotonic() < deadline:
        time.sleep(0.05)  # a new part: the take-out is done and the retry commits
    assert p.poll() is None, p.communicate()[1].decode()  # the kill hits a live worker, mid-retry
    p.kill()
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    ids = _ids(s3, prefix)
    assert len(ids) == len(set(ids)) < 40  # mid-retry: each row at most once, the rest not committed yet
    assert not s3.exists(f"{prefix}/_SUCCESS")  # not complete while failed rows are out
    assert s3.exists(f"{prefix}/_dspine/lease-{TAG}.json")  # the dead worker's lease: taken over at once
    assert run_cli([*args, "--engine-arg", "latency=0.001"]) == 0  # the same command, at once, resumes the retry
    rows = read_s3_output(s3, prefix)
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in prompts(40))
    assert all(r["status"] == "ok" for r in rows if r["row_id"] in failed)
    _assert_clean(s3, prefix)


def test_a_crash_inside_a_take_out_on_s3_rolls_forward_or_back(tmp_path, s3, bucket, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    prefix = f"{bucket}/crash"
    assert run_cli(["generate", str(src), "-o", f"s3://{prefix}"]) == 0
    out = open_output(f"s3://{prefix}")
    part = out.part_urls()[0]

    def crash(*a, **k):
        raise KeyboardInterrupt("killed after the record swap, before the publish")

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):  # (undo() would drop s3env's variables)
        m.setattr(out, "publish", crash)
        out.drop_rows(TAG, part, {"r00001", "r00002"})
    assert len(_ids(s3, prefix)) == 10  # readers still see the old part: nothing regenerated yet, no duplicate
    assert "finished replacing" in open_output(f"s3://{prefix}").recover_retry(TAG)
    out = open_output(f"s3://{prefix}")
    done = out.load_done(TAG, on_damaged="fail")
    assert (done.rows, done.damaged) == (8, 0)  # the published part checks out against its new record
    assert sorted(_ids(s3, prefix)) == [f"r{i:05d}" for i in range(10) if i not in (1, 2)]

    def crash_on_swap(*a, **k):
        raise KeyboardInterrupt("killed after the journal, before the record swap")

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(out.store, "replace", crash_on_swap)
        out.drop_rows(TAG, part, {"r00003"})
    fresh = open_output(f"s3://{prefix}")
    assert "left as it was" in fresh.recover_retry(TAG)
    assert fresh.recover_retry(TAG) is None  # the journal is gone
    assert (fresh.load_done(TAG, on_damaged="fail").rows, len(_ids(s3, prefix))) == (8, 8)
    assert not s3.exists(f"{prefix}/{remote_supersede.journal_rel(TAG)}")
    fresh.remove_staging(TAG)
    _assert_clean(s3, prefix)

    # a part whose every row is taken out goes, record first
    gone = fresh.drop_rows(TAG, part, {f"r{i:05d}" for i in range(10)})
    assert gone == 8 and _ids(s3, prefix) == [] and not s3.glob(f"{prefix}/_dspine/keys/commit-*.json")


def test_on_s3_a_changed_input_is_checked_line_by_line_as_on_a_local_disk(tmp_path, s3, bucket, capfd):
    """The row record lives on the store too, so --retry-errors proves a fixed input there as it does locally: a
    changed line whose row did not fail is refused in one line, naming the line, before the model loads (the
    one-path matrix's retry cells show a fixed failed line accepted on s3:// and az://)."""
    rows = prompts(6)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = f"s3://{bucket}/fixed"
    args = ["generate", str(src), "-o", out, "--engine-arg", "error_every=3", "--max-error-rate", "1"]
    assert run_cli(args) == 0
    ok = {r["row_id"] for r in read_s3_output(s3, f"{bucket}/fixed") if r["status"] == "ok"}
    k = next(i for i, r in enumerate(rows) if r["id"] in ok)
    write_jsonl(src, [*rows[:k], {**rows[k], "prompt": "changed"}, *rows[k + 1:]])
    capfd.readouterr()
    assert run_cli([*args, "--retry-errors"]) == 2
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("dspine-batch: error")]
    assert len(lines) == 1 and f"line {k + 1} changed, but its row did not fail" in lines[0], err
    assert "Traceback" not in err and "loading the model" not in err


def test_a_lost_answer_to_a_record_swap_or_the_manifest_update_is_read_back_on_s3(tmp_path, s3, s3env, s3_endpoint,
                                                                                 bucket):
    lost_answers_of_swaps(tmp_path, s3, "s3", f"{bucket}/lost", lambda url: {"AWS_ENDPOINT_URL": url}, s3_endpoint)


def lost_answers_of_swaps(tmp_path, fs, scheme: str, prefix: str, via, endpoint: str) -> None:
    """``--retry-errors`` then ``--retry-length`` through a proxy that lets the first attempt of every compare-and-
    swap (``If-Match``) of a commit record or the manifest reach the store and loses its answer: the client's retry
    meets 412 (the ETag is the new body's now). Read back by token (the record) or by content (the manifest), each
    is our own write: the retried rows are generated once, every part checks out against its record, nothing is
    damaged. Taken for a conflict instead, the staged part the new record points at was deleted (any store:
    ``test_objstore_azure`` runs it too; ``via(url)`` is the environment that sends a worker through ``url``)."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(21))
    args = ["generate", str(src), "-o", f"{scheme}://{prefix}", "--max-error-rate", "1", "--max-new-tokens", "20",
            "--engine-arg", "latency=0.001", "--commit-rows", "4"]
    assert run_cli([*args, "--request-timeout", "0.3", "--engine-arg", "hang_every=5"]) == 0
    failed = sorted(r["row_id"] for r in read_s3_output(fs, prefix) if r["status"] == "error")
    assert failed
    swaps: set[bytes] = set()

    def hook(chunk: bytes) -> object:
        if chunk.startswith(b"PUT ") and b"\r\nif-match:" in chunk.lower():
            path = chunk.split(b" ", 2)[1].split(b"?")[0]
            if (b"/_dspine/keys/commit-" in path or path.endswith(b"/_manifest.json")) and path not in swaps:
                swaps.add(path)  # the first swap of each: the store takes it, the client never hears
                return "lose"
        return False

    proxy = FaultProxy(endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    try:
        for cmd in ([*args, "--retry-errors"], [*[a if a != "20" else "64" for a in args], "--retry-length"]):
            p = spawn(cmd, **via(proxy.url))
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err.decode()
    finally:
        proxy.close()
    assert any(b"/_manifest.json" in s for s in swaps) and sum(b"/commit-" in s for s in swaps) >= 2, swaps
    assert proxy.counts["lost"] == len(swaps)
    rows = read_s3_output(fs, prefix)
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in prompts(21))  # each row once
    assert all(r["status"] == "ok" and r["finish_reason"] != "length" for r in rows)
    manifest = json.loads(fs.cat_file(f"{prefix}/_manifest.json"))
    assert manifest["fingerprint_fields"]["settings"]["max_new_tokens"] == 64
    _assert_clean(fs, prefix)
    assert run_cli(["finalize", f"{scheme}://{prefix}", "--on-damaged-part", "fail"]) == 0  # crc32 of every part
