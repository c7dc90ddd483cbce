"""SIGTERM/SIGINT/SIGUSR1: stop admitting, commit, exit 75; a second signal exits at once; then resume."""

from __future__ import annotations

import signal
import time

import pytest
from helpers import prompts, read_output, run_cli, spawn, write_jsonl

from dspine_batch.outdir.output import list_parts


def _wait_for_parts(out, n=1, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if out.exists() and len(list_parts(str(out))) >= n:
            return
        time.sleep(0.02)
    raise AssertionError("no part committed in time")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_signal_commits_and_exits_75_then_resume_completes(tmp_path, sig):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(200))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--engine-arg", "latency=0.05", "--max-in-flight", "4",
            "--commit-rows", "4"]
    p = spawn(args)
    _wait_for_parts(out)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 75, err.decode()
    assert b"run the same command again" in err
    got = read_output(out)
    assert 0 < len(got) < 200
    assert not [n for n in out.iterdir() if n.name.endswith(".inprogress")]
    assert run_cli(args) == 0
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(200)]


def test_grace_timeout_aborts_in_flight_work(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    p = spawn(["generate", str(src), "-o", str(out), "--engine-arg", "latency=20", "--max-in-flight", "4",
               "--grace-seconds", "0.5"])
    deadline = time.time() + 30
    while not (out / "_dspine").exists() or not list((out / "_dspine").glob("state-*.json")):
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 75, err.decode()
    assert time.time() - t0 < 5


def test_second_signal_exits_at_once(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--engine-arg", "latency=3", "--max-in-flight", "4",
            "--grace-seconds", "60", "--commit-rows", "1"]
    p = spawn(args)
    _wait_for_parts(out)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 75 and time.time() - t0 < 5
    assert b"second SIGTERM" in err
    args[args.index("latency=3")] = "latency=0.001"  # not identity: the resume may run fast
    assert run_cli(args) == 0  # nothing corrupted: resume completes exactly once
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(40)]
