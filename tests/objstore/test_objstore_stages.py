"""A job of several stages (issue 41) read from and written to S3 (issue 39's storage interface), against a real
S3 server on 127.0.0.1: the same rows, filter and dedup decisions as the job on a local disk; one engine load;
``report`` shows the funnel and ``finalize`` audits every stage and writes ``OUTDIR/_SUCCESS``; kill -9 during the
job, then the same command, resumes every stage exactly once."""

from __future__ import annotations

import json
import random
import signal
import time

from helpers import (
    near_docs,
    near_job,
    read_output,
    run_cli,
    run_shards,
    scripted_engine,
    spawn,
    stage_docs,
    staged_job,
)
from test_objstore_crash import _wait, glob_now
from test_objstore_generate import read_s3_output

from dspine_batch.outdir.keyset import key_hash
from dspine_batch.stages.keylog import decode

STAGES = ("questions", "answers", "judge")


def _decisions(rows_of) -> dict:
    """Per stage and row: its output and whether it was kept or dropped, and by what rule."""
    return {(name, r["row_id"], r["sample_index"]): (r["status"], r["output"], r["kept"],
                                                    (r["dropped_by"] or "").split(" ")[0])
            for name in STAGES for r in rows_of(name)}


def test_a_staged_job_on_s3_equals_the_local_one(tmp_path, s3, bucket, capsys):
    src = stage_docs(tmp_path)
    s3.put_file(str(src), f"{bucket}/in/docs.jsonl")
    local = tmp_path / "local"
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, local)]) == 0
    opened = []

    def counting(*a):
        opened.append(1)
        return scripted_engine(*a)

    prefix = f"{bucket}/staged"
    job = staged_job(tmp_path, f"s3://{bucket}/in/docs.jsonl", f"s3://{prefix}")
    assert run_cli(["generate", "--config", job], loader=counting) == 0
    assert len(opened) == 1  # one engine for every stage
    assert json.loads(s3.cat_file(f"{prefix}/_stages.json"))["stages"] == list(STAGES)
    got = _decisions(lambda name: read_s3_output(s3, f"{prefix}/{name}"))
    assert got == _decisions(lambda name: read_output(local / name))
    assert any(v[3] == "dedup" for v in got.values()) and any(v[3] == "where" for v in got.values())
    capsys.readouterr()
    assert run_cli(["report", f"s3://{prefix}"]) == 0
    assert "kept rows go on to the next stage" in capsys.readouterr().out
    assert run_cli(["finalize", f"s3://{prefix}"]) == 0 and s3.exists(f"{prefix}/_SUCCESS")
    assert run_cli(["generate", "--config", job], loader=counting) == 0  # nothing left: every stage resumes done
    assert _decisions(lambda name: read_s3_output(s3, f"{prefix}/{name}")) == got


def test_kill9_during_a_staged_s3_job_resumes_each_stage_exactly_once(tmp_path, s3, s3env, bucket):
    src = stage_docs(tmp_path, 24)
    slow = 'engine-args = {latency = "0.03"}\nmax-in-flight = 6\ncommit-seconds = 0.05\n'
    local = tmp_path / "local"
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, local, slow)]) == 0
    prefix = f"{bucket}/killed"
    job = staged_job(tmp_path, src, f"s3://{prefix}", slow)
    rng = random.Random(39)
    kills = 0
    for _ in range(12):
        p = spawn(["generate", "--config", job], **s3env)
        _wait(lambda p=p: glob_now(s3, f"{prefix}/*/*.parquet") or p.poll() is not None, "a first committed part")
        time.sleep(rng.uniform(0.0, 1.5))
        if p.poll() is None:
            p.kill()
            kills += 1
        _, err = p.communicate()
        assert p.returncode in (0, -signal.SIGKILL), err.decode()
        if p.returncode == 0 or kills >= 3:
            break  # else the same command at once: the killed worker's leases are taken over, never waited for
    assert kills >= 2
    assert run_cli(["generate", "--config", job], {"DSPINE_BATCH_LEASE_SECONDS": "60"}) == 0
    for name in STAGES:
        rows = read_s3_output(s3, f"{prefix}/{name}")
        keys = [(r["row_id"], r["sample_index"]) for r in rows]
        assert len(keys) == len(set(keys)), name  # nothing duplicated
    # nothing lost; the same outputs, filters and dedup verdict counts as the uninterrupted local job (which of
    # two equal rows dedup keeps depends on commit order, which a kill changes; how many does not)
    def summary(rows_of):
        d = _decisions(rows_of)
        return {k: v[:2] for k, v in d.items()}, sorted((k[0], v[2], v[3]) for k, v in d.items())

    assert summary(lambda name: read_s3_output(s3, f"{prefix}/{name}")) == \
        summary(lambda name: read_output(local / name))
    assert run_cli(["finalize", f"s3://{prefix}"]) == 0


def test_dedup_holds_across_shards_on_s3(tmp_path, s3, s3env, bucket):
    """Two shards of one staged job at once on an s3:// OUTDIR: their kept keys meet in the stage's key log (one
    create-only entry a part), so no two kept rows of the whole job share a key; ``finalize`` audits it;
    ``--overwrite`` clears the log."""
    src = stage_docs(tmp_path, 24)
    local = tmp_path / "local"
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, local)]) == 0
    prefix = f"{bucket}/sharded"
    job = staged_job(tmp_path, src, f"s3://{prefix}", 'engine-args = {latency = "0.01"}\n')
    run_shards(["generate", "--config", job], 2, **s3env)
    keys = [r["dedup_key"] for r in read_s3_output(s3, f"{prefix}/judge") if r["kept"]]
    assert keys and len(keys) == len(set(keys))
    assert sorted(keys) == sorted(r["dedup_key"] for r in read_output(local / "judge") if r["kept"])
    entries = s3.ls(f"{prefix}/judge/_dspine/dedup", refresh=True)
    assert 0 < len(entries) <= len(s3.glob(f"{prefix}/judge/*.parquet"))  # at most one entry a part
    assert run_cli(["finalize", f"s3://{prefix}"]) == 0
    assert run_cli(["generate", "--config", job, "--shard", "0/2", "--overwrite"]) == 0  # wipes every shard's
    kept = [r["dedup_key"] for r in read_s3_output(s3, f"{prefix}/judge") if r["kept"]]
    logged = [decode(s3.cat_file(p)) for p in s3.ls(f"{prefix}/judge/_dspine/dedup", refresh=True)]
    assert sorted(kept) == sorted(k for e in logged for k in e.keys)  # only this run's entries


def test_minhash_dedup_on_s3(tmp_path, s3, s3env, bucket):
    """Near-duplicate dedup on an s3:// OUTDIR, two shards at once: each part's kept rows and their signatures are
    one create-only entry of the stage's key log, one row per group of near duplicates is kept."""
    src = near_docs(tmp_path)
    prefix = f"{bucket}/near"
    job = near_job(tmp_path, src, f"s3://{prefix}", 'engine-args = {latency = "0.01"}\n')
    run_shards(["generate", "--config", job], 2, **s3env)
    rows = read_s3_output(s3, f"{prefix}/notes")
    kept = {r["row_id"] for r in rows if r["kept"]}
    assert sorted(k.split("-")[0] for k in kept) == ["g0", "g1", "g2", "g3", "u0", "u1", "u2", "u3"]
    held = [h for p in s3.ls(f"{prefix}/notes/_dspine/minhash", refresh=True) for h in decode(s3.cat_file(p)).rows]
    assert sorted(held) == sorted(key_hash(r) for r in kept)  # every kept row, once; no dropped row
