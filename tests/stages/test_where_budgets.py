"""``where`` under budgets (issue 50, "bounded user code"): a predicate that cannot run is refused in one line
before the model loads; one that a row's data makes overflow, allocate without bound or recurse too deep leaves
that row not kept, with the reason in ``dropped_by`` — never a job ended by ``OverflowError`` or ``MemoryError``."""

from __future__ import annotations

import json

import pytest
from helpers import read_output, run_cli

from dspine_batch.stages.rows import Parent, parent_fields
from dspine_batch.stages.where import parse_where


def _one_stage_job(tmp_path, where: str) -> str:
    """A job of one stage over three documents whose ``score`` column is 5.0, 1e999 (infinity) and 2.0."""
    src = tmp_path / "docs.jsonl"
    src.write_text('{"doc_id": "a", "text": "tides", "score": 5.0}\n'
                   '{"doc_id": "b", "text": "bees", "score": 1e999}\n'
                   '{"doc_id": "c", "text": "owls", "score": 2.0}\n')
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{src}"]\noutput = "{tmp_path / "out"}"\nid-column = "doc_id"\nmax-new-tokens = 8\n'
                   f'[[stages]]\nname = "only"\ntemplate = "About {{{{ text }}}} ({{{{ score }}}})"\n'
                   f'where = {json.dumps(where)}\n')
    return str(job)


def test_int_of_an_infinite_score_drops_that_row_and_the_job_goes_on(tmp_path):
    assert run_cli(["generate", "--config", _one_stage_job(tmp_path, "int(score) >= 4")]) == 0
    rows = {r["row_id"]: r for r in read_output(tmp_path / "out" / "only")}
    assert [rows[k]["status"] for k in "abc"] == ["ok", "ok", "ok"]
    assert rows["a"]["kept"] and not rows["b"]["kept"] and not rows["c"]["kept"]
    assert rows["b"]["dropped_by"] == "where int(score) >= 4: OverflowError: cannot convert float infinity to integer"
    assert rows["c"]["dropped_by"] == "where int(score) >= 4"


def test_a_predicate_that_would_allocate_without_bound_drops_the_row_not_the_job(tmp_path, capsys):
    where = "len(text * 10000000000) > 0"
    assert run_cli(["generate", "--config", _one_stage_job(tmp_path, where)]) == 0
    assert "MemoryError" not in capsys.readouterr().err
    rows = read_output(tmp_path / "out" / "only")
    assert len(rows) == 3 and all(r["status"] == "ok" and not r["kept"] for r in rows)
    why = {r["row_id"]: r["dropped_by"] for r in rows}
    assert why["a"] == f"where {where}: over budget: a value of 50,000,000,000 characters or items (the budget is " \
                       "10,000,000)"
    assert why["b"].startswith(f"where {where}: over budget: a value of 40,000,000,000 characters")


@pytest.mark.parametrize("where, why", [
    ("not " * 3000 + "x", "12,001 characters: a predicate has at most 2,000"),
    ("not " * 400 + "x", "nested too deeply (at most 32 levels)"),
    ("(" * 300 + "x" + ")" * 300, "not a predicate (too many nested parentheses"),
    ("x" + " + x" * 400, "nested too deeply"),
])
def test_a_predicate_too_deep_or_too_long_is_refused_in_one_line_before_the_model_loads(tmp_path, capsys, where,
                                                                                       why):
    assert run_cli(["generate", "--config", _one_stage_job(tmp_path, where)]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err and "loading the model" not in err, err
    assert len(err.splitlines()) == 1 and len(err) < 300, err


@pytest.mark.parametrize("where, row, why", [
    ("int(score) > 3", {"score": 1e999}, "OverflowError: cannot convert float infinity to integer"),
    ("len(prompt * 10000000000) > 0", {"prompt": "abc"}, "over budget: a value of 30,000,000,000 characters"),
    ("len(prompt + prompt) > 0", {"prompt": "x" * 6_000_000}, "over budget: a value of 12,000,000 characters"),
    ("output % 2 == 1", {"output": "%9999999999s"}, "over budget: a %-format width of 9,999,999,999"),
    ("a * b > 0", {"a": 10**10000, "b": 10**10000}, "over budget: an integer of about 66,440 bits"),
    ("a / 3 > 0", {"a": 10**400}, "OverflowError: integer division result too large for a float"),
])
def test_a_row_that_blows_a_budget_is_not_kept_with_the_reason(where, row, why):
    kept, reason = parse_where(where).test(row)
    assert not kept and reason.startswith(f"where {where}: ") and why in reason, reason


def test_a_deeply_nested_json_output_reads_as_text_not_a_crash():
    """A model's JSON output nested past Python's recursion limit: ``json.loads`` raises RecursionError (not a
    ValueError); the row's fields are then its text alone, as for any output that is not a JSON object."""
    deep = "[" * 100_000 + "]" * 100_000
    fields = parent_fields(Parent("r", 0, 1, deep, "json_object", "r", {}, {}), "judge")
    assert fields["output"] == deep and "judge" in fields
