"""Templates under budgets (issue 50, "bounded user code"): a template that cannot compile is refused in one line
before the model loads; one that a row's data makes loop, call, allocate or recurse without bound is that row's
error naming the budget — never a hang (a hidden input with nested ``range(100000)`` loops hung a job 180 s) or
a job killed for memory."""

from __future__ import annotations

import pytest
from helpers import read_output, run_cli, write_jsonl

from dspine_batch.errors import RowError, UsageError
from dspine_batch.requests.templates import compile_template

NESTED = "{% for i in range(loops) %}{% for j in range(loops) %}{% endfor %}{% endfor %}About {{ topic }}"


def test_nested_loops_on_a_hidden_row_make_that_row_an_error_and_the_job_ends(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "loops": 3, "topic": "tides"},
                                               {"id": "b", "loops": 100000, "topic": "bees"},
                                               {"id": "c", "loops": 2, "topic": "owls"}])
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--prompt-template", NESTED,
                    "--max-error-rate", "0.5"]) == 0
    rows = {r["row_id"]: r for r in read_output(out)}
    assert rows["a"]["status"] == rows["c"]["status"] == "ok"
    assert rows["b"]["status"] == "error"
    assert rows["b"]["error"] == ("in.jsonl: line 2 (id 'b'): the template --prompt-template is over budget on this "
                                  "row: more than 1,000,000 loop iterations")


@pytest.mark.parametrize("template, why", [
    ("{{ topic * 10000000000 }}", "a value of 50,000,000,000 characters or items (the budget is 10,000,000)"),
    ("{{ 2 ** 10000000000 }}", "an integer of about 10,000,000,000 bits"),
    ("{{ topic|center(10000000000) }}", "center's argument of 10,000,000,000"),
    ("{{ topic.rjust(10000000000) }}", "rjust's argument of 10,000,000,000"),
    ("{{ '%9999999999s' % topic }}", "a %-format width of 9,999,999,999"),
    ("{{ '%9999999999s'|format(topic) }}", "a %-format width of 9,999,999,999"),
    ("{{ '{:>9999999999}'.format(topic) }}", "a format width of 9,999,999,999"),
    ("{{ (topic * 5000)|replace('', topic * 5000) }}", "a string of 625,050,000 characters"),
    ("{% set ns = namespace(s=topic) %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "a string of 10,485,760 characters"),
    ("{% set l = [1] %}{% for i in range(64) %}{{ l.extend(l) }}{% endfor %}", "a list of 16,777,216"),
    ("{% macro f(k) %}{% if k %}{{ f(k - 1) }}{{ f(k - 1) }}{% endif %}{% endmacro %}{{ f(64) }}",
     "more than 100,000 calls"),
    ("{% for x in [1] recursive %}{{ loop([x, x]) }}{% endfor %}", "RecursionError"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "more than 1,000,000 loop iterations"),
    ("{% set d = dict.fromkeys(range(100000)) %}{% for a in d %}{% for b in d %}{% endfor %}{% endfor %}",
     "more than 1,000,000 loop iterations"),
    ("{% for i in range(3000) %}{{ topic * 3000 }}{% endfor %}", "a rendered text of 10,"),
])
def test_a_row_that_blows_a_budget_is_that_rows_error(template, why):
    t = compile_template(template, "--prompt-template")
    with pytest.raises(RowError, match="over budget on this row") as e:
        t.render({"topic": "tides"}, "in.jsonl", 4)
    assert why in str(e.value) and str(e.value).startswith("in.jsonl: line 5"), str(e.value)


@pytest.mark.parametrize("template", [
    "{{ " + "(" * 3000 + "x" + ")" * 3000 + " }}",
    "{% if a %}" * 3000 + "x" + "{% endif %}" * 3000,
    "{{ " + "-" * 3000 + "x }}",
])
def test_a_template_nested_too_deeply_is_refused_in_one_line(tmp_path, capsys, template):
    with pytest.raises(UsageError, match="--prompt-template: not a valid template: nested too deeply"):
        compile_template(template, "--prompt-template")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "x": 1, "a": 1}])
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), "--prompt-template", template]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nested too deeply" in err and "loading the model" not in err, err
