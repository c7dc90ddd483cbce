"""First contact: the bare command runs and resumes, inputs are checked before the model loads, the lock goes
away on every exit, option ranges are click's, job files with unknown keys are refused, exit 75 vs 1, and
progress shows rows as they finish."""

from __future__ import annotations

import json
import os
import time

import pytest
from click.testing import CliRunner
from helpers import prompts, read_output, run_cli, scripted_engine, spawn, write_jsonl

from dspine_batch.cli import cli
from dspine_batch.engines.registry import ENGINES, engines_replaced, open_engine
from dspine_batch.errors import UsageError
from dspine_batch.ops.status import format_status, read_status
from dspine_batch.outdir.layout import STATE as STATE_DIR
from dspine_batch.outdir.lock import Lock, held_locks
from dspine_batch.outdir.output import open_output
from dspine_batch.run.preflight import default_output


def test_bare_command_uses_a_default_outdir_and_resumes(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "prompts.jsonl", prompts(12))
    monkeypatch.chdir(tmp_path)
    assert run_cli(["generate", "prompts.jsonl"]) == 0
    assert f"output -> {tmp_path / 'prompts-out'}" in capsys.readouterr().err
    assert len(read_output(tmp_path / "prompts-out")) == 12
    assert run_cli(["generate", str(src)]) == 0  # the same input, named differently: the same folder, resumed
    assert "12 were already committed" in capsys.readouterr().err
    assert len(read_output(tmp_path / "prompts-out")) == 12
    assert "./<first input's name>-out" in CliRunner().invoke(cli, ["generate", "--help"]).output


@pytest.mark.parametrize("inputs, name", [(["data/prompts.jsonl.gz"], "prompts-out"), (["my_set/"], "my_set-out"),
                                          (["shards/*.parquet", "b.parquet"], "shards-out")])
def test_default_output_is_named_after_the_first_input(tmp_path, monkeypatch, inputs, name):
    monkeypatch.chdir(tmp_path)
    assert default_output(inputs) == str(tmp_path / name)


def test_inputs_are_checked_before_the_model_loads_and_no_lock_is_left(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    loads = []

    def recording(model, draft, args):
        loads.append(model)
        return scripted_engine(model, draft, args)

    out = tmp_path / "out"
    with engines_replaced(recording, ("auto", "reference", "scripted")):
        assert run_cli(["generate", str(src), "-o", str(out), "--prompt-column", "question"]) == 2
        assert "no column 'question'" in capsys.readouterr().err
        assert loads == [] and not out.exists()  # no model load, nothing created
        assert run_cli(["generate", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
        assert loads == []
        assert run_cli(["generate", str(src), "-o", str(out), "--engine", "scripted"]) == 0
        assert run_cli(["generate", str(src), "-o", str(out), "--engine", "scripted", "--no-resume"]) == 2
        assert run_cli(["generate", str(src), "-o", str(out), "--engine", "scripted", "--temperature", "1"]) == 2
    assert not [n for n in os.listdir(out / STATE_DIR) if n.startswith("lock-")]  # every exit released it


def test_lock_is_removed_on_release_and_held_locks_names_holders(tmp_path):
    (tmp_path / STATE_DIR).mkdir()
    lock = Lock(str(tmp_path), "00000-of-00001").acquire()
    assert held_locks(str(tmp_path)) == ["lock-00000-of-00001"]
    lock.release()
    assert held_locks(str(tmp_path)) == [] and not os.listdir(tmp_path / STATE_DIR)
    with Lock(str(tmp_path), "00000-of-00001"):  # and it can be taken again
        assert held_locks(str(tmp_path)) == ["lock-00000-of-00001"]


def test_status_shows_a_killed_shard_as_dead(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    tag = "00000-of-00001"
    state = json.loads((out / STATE_DIR / f"state-{tag}.json").read_text())
    open_output(str(out)).write_state(tag, state | {"state": "running", "pid": 999999})  # what kill -9 leaves behind
    (shard,) = read_status(str(out))["shards"]
    assert shard["state"] == "dead" and not shard["running"]
    assert "dead (pid 999999 ended without finishing" in format_status(read_status(str(out)))
    with Lock(str(out), tag):  # a live holder: running
        (shard,) = read_status(str(out))["shards"]
        assert shard["running"] and shard["state"] == "running"


def test_status_of_a_kill9_run_in_a_subprocess(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    state = out / STATE_DIR / "state-00000-of-00001.json"
    p = spawn(["generate", str(src), "-o", str(out), "--engine-arg", "latency=5", "--max-in-flight", "1"])
    try:
        deadline = time.monotonic() + 30
        while not state.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the state file appears once the run streams
        assert read_status(str(out))["shards"][0]["running"]
    finally:
        p.kill()
        p.communicate()
    (shard,) = read_status(str(out))["shards"]
    assert shard["state"] == "dead" and not shard["running"]


def test_unknown_config_key_is_refused_with_the_known_keys(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{src}"]\noutput = "{tmp_path / "out"}"\nmax_tokens = 3\n')
    assert run_cli(["generate", "--config", str(job)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'max_tokens'" in err and "did you mean 'max_new_tokens'" in err
    assert "max_new_tokens" in err.split("the keys are:")[1] and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, env, toml, text", [
    (["--temperature", "-1"], {}, "", "-1.0 is not in the range x>=0"),
    (["--temperature", "nan"], {}, "", "not a finite number"),
    (["--top-p", "0"], {}, "", "0.0 is not in the range 0<x<=1"),
    (["--num-samples", "0"], {}, "", "--num-samples"),
    (["--max-in-flight", "0"], {}, "", "--max-in-flight"),
    (["--max-error-rate", "2"], {}, "", "--max-error-rate"),
    (["--commit-seconds", "0"], {}, "", "--commit-seconds"),
    (["--limit", "-1"], {}, "", "--limit"),
    (["--on-error", "ignore"], {}, "", "'ignore' is not one of 'skip', 'fail'"),
    (["--engine-arg", "=3"], {}, "", "expected KEY=VALUE"),
    ([], {"DSPINE_BATCH_TOP_P": "2"}, "", "DSPINE_BATCH_TOP_P"),  # env values go through the same types
    ([], {}, "top_p = 2\n", "--top-p"),  # and so do job-file values
])
def test_option_ranges_are_checked_by_click(tmp_path, capsys, args, env, toml, text):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    cfg = []
    if toml:
        (tmp_path / "job.toml").write_text(toml)
        cfg = ["--config", str(tmp_path / "job.toml")]
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), *cfg, *args], env=env) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_engine_bug_exits_1_and_engine_death_exits_75(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / "out"
    common = ["--commit-rows", "3", "--max-in-flight", "1"]
    assert run_cli(["generate", str(src), "-o", str(out), *common, "--engine-arg", "fail_after=7"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: scripted engine bug after 7 results" in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1
    assert 0 < len(read_output(out)) < 20  # finished rows are committed either way
    assert read_status(str(out))["shards"][0]["state"] == "failed"
    assert run_cli(["generate", str(src), "-o", str(out), *common, "--engine-arg", "crash_after=4"]) == 75
    assert "the engine died" in capsys.readouterr().err
    assert read_status(str(out))["shards"][0]["state"] == "interrupted"
    with pytest.raises(RuntimeError, match="scripted engine bug"):  # DSPINE_BATCH_DEBUG: the real traceback
        run_cli(["generate", str(src), "-o", str(out), "--engine-arg", "fail_after=1"],
                env={"DSPINE_BATCH_DEBUG": "1"})
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(20)]


def test_progress_shows_rows_before_they_commit_and_the_model_load(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    p = spawn(["generate", str(src), "-o", str(tmp_path / "out"), "--engine-arg", "latency=0.02",
               "--max-in-flight", "2", "--log-interval", "0.05", "--commit-rows", "1000", "--commit-seconds", "3600"],
              DSPINE_BATCH_PROGRESS="log")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()
    lines = err.decode().splitlines()
    assert any("loading the model" in ln for ln in lines) and any("model loaded in" in ln for ln in lines)
    progress = [ln for ln in lines if "rows done" in ln]
    assert len(progress) >= 2 and " read (" in progress[0]
    before_commit = [int(ln.split("dspine-batch: ")[1].split("/")[0].split(" ")[0].replace(",", ""))
                     for ln in progress[:-1]]
    assert max(before_commit) > 0  # one part is committed at the very end: these rows were not committed yet


def test_engine_registry_names_and_replacement():
    with pytest.raises(UsageError, match=r"unknown engine 'vllm' \(choose from auto, reference, sglang\)"):
        open_engine("vllm", "embedded", "none", {})
    before = dict(ENGINES)
    with engines_replaced(scripted_engine):
        assert open_engine("auto", "embedded", "none", {}).name == "scripted"
        assert open_engine("reference", "x", "y", {"latency": "0"}).name == "scripted"
    assert ENGINES == before and "auto" not in ENGINES
