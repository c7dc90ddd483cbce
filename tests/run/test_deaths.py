"""Engine deaths told apart (issue 43): a crash that repeats on the same row is not requeued forever. A death's
rows in flight run alone on the next start; one the engine dies on again becomes an error row naming the engine's
message, and a transient death's rows simply finish. Driven through the CLI on the scripted engine, whose
``poison=ROW`` crashes whenever that row is in flight and ``crash_after=N`` once, after N results."""

from __future__ import annotations

import json

from helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.errors import EngineDied
from dspine_batch.run.deaths import Death, after_death


def _state(out) -> dict:
    (path,) = (out / "_dspine").glob("state-*.json")
    return json.loads(path.read_text())


def test_a_crash_that_repeats_on_one_row_makes_it_an_error_row_and_the_rest_finishes(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(24))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--commit-rows", "4", "--max-in-flight", "4",
            "--engine-arg", "latency=0.002", "--engine-arg", "poison=r00010", "--max-error-rate", "0.5"]
    assert run_cli(args) == 75  # first death: r00010 and its neighbours in flight
    err = capsys.readouterr().err
    assert "the engine died with" in err and "rows in flight" in err and "scripted engine crashed" in err
    first = _state(out)["engine_death"]
    assert "r00010" in first["rows"] and len(first["rows"]) > 1  # neighbours are suspects too
    committed = {r["row_id"] for r in read_output(out)}
    assert not committed & set(first["rows"])
    assert run_cli(args) == 75  # the neighbours finish alone; r00010 kills the engine again, alone
    err = capsys.readouterr().err
    assert "running them alone first" in err
    assert "the engine died again with row r00010 alone in flight" in err and "not a transient death" in err
    rows = {r["row_id"]: r for r in read_output(out)}
    assert rows["r00010"]["status"] == "error"
    assert "died twice with this row in flight" in rows["r00010"]["error"]
    assert "scripted engine crashed on row r00010" in rows["r00010"]["error"]
    assert all(rows[r]["status"] == "ok" for r in first["rows"] if r != "r00010" and r in rows)
    assert run_cli(args) == 0  # the rest, with the poisonous row already an error row: no third death
    got = read_output(out)
    assert [r["row_id"] for r in got] == [p["id"] for p in prompts(24)]  # every row exactly once
    assert [r["row_id"] for r in got if r["status"] == "error"] == ["r00010"]
    assert "engine_death" not in _state(out)


def test_a_transient_death_retries_its_rows_alone_and_they_finish(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / "out"
    base = ["generate", str(src), "-o", str(out), "--commit-rows", "4", "--max-in-flight", "3",
            "--engine-arg", "latency=0.002"]
    assert run_cli([*base, "--engine-arg", "crash_after=7"]) == 75
    suspects = _state(out)["engine_death"]["rows"]
    assert suspects
    capsys.readouterr()
    assert run_cli(base) == 0
    err = capsys.readouterr().err
    assert f"the last engine death was transient: the {len(suspects)} uncommitted row(s)" in err
    got = read_output(out)
    assert [r["row_id"] for r in got] == [p["id"] for p in prompts(20)]
    assert all(r["status"] == "ok" for r in got)
    assert "engine_death" not in _state(out)


def test_the_record_of_a_death():
    e = EngineDied("worker  exited\\nwith 137")
    e.in_flight = ["b", "a", "b"]
    d = after_death(None, e)
    assert d.rows == ["b", "a"] and d.deaths == 1 and "\n" not in d.message
    assert after_death(d, EngineDied("x")).deaths == 2 and after_death(d, EngineDied("x")).rows == []
    assert Death.of(d.as_dict()) == d and Death.of(None) is None and Death.of({"rows": 5}) is None


def test_rows_run_alone_after_a_death_are_logged_like_any_other(tmp_path, capsys):
    """The suspects of a death run first, alone; their errors go through the same error log as the run's (the
    first of a kind is logged, the kinds are counted at the end), under the same --request-timeout record."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / "out"
    base = ["generate", str(src), "-o", str(out), "--commit-rows", "4", "--max-in-flight", "3",
            "--engine-arg", "latency=0.002", "--max-error-rate", "1", "--engine-arg", "error_every=1"]
    assert run_cli([*base, "--engine-arg", "crash_after=7"]) == 75  # every request fails; then the engine dies
    suspects = _state(out)["engine_death"]["rows"]
    assert suspects
    capsys.readouterr()
    assert run_cli([*base, "--request-timeout", "30"]) == 0
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if "error row: row " in line)
    assert first.split("row '")[1].split("'")[0] in suspects  # the suspects ran first, through the error log
    assert "error row(s) this run, by kind" in err
