"""Exactly-once resume: kill -9 torture, fingerprint refusal, the lock, staging leftovers, the done-set."""

from __future__ import annotations

import os
import random
import time

import pyarrow.parquet as pq
import pytest
from helpers import kill9_resumes, prompts, read_output, run_cli, spawn, write_jsonl

from dspine_batch.errors import LockedError
from dspine_batch.outdir.layout import STAGING, record_rel
from dspine_batch.outdir.lock import Lock
from dspine_batch.outdir.output import list_parts, open_output

GEN = ["--num-samples", "2", "--temperature", "0.8", "--seed", "7", "--keep-columns", "prompt"]


def _input(tmp_path, n=300):
    rows = prompts(n)
    rows[17]["prompt"] = ""  # a bad row: must also be committed exactly once
    return write_jsonl(tmp_path / "in.jsonl", rows, [b"{broken"])


def _assert_exactly_once(out, n_rows, samples=2):
    got = read_output(out)
    keys = [(r["row_id"], r["sample_index"]) for r in got]
    assert len(keys) == len(set(keys)) == n_rows * samples


def _torture(tmp_path, kills_wanted: int, rows: int, seed: int) -> None:
    """kill -9 at random moments, resume each time: final output == an uninterrupted run, exactly once."""
    src = _input(tmp_path, rows)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["generate", str(src), *GEN, "--max-in-flight", "8", "--commit-rows", "7", "--commit-seconds", "0.05",
            "--engine-arg", "latency=0.06", "--max-error-rate", "1"]
    t0 = time.monotonic()
    assert run_cli([*args, "-o", str(ref)]) == 0
    # a start lives up to its first commit + ``late`` seconds: at most the job's length / kills_wanted, so a machine
    # that runs the job fast still gets its kills before the job ends (one with the 0.5 s of slower machines
    # finished the 300 rows after 13 kills)
    late = min(0.5, (time.monotonic() - t0) / kills_wanted)
    kills, mid_run, _ = kill9_resumes([*args, "-o", str(out)], out, random.Random(seed), kills_wanted + 15, 0.3, late,
                                      enough=kills_wanted)
    assert kills >= kills_wanted * 0.8 and mid_run >= 5, (kills, mid_run)  # also after commits
    assert not [n for n in os.listdir(out) if n.endswith(".inprogress")]
    _assert_exactly_once(out, rows + 1)
    assert read_output(out) == read_output(ref)
    assert run_cli(["finalize", str(out)]) == 0


def test_kill9_torture_matches_uninterrupted_run(tmp_path):
    _torture(tmp_path, kills_wanted=25, rows=300, seed=1234)


@pytest.mark.slow
def test_kill9_torture_long(tmp_path):
    _torture(tmp_path, kills_wanted=150, rows=2000, seed=99)


def test_fingerprint_change_is_refused_with_what_changed(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    capsys.readouterr()
    assert run_cli(["generate", str(src), "-o", str(out), "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "settings.temperature: 0.0 -> 0.5" in err and "--overwrite" in err
    write_jsonl(src, prompts(6))
    assert run_cli(["generate", str(src), "-o", str(out)]) == 2
    assert "inputs: in.jsonl changed" in capsys.readouterr().err
    assert run_cli(["generate", str(src), "-o", str(out), "--overwrite"]) == 0
    assert len(read_output(out)) == 6
    # operational settings may change on resume
    assert run_cli(["generate", str(src), "-o", str(out), "--max-in-flight", "3", "--commit-rows", "2"]) == 0
    assert run_cli(["generate", str(src), "-o", str(out), "--no-resume"]) == 2


def test_a_job_written_with_an_older_schema_is_not_resumed_into(tmp_path, capsys):
    """Parts of one OUTDIR must share one schema (readers concatenate them, compaction merges them), so the
    schema version is part of the run's fingerprint: a job started before a column was added is refused, with
    the version change named, rather than finished with parts that lack the column."""
    import json

    from dspine_batch.outdir.layout import MANIFEST
    from dspine_batch.outdir.schema import SCHEMA_VERSION
    from dspine_batch.run.fingerprint import fingerprint

    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    path = out / MANIFEST
    m = json.loads(path.read_text())
    assert m["fingerprint_fields"]["schema_version"] == SCHEMA_VERSION
    m["fingerprint_fields"]["schema_version"] = SCHEMA_VERSION - 1  # as the release before wrote it
    m["fingerprint"] = fingerprint(m["fingerprint_fields"])
    m["output_columns"].remove("cached_prompt_tokens")
    path.write_text(json.dumps(m))
    capsys.readouterr()
    assert run_cli(["generate", str(src), "-o", str(out)]) == 2
    assert f"schema_version: {SCHEMA_VERSION - 1} -> {SCHEMA_VERSION}" in capsys.readouterr().err
    assert run_cli(["generate", str(src), "-o", str(out), "--overwrite"]) == 0
    assert len(read_output(out)) == 3


def test_model_change_is_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    assert run_cli(["generate", str(src), "-o", str(out), "--engine-arg", "block_size=4"]) == 2
    assert "engine.block_size: 8 -> 4" in capsys.readouterr().err


def test_a_second_process_on_a_locked_shard_ends_with_75_naming_the_holder(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--shard", "0/2"]) == 0
    with Lock(str(out), "00000-of-00002"):
        capsys.readouterr()
        assert run_cli(["generate", str(src), "-o", str(out), "--shard", "0/2"]) == 75  # busy, not wrong: requeue
        err = capsys.readouterr().err.strip()
        assert f"shard 00000-of-00002 is in use by pid {os.getpid()} on" in err and len(err.splitlines()) == 1, err
        assert run_cli(["generate", str(src), "-o", str(out), "--shard", "1/2"]) == 0  # other shard: fine
        with pytest.raises(LockedError):
            Lock(str(out), "00000-of-00002").acquire()


def test_a_live_second_process_ends_with_75_naming_the_holder(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(50))
    out = tmp_path / "out"
    p = spawn(["generate", str(src), "-o", str(out), "--engine-arg", "latency=0.5", "--max-in-flight", "2"])
    try:
        deadline = time.time() + 20
        while not (out / "_manifest.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        q = spawn(["generate", str(src), "-o", str(out), "--engine-arg", "latency=0.5", "--max-in-flight", "2"])
        _, err = q.communicate(timeout=30)
        assert q.returncode == 75 and f"in use by pid {p.pid} on".encode() in err, err
    finally:
        p.kill()
        p.communicate()


def test_staging_leftovers_are_discarded_and_done_set_is_exact(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "5"]) == 0
    parts = list_parts(str(out))
    assert len(parts) == 4
    # simulate a crash mid-commit, before its record: the last part's bytes staged, no record names them
    name = os.path.basename(parts[-1].path)
    o = open_output(str(out))
    staged = o.record_of(name)["staged"]
    os.rename(parts[-1].path, out / staged)
    os.unlink(out / record_rel(name))
    done = open_output(str(out)).load_done("00000-of-00001")
    assert done.rows == 15 and done.next_seq == 3
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    assert not (out / staged).exists() and not os.listdir(out / STAGING)
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(20)]


def test_parts_carry_provenance_metadata(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    md = pq.read_schema(list_parts(str(out))[0].path).metadata
    assert b"dspine_batch.run.fingerprint" in md and b"dspine_batch.part" in md
    assert (out / "_manifest.json").exists() and (out / "_SUCCESS").exists()
