"""The CLI surface: help, option precedence (flag > env > TOML), exit codes, shards + finalize, progress."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import ROOT, prompts, read_output, run_cli, shard_of, spawn, write_jsonl

from dspine_batch.cli import cli
from dspine_batch.outdir.output import list_parts
from dspine_batch.run.shard import parse_shard


def test_help_is_discoverable():
    r = CliRunner().invoke(cli, ["generate", "--help"])
    assert r.exit_code == 0
    for text in ("Examples:", "dspine-batch generate examples/prompts.jsonl -o out/", "DSPINE_BATCH_MAX_NEW_TOKENS",
                 "--shard", "--on-error", "--engine-arg", "Exit codes"):
        assert text in r.output
    assert "scripted" not in r.output  # the test engine stays hidden
    top = CliRunner().invoke(cli, ["--help"]).output
    assert all(c in top for c in ("generate", "status", "report", "finalize"))


def test_precedence_flag_env_toml(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(4))
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{src}"]\noutput = "{tmp_path / "a"}"\nmax-new-tokens = 3\nnum_samples = 2\n'
                   '[engine_args]\nblock_size = 4\n')
    assert run_cli(["generate", "--config", str(job)]) == 0
    rows = read_output(tmp_path / "a")
    assert len(rows) == 8 and max(r["completion_tokens"] for r in rows) <= 3
    assert run_cli(["generate", "--config", str(job), "-o", str(tmp_path / "b")],
                   env={"DSPINE_BATCH_MAX_NEW_TOKENS": "2"}) == 0
    assert max(r["completion_tokens"] for r in read_output(tmp_path / "b")) <= 2
    assert run_cli(["generate", "--config", str(job), "-o", str(tmp_path / "c"), "--max-new-tokens", "1"],
                   env={"DSPINE_BATCH_MAX_NEW_TOKENS": "2"}) == 0
    assert max(r["completion_tokens"] for r in read_output(tmp_path / "c")) == 1


@pytest.mark.parametrize("args, code, text", [
    (["--max-new-tokens", "0"], 2, "0 is not in the range x>=1"),  # click's IntRange, named below
    (["--top-p", "1.5"], 2, "--top-p"),
    (["--shard", "3/2"], 2, "need 0 <= I < N"),
    (["--engine", "sglang"], 2, "not available"),
    (["--engine-arg", "nope"], 2, "expected KEY=VALUE"),
    (["--prompt-column", "question"], 2, "no column 'question'"),
    (["--raw", "--system-prompt", "x"], 2, "--system-prompt needs a chat template"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, capsys, args, code, text):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), *args]) == code
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_foreign_nonempty_outdir_is_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("precious")
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out")]) == 2
    assert "not a dspine-batch output" in capsys.readouterr().err


def test_error_budget_and_on_error_fail(tmp_path, capsys):
    rows = prompts(20)
    rows[5]["prompt"] = ""
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "a"), "--max-error-rate", "0.01"]) == 3
    assert not (tmp_path / "a" / "_SUCCESS").exists() and len(read_output(tmp_path / "a")) == 20
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "b"), "--max-error-rate", "0.1"]) == 0
    capsys.readouterr()
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "c"), "--on-error", "fail",
                    "--max-in-flight", "1", "--commit-rows", "1"]) == 1
    err = capsys.readouterr().err
    assert "in.jsonl: line 6 (id 'r00005'), field 'prompt': empty prompt (--on-error fail" in err
    assert all(r["status"] == "ok" for r in read_output(tmp_path / "c"))


def test_engine_death_exits_75_and_resumes(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "5", "--engine-arg", "crash_after=12",
                    "--max-in-flight", "1"]) == 75
    assert 0 < len(read_output(out)) < 30
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "5"]) == 0  # crash_after: not identity
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(30)]


def test_limit_and_keep_columns_and_token_ids(tmp_path):
    rows = [dict(r, topic=f"t{i}") for i, r in enumerate(prompts(10))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--limit", "4", "--keep-columns", "topic,prompt",
                    "--save-token-ids"]) == 0
    got = read_output(out)
    assert [r["topic"] for r in got] == ["t0", "t1", "t2", "t3"]
    assert all(r["output_token_ids"] and len(r["output_token_ids"]) == r["completion_tokens"] for r in got)


def test_shards_partition_by_row_id_and_finalize(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--shard", "0/3"]) == 0
    assert not (out / "_SUCCESS").exists()
    assert run_cli(["finalize", str(out)]) == 1
    assert "input rows are missing" in capsys.readouterr().err
    assert run_cli(["generate", str(src), "-o", str(out)], env={"SLURM_ARRAY_TASK_ID": "1",
                                                               "SLURM_ARRAY_TASK_COUNT": "3",
                                                               "SLURM_RESTART_COUNT": "2"}) == 0
    assert run_cli(["generate", str(src), "-o", str(out), "--shard", "2/3"]) == 0
    assert run_cli(["generate", str(src), "-o", str(out), "--shard", "0/2"]) == 2  # shard count is fixed
    for p in list_parts(str(out)):
        t = pq.read_table(p.path).to_pylist()
        shard = int(p.shard.split("-")[0])
        assert all(shard_of(r["row_id"], 3) == shard for r in t)
        assert all(r["attempt"] == (2 if shard == 1 else 0) for r in t)
    assert run_cli(["finalize", str(out), "--compact"]) == 0
    assert (out / "_SUCCESS").exists() and len(list_parts(str(out))) == 3
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(60)]


def test_finalize_detects_duplicates(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    part = list_parts(str(out))[0].path
    shutil.copy(part, part.replace("-000000.parquet", "-000001.parquet"))
    assert run_cli(["finalize", str(out)]) == 1
    assert "appear more than once" in capsys.readouterr().err


def test_parse_shard_from_slurm_env():
    assert parse_shard(None, {}) == (0, 1)
    assert parse_shard(None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4",
                              "SLURM_ARRAY_TASK_MIN": "2"}) == (3, 4)
    assert parse_shard("1/4", {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4"}) == (1, 4)


def test_progress_log_lines_when_not_a_tty(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    p = spawn(["generate", str(src), "-o", str(tmp_path / "out"), "--engine-arg", "latency=0.02",
               "--max-in-flight", "2", "--log-interval", "0.05"], DSPINE_BATCH_PROGRESS="auto")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0
    lines = [ln for ln in err.decode().splitlines() if "rows/s this run" in ln]
    assert len(lines) >= 2 and "tok/s" in lines[-1] and "tau=" in lines[-1] and "\r" not in err.decode()


def test_console_script_is_declared():
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["dspine-batch"] == "dspine_batch.cli:main"


def test_job_files_use_real_options():
    from dspine_batch.config import load_toml

    names = {p.name for p in cli.commands["generate"].params}
    jobs = list((ROOT / "jobs").glob("*.toml"))
    assert jobs
    for job in jobs:
        data = load_toml(str(job))
        for key in data:
            assert key in names | {"inputs", "output", "engine_args"}, f"{job.name}: unknown key {key}"
        assert all((ROOT / p).exists() for p in data["inputs"])


def test_example_prompts_run(tmp_path):
    src = ROOT / "examples" / "prompts.jsonl"
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    assert len(rows) >= 20 and {r["id"].split("-")[0] for r in rows} == {"chat", "code", "math"}
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out")]) == 0
    assert len(read_output(tmp_path / "out")) == len(rows)


def test_unreadable_parquet_and_overlong_prompts(tmp_path, capsys):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    assert run_cli(["generate", str(tmp_path / "bad.parquet"), "-o", str(tmp_path / "o1")]) == 2
    assert "bad.parquet: unreadable" in capsys.readouterr().err
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "x" * 500}])
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "o2"), "--engine-arg", "max_context=100",
                    "--max-error-rate", "1"]) == 0
    long_row = [r for r in read_output(tmp_path / "o2") if r["row_id"] == "long"][0]
    assert "field 'prompt': prompt is" in long_row["error"] and "context is 100" in long_row["error"]
