"""An exactly-once OUTDIR on Azure Blob Storage (``az://``, ``abfs://``), against a real Azurite on 127.0.0.1
(``conftest``), through the same commit protocol as S3: generate from a local input gives the local run's rows;
kill -9 at exact steps of a commit and at a random moment, then the same command at once, leaves every row exactly
once, orphans swept, and ``finalize`` writes ``_SUCCESS``; a second worker on a live shard exits 75 naming the
holder, and after the holder's kill -9 the same command at once takes over; a paused worker whose lease was taken
cannot commit; 503s, drops and lost answers are retried to the same rows; ``--retry-errors`` swaps records by
compare-and-swap, and a lost answer to a swap is read back; pyarrow, pandas and duckdb (through
adlfs) read exactly the committed rows; the account key is in no log, manifest, state file or error; a missing
container is one line. Waits poll the store for a state, never a fixed time."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import AZURITE_KEY, azurite_connection_string
from faultproxy import FaultProxy
from foreign_readers import counts_elsewhere
from helpers import prompts, read_output, run_cli, spawn, write_jsonl
from test_objstore_crash import (
    _assert_clean,
    _exactly_once,
    _wait,
    paused_worker_cannot_commit,
    second_worker_then_takeover,
)
from test_objstore_generate import read_s3_output
from test_objstore_retry import lost_answers_of_swaps

GEN = ["--num-samples", "2", "--temperature", "0.8", "--seed", "5", "--commit-rows", "7"]
KILL = ["--num-samples", "2", "--temperature", "0.8", "--seed", "11", "--max-in-flight", "8", "--commit-rows", "5",
        "--commit-seconds", "0.05", "--engine-arg", "latency=0.03", "--max-error-rate", "1"]
N = 50


def test_az_outdir_equals_the_local_run_and_readers_see_exactly_the_committed_rows(tmp_path, az, azenv, container,
                                                                                  capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(prompts(N)), src)
    assert run_cli(["generate", str(src), *GEN, "-o", str(tmp_path / "ref")]) == 0
    prefix = f"{container}/out/2026-12-05"
    out = f"az://{prefix}"
    assert run_cli(["generate", str(src), *GEN, "-o", out]) == 0
    assert not Path("az:").exists() and not (tmp_path / "az:").exists()
    want = read_output(tmp_path / "ref")
    assert len(want) == 2 * N and read_s3_output(az, prefix) == want
    assert az.exists(f"{prefix}/_SUCCESS") and az.exists(f"{prefix}/_manifest.json")
    _assert_clean(az, prefix)
    capsys.readouterr()
    assert run_cli(["generate", str(src), *GEN, "-o", out]) == 0  # a rerun resumes: nothing left
    assert "nothing left to do" in capsys.readouterr().err
    # the same OUTDIR by its abfs:// name: the ops read it
    assert run_cli(["status", f"abfs://{prefix}", "--json", "--verify"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["rows_done"] == N and st["complete"] and not st["damaged_parts"] and st["parts_verified"] == st["parts"]
    assert run_cli(["finalize", out]) == 0
    # what a crashed writer leaves under _dspine is never read by readers globbing OUTDIR/*.parquet
    az.put_file(str(src), f"{prefix}/_dspine/staging/train-00000-of-00001-000099.parquet.deadbeef")
    got = counts_elsewhere({"store": "az", "prefix": prefix, "conn": azenv["AZURE_STORAGE_CONNECTION_STRING"]})
    assert got == dict.fromkeys(["pyarrow+adlfs", "parquet-footers", "pandas", "duckdb"], 2 * N)


def test_kill9_during_commits_and_at_random_resumes_exactly_once(tmp_path, az, azenv, azurite_endpoint, container):
    rows = 80
    src = write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    args = ["generate", str(src), *KILL]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    prefix = f"{container}/out"
    out = f"az://{prefix}"
    worker: dict[str, int] = {}
    seen = {"record": 0, "copy": 0}
    plan: dict[str, int] = {}
    killed: list[str] = []

    def hook(chunk: bytes) -> bool:
        """Kill the worker before the store sees its k-th commit-record Put Blob, or its k-th Copy Blob."""
        for step, marker in (("record", b"/_dspine/keys/commit-"), ("copy", b"x-ms-copy-source")):
            if chunk.startswith(b"PUT ") and marker in chunk:
                seen[step] += 1
                if plan.get(step) == seen[step] and "pid" in worker:
                    os.kill(worker.pop("pid"), signal.SIGKILL)
                    killed.append(step)
                    return True
        return False

    proxy = FaultProxy(azurite_endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    via_proxy = azurite_connection_string(proxy.url)
    rng = random.Random(7)
    records = f"{prefix}/_dspine/keys/commit-*.json"
    left: list[list[str]] = []  # the staging area after each kill
    try:
        # 1: uploaded, record not created (an orphan); 2: record created, publish not done; 3: a random moment
        # after this start's first commit
        for step in ("record", "copy", None):
            seen.update(record=0, copy=0)
            plan.clear()
            if step:
                plan[step] = rng.randint(1, 3)
            before = len(az.glob(records))
            p = spawn([*args, "-o", out], AZURE_STORAGE_CONNECTION_STRING=via_proxy, DSPINE_BATCH_LEASE_SECONDS="60")
            worker["pid"] = p.pid
            if step is None:
                _wait(lambda n=before, w=p: len(az.glob(records)) > n or w.poll() is not None, "the worker committed")
                time.sleep(rng.uniform(0.02, 0.2))
                if p.poll() is None:
                    os.kill(worker.pop("pid"), signal.SIGKILL)
                    killed.append("random")
            _, err = p.communicate(timeout=300)
            worker.pop("pid", None)
            assert p.returncode in (0, -signal.SIGKILL), err.decode()
            if p.returncode == 0:
                break
            left.append(az.ls(f"{prefix}/_dspine/staging", detail=False))  # the next start: at once
    finally:
        proxy.close()
    assert killed[:2] == ["record", "copy"] and len(killed) >= 3, killed
    assert left[0] and left[1]  # an orphan upload; a committed part whose publish did not happen
    p = spawn([*args, "-o", out], DSPINE_BATCH_LEASE_SECONDS="60")  # a dead holder's: never waited for
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    assert "waiting up to" not in err.decode() and "(its process is gone)" in err.decode(), err.decode()
    _exactly_once(az, prefix, tmp_path / "ref", rows)
    _assert_clean(az, prefix)  # orphans swept, interrupted publishes finished
    az.rm_file(f"{prefix}/_SUCCESS")
    assert run_cli(["finalize", out]) == 0
    assert az.exists(f"{prefix}/_SUCCESS")


def test_a_live_holder_ends_a_second_start_with_75_and_a_rerun_after_its_kill9_resumes_at_once(tmp_path, az, azenv,
                                                                                               container, capsys):
    second_worker_then_takeover(tmp_path, capsys, az, "az", f"{container}/out", KILL[:-4], rows=40, lease_s="2")


def test_faults_between_us_and_azure_still_exactly_once(tmp_path, az, azenv, azurite_endpoint, container):
    """503s, dropped connections and answers cut after the store did the work (a create-only write retried after
    its answer was lost meets 409 BlobAlreadyExists and finds its own record): retried, and exactly once. The SDK
    keeps connections alive, so a run sees a handful of faults rather than S3's dozens."""
    rows = 60
    src = write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    args = ["generate", str(src), *KILL]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    proxy = FaultProxy(azurite_endpoint, seed=4, p503=0.2, pdrop=0.1, pdelay=0.05, pcut=0.05,
                       first=("503", "drop", "delay", "503", "drop"))
    try:
        p = spawn([*args, "-o", f"az://{container}/out"], AZURE_STORAGE_CONNECTION_STRING=azurite_connection_string(
            proxy.url), DSPINE_BATCH_LEASE_SECONDS="60")  # expiry is not under test: retries never outlast it
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
    finally:
        proxy.close()
    assert proxy.counts["503"] > 0 and proxy.counts["drop"] > 0, proxy.counts
    _exactly_once(az, f"{container}/out", tmp_path / "ref", rows)
    _assert_clean(az, f"{container}/out")


def test_a_worker_whose_lease_was_taken_over_cannot_commit(container):
    """A paused worker whose lease was taken over: its lease check stops it, and past that the create-only
    commit record does (Put Blob with ``If-None-Match: *``)."""
    paused_worker_cannot_commit(f"az://{container}/out")


def test_no_account_key_anywhere_and_a_missing_container_is_one_line(tmp_path, az, azenv, container, capsys,
                                                                     monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(12))
    conn = azenv["AZURE_STORAGE_CONNECTION_STRING"]
    capsys.readouterr()
    out = f"az://{container}/sec"
    assert run_cli(["generate", str(src), "-o", out, "--commit-rows", "5"]) == 0  # the key from the environment
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    opt = ["--storage-option", f"connection_string={conn}"]  # and from --storage-option
    assert run_cli(["status", out, *opt]) == 0
    assert run_cli(["report", out, *opt]) == 0
    bad = ["--storage-option", f"connection_string=AccountName=x;AccountKey={AZURITE_KEY};Bogus"]

    def err(args: list[str], code: int) -> str:
        capsys.readouterr()
        rc = run_cli(args)
        e = capsys.readouterr().err.strip()
        assert rc == code and "Traceback" not in e and len(e.splitlines()) == 1, (rc, e)
        return e

    e = err(["generate", str(src), "-o", f"az://{container}/bad", *bad], 2)
    assert "cannot open az://" in e and AZURITE_KEY not in e and AZURITE_KEY[:12] not in e
    e = err(["generate", str(src), "-o", "az://no-such-container/out", *opt], 1)
    assert "no such container" in e and "no-such-container" in e
    logs = capsys.readouterr()
    stored = b"".join(az.cat_file(p) for p in az.find(f"{container}") if not p.endswith(".parquet"))
    names = {p.rsplit("/", 1)[-1] for p in az.find(f"{container}")}
    assert {"_manifest.json", "_report.json", "state-00000-of-00001.json"} <= names, names
    for s in (AZURITE_KEY, AZURITE_KEY[:12]):
        assert s not in logs.out and s not in logs.err and s.encode() not in stored
    assert not az.exists(f"{container}/bad/_manifest.json")  # nothing half-committed


def test_retry_errors_on_az_takes_out_only_the_failed_rows(tmp_path, az, container, capfd):
    """``--retry-errors`` rewrites committed parts with a compare-and-swap of their records (``remote_supersede``):
    on Azure as on S3, only the failed rows go to the engine again and every reader sees each row once."""
    from helpers import Counting

    src = write_jsonl(tmp_path / "in.jsonl", prompts(21))
    prefix = f"{container}/retry"
    args = ["generate", str(src), "-o", f"az://{prefix}", "--max-error-rate", "1", "--max-new-tokens", "20",
            "--engine-arg", "latency=0.001", "--commit-rows", "4"]
    assert run_cli([*args, "--request-timeout", "0.3", "--engine-arg", "hang_every=5"]) == 0
    failed = sorted(r["row_id"] for r in read_s3_output(az, prefix) if r["status"] == "error")
    assert failed
    engine = Counting()
    capfd.readouterr()
    assert run_cli([*args, "--retry-errors"], loader=engine) == 0
    assert f"{len(failed)} error rows taken out of" in capfd.readouterr().err
    assert sorted(engine.rows) == failed
    rows = read_s3_output(az, prefix)
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in prompts(21))
    assert all(r["status"] == "ok" for r in rows) and az.exists(f"{prefix}/_SUCCESS")
    _assert_clean(az, prefix)
    assert not az.exists(f"{prefix}/_dspine/supersede-00000-of-00001.json")


def test_compact_and_sharded_dedup_on_az(tmp_path, az, azenv, container):
    """The store-independent steps on Azure too: ``finalize --compact`` (journal, merged part committed, old parts
    deleted) and a staged job's dedup across two shards at once (its key log: create-only blobs)."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(prompts(40)), src)
    prefix = f"{container}/compact"
    assert run_cli(["generate", str(src), "--commit-rows", "4", "-o", f"az://{prefix}"]) == 0
    before = read_s3_output(az, prefix)
    assert len(az.glob(f"{prefix}/*.parquet")) == 10
    assert run_cli(["finalize", f"az://{prefix}", "--compact", "--target-rows", "16"]) == 0
    assert len(az.glob(f"{prefix}/*.parquet")) == 3 and read_s3_output(az, prefix) == before

    from helpers import run_shards, stage_docs, staged_job

    docs = stage_docs(tmp_path, 24)
    staged = f"{container}/staged"
    job = staged_job(tmp_path, docs, f"az://{staged}", 'engine-args = {latency = "0.01"}\n')
    run_shards(["generate", "--config", job], 2, **azenv)
    keys = [r["dedup_key"] for r in read_s3_output(az, f"{staged}/judge") if r["kept"]]
    assert keys and len(keys) == len(set(keys))
    assert run_cli(["finalize", f"az://{staged}"]) == 0


@pytest.mark.slow  # ~30 s here; the s3 variant runs in the default suite
def test_a_lost_answer_to_a_record_swap_or_the_manifest_update_is_read_back_on_az(tmp_path, az, azenv,
                                                                                 azurite_endpoint, container):
    lost_answers_of_swaps(tmp_path, az, "az", f"{container}/lost",
                          lambda url: {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(url)},
                          azurite_endpoint)
