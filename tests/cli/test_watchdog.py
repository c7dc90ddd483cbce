"""A hang that ends (issue 40, item 6): an engine that stops producing with requests in flight is noticed by the
watchdog (--stall-seconds), the finished rows are committed, the run exits 75 and the same command finishes the job
exactly once; --request-timeout turns one stuck row into an error row instead of a stalled job. No timed
assertion: a short --stall-seconds, then exit codes and committed rows."""

from __future__ import annotations

import pyarrow.dataset as ds
from helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.ops.status import format_status, read_status
from dspine_batch.outdir.output import open_output

TAG = "00000-of-00001"


def _ids(out) -> list[str]:
    return sorted(ds.dataset(str(out), format="parquet").to_table().column("row_id").to_pylist())


def test_a_stalled_engine_is_stopped_with_its_rows_committed_and_the_resume_finishes_once(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--commit-rows", "4", "--max-in-flight", "2", "--stall-seconds", "1"]
    assert run_cli([*args, "--engine-arg", "stall_after=9"]) == 75
    err = capfd.readouterr().err
    assert "stalled: nothing produced for" in err and "request(s) in flight (oldest: 'r000" in err
    assert "engine: scripted engine, 1 request(s) held" in err and "exiting 75" in err
    assert len(_ids(out)) == 9  # every finished row committed, nothing else
    assert open_output(str(out)).read_state(TAG)["stalled"].startswith("stalled: nothing produced")
    assert "    stalled: nothing produced for" in format_status(read_status(str(out)))
    assert run_cli(args) == 0
    assert _ids(out) == sorted(r["id"] for r in prompts(30))


def test_a_slow_engine_that_keeps_producing_never_trips_the_watchdog(tmp_path, capfd):
    """Each row takes a third of --stall-seconds and the whole run several times it: the watchdog measures
    from the last result, not from the start, so it never fires — while the same settings on an engine that
    stops producing do fire (the second half: the check is armed)."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(8))
    args = ["generate", str(src), "--stall-seconds", "1", "--max-in-flight", "1", "--engine-arg", "latency=0.3"]
    assert run_cli([*args, "-o", str(tmp_path / "out")]) == 0
    assert "stalled" not in capfd.readouterr().err
    assert len(_ids(tmp_path / "out")) == 8
    assert run_cli([*args, "-o", str(tmp_path / "out2"), "--engine-arg", "stall_after=3"]) == 75
    assert "stalled: nothing produced for" in capfd.readouterr().err


def test_a_request_timeout_makes_a_stuck_row_an_error_row(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--request-timeout", "0.5", "--max-error-rate", "1",
                    "--engine-arg", "hang_every=7", "--engine-arg", "latency=0.01"]) == 0
    rows = read_output(out)
    bad = [r for r in rows if r["status"] == "error"]
    assert len(rows) == 20 and bad and all("request timed out after 0.5s (--request-timeout)" in r["error"]
                                           for r in bad)
    assert "error row: row 'r000" in capfd.readouterr().err


def test_an_engine_that_ignores_the_timeout_still_cannot_stall_on_the_same_row_twice(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--request-timeout", "0.5", "--stall-seconds", "1",
            "--max-error-rate", "1", "--engine-arg", "hang_every=7", "--engine-arg", "latency=0.01"]
    assert run_cli([*args, "--engine-arg", "honor_timeout=0"]) == 75  # the last stuck request stalls the end
    assert "stalled: nothing produced" in capfd.readouterr().err
    rows = read_output(out)
    assert len(rows) == 20 and any("--request-timeout" in (r["error"] or "") for r in rows)
    assert run_cli([*args, "--engine-arg", "honor_timeout=0"]) == 0  # nothing left: the stuck rows are errors
    assert _ids(out) == sorted(r["id"] for r in prompts(20))
