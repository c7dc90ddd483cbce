"""One runner for every job (issue 50): a job of ``[[stages]]`` gets what a job of one stage always had — the
watchdog, --request-timeout, engine-death isolation, --retry-errors with a fixed input line, --on-error fail —
because both run through ``dspine_batch.run.runner``. Each test fails on the code before it (a staged job had its
own loop: a stall never ended, a poison row was requeued forever, --retry-errors was refused as "a different run").
Driven through the real CLI on the scripted engine; outputs read back with pyarrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_output, run_cli, stage_docs, staged_job, write_jsonl

from dspine_batch.outdir.output import list_parts

ROOT = Path(__file__).resolve().parents[2]


def _ids(out: Path, stage: str) -> list[str]:
    return sorted(r["row_id"] for r in read_output(out / stage))


def _reference(tmp_path: Path, n: int = 8) -> tuple[Path, Path]:
    src = stage_docs(tmp_path, n)
    ref = tmp_path / "ref"
    (tmp_path / "r").mkdir()
    assert run_cli(["generate", "--config", staged_job(tmp_path / "r", src, ref)]) == 0
    return src, ref


def _same_as(out: Path, ref: Path) -> None:
    for stage in ("questions", "answers", "judge"):
        got = read_output(out / stage, drop=("latency_s", "attempt", "logprobs"))
        want = read_output(ref / stage, drop=("latency_s", "attempt", "logprobs"))
        assert [r["row_id"] for r in got] == [r["row_id"] for r in want], stage
        assert [r["output"] for r in got] == [r["output"] for r in want], stage


def test_a_stalled_staged_job_is_stopped_and_the_rerun_finishes_exactly_once(tmp_path, capfd):
    src, ref = _reference(tmp_path)
    out = tmp_path / "out"
    job = staged_job(tmp_path, src, out)
    assert run_cli(["generate", "--config", job, "--stall-seconds", "1", "--engine-arg", "stall_after=11"]) == 75
    err = capfd.readouterr().err
    assert "stalled: nothing produced for" in err and "--stall-seconds 1" in err
    assert run_cli(["generate", "--config", job]) == 0
    _same_as(out, ref)


def test_a_request_timeout_ends_a_stuck_row_of_any_stage_as_an_error_row(tmp_path, capfd):
    src = stage_docs(tmp_path, 8)
    out = tmp_path / "out"
    job = staged_job(tmp_path, src, out, "max-error-rate = 1.0")
    args = ["generate", "--config", job, "--request-timeout", "0.5", "--engine-arg", "hang_every=9",
            "--engine-arg", "latency=0.01"]
    assert run_cli(args) == 0
    errors = [r for stage in ("questions", "answers", "judge") for r in read_output(out / stage)
              if r["status"] == "error"]
    assert errors and all("--request-timeout" in r["error"] for r in errors)
    assert any(r["row_id"].count("/") for r in errors)  # a later stage's row, not only the first's
    assert "error row:" in capfd.readouterr().err


def test_a_poison_row_of_a_later_stage_becomes_an_error_row_after_two_deaths(tmp_path, capfd):
    src = stage_docs(tmp_path, 6)
    out = tmp_path / "out"
    job = staged_job(tmp_path, src, out, "max-error-rate = 1.0")
    poison = "1:d02/0"  # the answers stage's first row of d02, as the engine sees it (stage index: its id)
    args = ["generate", "--config", job, "--max-in-flight", "4", "--engine-arg", f"poison={poison}",
            "--engine-arg", "latency=0.002"]
    assert run_cli(args) == 75
    assert "the engine died with" in capfd.readouterr().err
    state = json.loads((out / "answers" / "_dspine" / "state-00000-of-00001.json").read_text())
    assert "d02/0" in state["engine_death"]["rows"]
    assert run_cli(args) == 75
    assert "the engine died again with row d02/0 alone in flight" in capfd.readouterr().err
    assert run_cli(args) == 0
    answers = {r["row_id"]: r for r in read_output(out / "answers")}
    assert answers["d02/0"]["status"] == "error" and "died twice" in answers["d02/0"]["error"]
    assert answers["d02/0"]["kept"] is False
    assert len(answers) == len(set(answers))
    assert "d02/0" not in {r["row_id"] for r in read_output(out / "judge")}  # an error row makes no child


def test_retry_errors_on_a_staged_job_takes_a_fixed_line_through_every_stage(tmp_path, capfd):
    """One row's template names a column that row lacks (an error row in the first stage); the user fixes that
    line and runs the same command with --retry-errors: the row goes through every stage, the others are kept."""
    rows = [{"doc_id": f"d{i:02d}", "text": f"Document {i} says the tides follow the moon."} for i in range(6)]
    broken = [dict(r) for r in rows]
    del broken[3]["text"]
    src = write_jsonl(tmp_path / "docs.jsonl", broken)
    out = tmp_path / "out"
    job = staged_job(tmp_path, src, out, "max-error-rate = 1.0")
    assert run_cli(["generate", "--config", job]) == 0
    first = {r["row_id"]: r for r in read_output(out / "questions")}
    assert first["d03"]["status"] == "error" and "text" in first["d03"]["error"]
    kept = {r["row_id"]: r["output"] for r in read_output(out / "answers")}
    write_jsonl(src, rows)  # the failed line fixed, every other line as it was
    capfd.readouterr()
    assert run_cli(["generate", "--config", job, "--retry-errors"]) == 0, capfd.readouterr().err
    q = {r["row_id"]: r for r in read_output(out / "questions")}
    assert q["d03"]["status"] == "ok" and len(q) == 6
    answers = {r["row_id"]: r["output"] for r in read_output(out / "answers")}
    assert any(rid.startswith("d03/") for rid in answers)  # its children exist now
    assert {k: v for k, v in answers.items() if not k.startswith("d03/")} == kept  # the rest untouched
    for stage in ("questions", "answers", "judge"):
        ids = _ids(out, stage)
        assert len(ids) == len(set(ids)), stage
    assert run_cli(["finalize", str(out)]) == 0
    assert (out / "_SUCCESS").exists()


def test_on_error_fail_stops_a_staged_job_at_the_first_bad_row(tmp_path, capfd):
    rows = [{"doc_id": f"d{i:02d}", "text": "x"} for i in range(6)]
    del rows[4]["text"]
    src = write_jsonl(tmp_path / "docs.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, out), "--on-error", "fail"]) == 1
    assert "--on-error fail; rows before it are committed" in capfd.readouterr().err
    assert "d04" not in {r["row_id"] for r in read_output(out / "questions")}


def test_a_flag_a_staged_job_cannot_honour_is_refused_in_one_line(tmp_path, capfd):
    src = stage_docs(tmp_path, 4)
    out = tmp_path / "out"
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, out), "--keep-columns", "text"]) == 2
    err = capfd.readouterr().err.strip()
    assert "--keep-columns" in err and "[[stages]]" in err and len(err.splitlines()) == 1
    assert not out.exists()  # refused before anything was written


def test_a_staged_job_never_writes_into_a_foreign_directory(tmp_path, capfd):
    """A mistyped -o onto a folder that is not ours: refused before ``_stages.json`` or a stage folder is made."""
    src = stage_docs(tmp_path, 4)
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, foreign)]) == 2
    err = capfd.readouterr().err
    assert "not a dspine-batch output" in err and "holiday.jpg" in err
    assert sorted(p.name for p in foreign.iterdir()) == ["holiday.jpg"]


@pytest.mark.parametrize("when", ["before", "after"])
def test_finalize_settles_a_retry_killed_inside_its_take_out(tmp_path, when):
    """kill -9 inside --retry-errors with its journal written: just before the part's record is swapped for the
    one without its failed rows (rolled back: the part as it was), or just after (the new part not yet published:
    rolled forward). ``finalize`` runs the one recovery first, so the part is never taken for damaged and moved aside
    and no good row is lost; the same generate command then finishes the job."""
    rows = [{"id": f"r{i:02d}", "prompt": f"question {i}"} for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    base = ["generate", str(src), "-o", str(out), "--engine-arg", "error_every=4", "--max-error-rate", "1",
            "--commit-rows", "12"]
    assert run_cli(base) == 0
    good = {r["row_id"]: r["output"] for r in read_output(out) if r["status"] == "ok"}
    everything = {r["row_id"]: r["output"] for r in read_output(out)}
    env = {**os.environ, "DSPINE_TEST_KILL_AT": f"{when}:replace:commit-*.json:1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "killpoint_cli.py"), *base, "--retry-errors"],
                       env=env, capture_output=True, timeout=300)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    assert (out / "_dspine" / "supersede-00000-of-00001.json").exists()  # killed with the journal in place
    # rolled back: every row as it was, the audit passes; rolled forward: the failed rows are out (missing)
    assert run_cli(["finalize", str(out)]) == (0 if when == "before" else 1)
    assert not (out / "_dspine" / "damaged").exists()
    assert not (out / "_dspine" / "supersede-00000-of-00001.json").exists()
    assert {r["row_id"]: r["output"] for r in read_output(out)} == (everything if when == "before" else good)
    assert run_cli(base) == 0 and run_cli(["finalize", str(out)]) == 0
    assert sorted(r["row_id"] for r in read_output(out)) == [r["id"] for r in rows]
    assert len(list_parts(str(out))) >= 1


@pytest.mark.parametrize("temp", ["_stages.json.31494.tmp", "._stages.json.31494.1a2b3c4d.tmp"])
def test_another_shard_writing_stages_json_at_that_moment_is_not_a_stranger(tmp_path, temp):
    """An array's shards start together: one may find another's ``_stages.json`` on its way in (a temp name) beside
    the stage folders it made. That is this job, not a foreign folder (a Slurm array lost a task to it)."""
    src = stage_docs(tmp_path, 4)
    out = tmp_path / "out"
    (out / "questions").mkdir(parents=True)
    (out / temp).write_text("{}")
    assert run_cli(["generate", "--config", staged_job(tmp_path, src, out)]) == 0
    assert json.loads((out / "_stages.json").read_text())["stages"] == ["questions", "answers", "judge"]
