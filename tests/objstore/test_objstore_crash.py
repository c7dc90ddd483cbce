"""Exactly-once on S3 under crashes, rivals and a bad network (issue 39), against a real S3 server on 127.0.0.1.

kill -9 lands at exact steps of a commit (the worker's traffic goes through ``faultproxy``, which kills it when the
commit record's create-only PUT, or the publishing copy, is about to reach the store) and at random moments; the
resumed job (started at once: the dead worker's lease is taken over without waiting for it to expire) has every
input row exactly once, no orphan left, and ``finalize`` writes ``_SUCCESS``. Two workers on one shard: the second
exits 75 naming the live holder; after the holder's kill -9 the same command at once takes the shard over. Through
a proxy that answers 503, drops and cuts connections, the job still finishes exactly once. No assertion depends on
timing: waits poll the store for a state, with a generous upper bound."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from faultproxy import FaultProxy
from helpers import prompts, read_output, run_cli, spawn, write_jsonl
from test_objstore_generate import read_s3_output

from dspine_batch.errors import FatalError
from dspine_batch.storage.lease import Lease

GEN = ["--num-samples", "2", "--temperature", "0.8", "--seed", "11", "--max-in-flight", "8", "--commit-rows", "5",
       "--commit-seconds", "0.05", "--engine-arg", "latency=0.03", "--max-error-rate", "1"]


def _wait(cond, what: str, limit: float = 120.0) -> None:
    """Poll until ``cond()``; the limit only turns a hang into a failure, it measures nothing."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"never happened: {what}"
        time.sleep(0.02)


def glob_now(fs, pattern: str) -> list[str]:
    """``fs.glob`` for a poll while a worker writes: fresh from the store, and [] when the folder vanishes between
    s3fs's listing and its look at the folder itself (a lease or probe object deleted in between raises
    FileNotFoundError from inside ``glob``)."""
    fs.invalidate_cache()
    try:
        return fs.glob(pattern)
    except FileNotFoundError:
        return []


def _assert_clean(s3, prefix: str) -> None:
    """No staging object left (orphans swept, published parts' staged copies deleted), and the published parts are
    exactly the ones with a commit record."""
    staging = f"{prefix}/_dspine/staging"
    assert not (s3.exists(staging) and s3.ls(staging, detail=False)), s3.ls(staging, detail=False)
    records = [json.loads(s3.cat_file(p)) for p in s3.glob(f"{prefix}/_dspine/keys/commit-*.json")]
    assert not s3.glob(f"{prefix}/_dspine/keys/keys-*")
    parts = {p.rsplit("/", 1)[-1] for p in s3.glob(f"{prefix}/*.parquet")}
    assert parts == {r["part"] for r in records}


def _exactly_once(s3, prefix: str, ref: Path, rows: int) -> None:
    got = read_s3_output(s3, prefix)
    keys = [(r["row_id"], r["sample_index"]) for r in got]
    assert len(keys) == len(set(keys)) == 2 * rows
    assert got == read_output(ref)


def test_kill9_during_commits_and_at_random_resumes_exactly_once(tmp_path, s3, s3env, s3_endpoint, bucket):
    rows = 120
    src = write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    args = ["generate", str(src), *GEN]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    prefix = f"{bucket}/out"
    out = f"s3://{prefix}"
    worker: dict[str, int | str] = {}
    seen = {"record": 0, "copy": 0}
    plan: dict[str, int] = {}  # which request to kill at: {"record": k} or {"copy": k}
    killed: list[str] = []

    def hook(chunk: bytes) -> bool:
        for step, marker in (("record", b"/_dspine/keys/commit-"), ("copy", b"x-amz-copy-source")):
            if chunk.startswith(b"PUT ") and marker in chunk:
                seen[step] += 1
                if plan.get(step) == seen[step] and "pid" in worker:
                    os.kill(worker.pop("pid"), signal.SIGKILL)  # before the store sees this request
                    killed.append(step)
                    return True
        return False

    proxy = FaultProxy(s3_endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    rng = random.Random(7)
    try:
        # 1: killed when a part is uploaded but its record not yet created (an orphan); 2: record created, publish
        # not done (the next start finishes it); 3 and 4: the same again later in the run; 5, 6: random moments
        for step in ("record", "copy", "record", "copy", None, None):
            seen.update(record=0, copy=0)
            plan.clear()
            if step:
                plan[step] = rng.randint(1, 3)
            p = spawn([*args, "-o", out], AWS_ENDPOINT_URL=proxy.url, DSPINE_BATCH_LEASE_SECONDS="60")
            worker["pid"] = p.pid
            if step is None:
                _wait(lambda: s3.exists(f"{prefix}/_manifest.json"), "the worker started")
                time.sleep(rng.uniform(0.1, 1.0))
                if p.poll() is None:
                    os.kill(worker.pop("pid"), signal.SIGKILL)
                    killed.append("random")
            _, err = p.communicate(timeout=300)
            worker.pop("pid", None)
            assert p.returncode in (0, -signal.SIGKILL), err.decode()
            worker["last"] = "killed" if p.returncode else "done"
            if p.returncode == 0:
                break
            # the dead worker's lease is left: the next start takes it over at once (same machine, its process
            # gone), never waiting for it to expire
            assert s3.exists(f"{prefix}/_dspine/lease-00000-of-00001.json")
    finally:
        proxy.close()
    assert killed.count("record") >= 1 and killed.count("copy") >= 1 and len(killed) >= 3, killed
    p = spawn([*args, "-o", out], DSPINE_BATCH_LEASE_SECONDS="60")  # a dead holder's 60 s lease: never waited for
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    assert "waiting up to" not in err.decode(), err.decode()
    if worker.get("last") == "killed":
        assert "(its process is gone)" in err.decode(), err.decode()
    _exactly_once(s3, prefix, tmp_path / "ref", rows)
    _assert_clean(s3, prefix)
    assert run_cli(["finalize", out]) == 0
    assert s3.exists(f"{prefix}/_SUCCESS")


def test_a_live_holder_ends_a_second_start_with_75_and_a_rerun_after_its_kill9_resumes_at_once(tmp_path, s3, s3env,
                                                                                               bucket, capsys):
    second_worker_then_takeover(tmp_path, capsys, s3, "s3", f"{bucket}/out", GEN[:-4], rows=80, lease_s="3")


def second_worker_then_takeover(tmp_path, capsys, fs, scheme: str, prefix: str, gen: list[str], rows: int,
                                lease_s: str) -> None:
    """A second worker on a live shard watches the lease, sees it renewed and exits 75 naming the holder (a requeue
    may come back; exit 2 would spend an array task's retries), and so does ``finalize``; after the holder's kill -9
    the same command at once takes the shard over (same machine, the holder's process gone: no waiting for the
    lease to expire, which the long lifetime here would make a minute) and completes it exactly once (any store:
    ``test_objstore_azure`` runs it too)."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    args = ["generate", str(src), *gen, "--engine-arg", "latency=0.2"]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    url, env = f"{scheme}://{prefix}", {"DSPINE_BATCH_LEASE_SECONDS": lease_s}
    holder = spawn([*args, "-o", url], **env)
    try:
        _wait(lambda: bool(glob_now(fs, f"{prefix}/_dspine/keys/commit-*.json")), "the first worker committed a part")
        capsys.readouterr()
        assert run_cli([*args, "-o", url], env) == 75
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and f"leased to pid {holder.pid} on" in err[0] and "waiting up to" in err[0], err
        assert f"held by pid {holder.pid} on" in err[1] and "alive" in err[1], err
        assert run_cli(["finalize", url], env) == 75  # finalize needs every shard's lease: not a live one's
        assert f"held by pid {holder.pid} on" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.communicate()
    lease = f"{prefix}/_dspine/lease-00000-of-00001.json"
    assert fs.exists(lease)  # kill -9: nobody released it
    assert run_cli([*args, "-o", url], {"DSPINE_BATCH_LEASE_SECONDS": "60"}) == 0  # at once
    err = capsys.readouterr().err
    assert f"took over the lease of pid {holder.pid} on" in err and "(its process is gone)" in err, err
    assert "waiting up to" not in err
    _exactly_once(fs, prefix, tmp_path / "ref", rows)
    _assert_clean(fs, prefix)
    assert not fs.exists(lease)  # released at the end
    assert run_cli(["finalize", url]) == 0


def test_a_worker_whose_lease_was_taken_over_cannot_commit(s3env, bucket):
    """The paused-worker case: A's lease expired and B took the shard; A wakes up and tries to commit. The lease
    check stops it, and were it past that check, the create-only commit record would (of two writers racing
    for one part number exactly one wins)."""
    paused_worker_cannot_commit(f"s3://{bucket}/out")


def paused_worker_cannot_commit(url: str) -> None:
    """The body of the test above, for any store (``test_objstore_azure`` runs it on Azurite)."""
    import numpy as np
    import pyarrow as pa

    from dspine_batch.outdir.output import OutDir as ObjectOutput

    a, b = ObjectOutput(url), ObjectOutput(url)
    a.prepare()
    tag = "00000-of-00001"
    la = Lease(a.store, tag, seconds=1.0)
    a.lease = la
    la.acquire()
    la._stop.set()  # A stops renewing (paused)
    la._thread.join()
    _wait(lambda: json.loads(a.store.get(f"_dspine/lease-{tag}.json"))["expires_at"] < time.time(), "A's lease expired")
    lb = b.lock(tag).acquire()
    assert lb.took_over and lb.took_over["token"] == la.token
    table = pa.table({"row_id": ["x"], "sample_index": [0]})
    name = "train-00000-of-00001-000000.parquet"
    committed = b.commit_part(name, table, np.array([1], dtype=np.uint64), 1)
    b.flush()
    la.renew()  # A's next renewal finds the lease changed: lost
    with pytest.raises(FatalError, match="lease lost"):
        a.commit_part(name, table, np.array([2], dtype=np.uint64), 1)
        a.flush()
    a2 = ObjectOutput(url)  # past the lease check (none held): the record's create-only write still refuses
    with pytest.raises(FatalError, match="another worker committed this part first"):
        a2.commit_part(name, table, np.array([2], dtype=np.uint64), 1)
        a2.flush()
    assert not a.store.list("_dspine/staging")  # the losers' uploads were removed
    survivor = json.loads(a.store.get("_dspine/keys/commit-00000-of-00001-000000.json"))
    assert survivor["token"] == committed["token"] and survivor["keys_b64"] == committed["keys_b64"]  # B's record
    assert a.store.create("probe", b"1") and not a.store.create("probe", b"2")  # If-None-Match: * really holds
    assert a.store.get("probe") == b"1"
    lb.release()


def test_faults_between_us_and_the_store_still_exactly_once(tmp_path, s3, s3env, s3_endpoint, bucket):
    rows = 60
    src = write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    args = ["generate", str(src), *GEN]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    proxy = FaultProxy(s3_endpoint, seed=3, p503=0.1, pdrop=0.05, pdelay=0.05, pcut=0.01,
                       first=("503", "drop", "delay", "503", "drop"))
    try:
        # a lease long enough that retries (503s back off for seconds) never outlast it: expiry is not under test
        p = spawn([*args, "-o", f"s3://{bucket}/out"], AWS_ENDPOINT_URL=proxy.url, DSPINE_BATCH_LEASE_SECONDS="60")
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
    finally:
        proxy.close()
    assert proxy.counts["503"] > 0 and proxy.counts["drop"] > 0, proxy.counts
    _exactly_once(s3, f"{bucket}/out", tmp_path / "ref", rows)
    _assert_clean(s3, f"{bucket}/out")
    assert run_cli(["finalize", f"s3://{bucket}/out"]) == 0
