"""Prompts from templates over a row's columns (issue 41): columns and nested structured fields, a missing column
as an error row naming the row, the column and the template, the sandbox, refusals before the model loads, and the
template as part of the run's identity. Through the CLI on the scripted engine (its chat template is
``<|role|>content``, so the rendered prompt can be read back from the token ids)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import map_rows, read_output, run_cli, write_jsonl

from dspine_batch.engines.base import SamplingParams
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.errors import RowError, UsageError
from dspine_batch.inputs.sources import resolve_inputs
from dspine_batch.requests.fields import Defaults, RowOptions
from dspine_batch.requests.mapping import MapSettings, RowMapper, resolve_columns
from dspine_batch.requests.templates import compile_template, job_templates


def _rendered(files, templates, defaults=None) -> dict[str, str]:
    """row id -> the prompt the engine would get, decoded (the scripted tokenizer is one id per character, its
    chat template ``<|role|>content``), through the pipeline's own column resolution and mapper."""
    files = resolve_inputs([str(f) for f in files])
    cols = resolve_columns(files, None, None, None, [], True, templates)
    engine = ScriptedEngine()
    d = defaults or Defaults(SamplingParams(max_new_tokens=8), RowOptions(n=1), {})
    mapper = RowMapper(MapSettings(cols, d, None, True, engine.name, engine.features), engine.tokenizer,
                       engine.max_context, warn=lambda m: None)
    return {it.row_id: ("".join(map(chr, it.requests[0].prompt_ids)) if it.requests else it.error)
            for it in map_rows(mapper, files, cols)}


def test_a_template_over_columns_and_nested_fields(tmp_path):
    rows = [{"id": "a", "topic": "tides", "level": "easy", "judge": {"score": 4, "reason": "clear"}},
            {"id": "b", "topic": "bees", "level": "hard", "judge": {"score": 2, "reason": "vague"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    tmpl = "Write a {{ level }} question about {{ topic | upper }} (score {{ judge.score }}: {{ judge['reason'] }})."
    got = _rendered([tmp_path / "in.parquet"], job_templates(tmpl, "You teach {{ topic }}."))
    assert got["a"] == ("<|system|>You teach tides.\n<|user|>Write a easy question about TIDES (score 4: clear)."
                        "\n<|assistant|>")
    assert "Write a hard question about BEES (score 2: vague)." in got["b"]
    out = tmp_path / "out"  # and end to end
    assert run_cli(["generate", str(tmp_path / "in.parquet"), "-o", str(out), "--prompt-template", tmpl,
                    "--system-template", "You teach {{ topic }}."]) == 0
    assert [r["status"] for r in read_output(out)] == ["ok", "ok"]


def test_a_row_missing_a_column_is_an_error_row_naming_row_column_and_template(tmp_path):
    tfile = tmp_path / "q.j2"
    tfile.write_text("Explain {{ topic }} to a {{ audience }}.")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "topic": "x", "audience": "child"},
                                               {"id": "b", "topic": "y"},
                                               {"id": "c", "topic": "z", "audience": "judge"}])
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--prompt-template", str(tfile),
                    "--max-error-rate", "0.5"]) == 0
    rows = {r["row_id"]: r for r in read_output(out)}
    assert rows["a"]["status"] == rows["c"]["status"] == "ok"
    assert rows["b"]["status"] == "error"
    want = f"in.jsonl: line 2 (id 'b'), field 'audience': missing (the template --prompt-template {tfile} names it)"
    assert rows["b"]["error"] == want


def test_a_parquet_input_without_a_template_column_is_refused_before_the_model_loads(tmp_path, capsys):
    pq.write_table(pa.table({"id": ["a"], "topic": ["x"]}), tmp_path / "in.parquet")
    assert run_cli(["generate", str(tmp_path / "in.parquet"), "-o", str(tmp_path / "o"),
                    "--prompt-template", "{{ topic }} for {{ audeince }}"]) == 2
    err = capsys.readouterr().err
    assert "in.parquet: no column 'audeince' for the template --prompt-template (columns: id, topic)" in err
    assert "loading the model" not in err and "Traceback" not in err


@pytest.mark.parametrize("tmpl, why", [
    ("{{ topic ", "not a valid template"),
    ("{{ topic }}", None),
])
def test_template_syntax_is_checked_up_front(tmpl, why):
    if why is None:
        assert compile_template(tmpl, "--prompt-template").columns == ("topic",)
        return
    with pytest.raises(UsageError, match=why):
        compile_template(tmpl, "--prompt-template")


def test_the_sandbox_refuses_python_internals():
    t = compile_template("{{ topic.__class__.__mro__ }}{{ topic.__init__.__globals__ }}", "--prompt-template")
    with pytest.raises(RowError, match="sandbox forbids|is undefined|has no attribute"):
        t.render({"topic": "x"}, "in.jsonl", 0)
    t = compile_template("{{ ''.__class__.__base__.__subclasses__() }}", "--prompt-template")
    with pytest.raises(RowError):
        t.render({}, "in.jsonl", 3)
    ok = compile_template("{{ topic | length }} {{ items | join(', ') }}", "--prompt-template")
    assert ok.render({"topic": "abc", "items": ["x", "y"]}, "in.jsonl", 0) == "3 x, y"


def test_template_flags_that_do_not_fit_together():
    with pytest.raises(UsageError, match="--system-template needs --prompt-template"):
        job_templates(None, "You are {{ x }}")


def test_changing_the_template_on_resume_is_refused_naming_it(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "topic": f"t{i}"} for i in range(6)])
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--prompt-template", "About {{ topic }}",
                    "--limit", "3"]) == 0
    capsys.readouterr()
    assert run_cli(["generate", str(src), "-o", str(out), "--prompt-template", "Tell me about {{ topic }}",
                    "--limit", "3"]) == 2
    err = capsys.readouterr().err
    assert "holds a different run" in err and "template" in err, err
    assert run_cli(["generate", str(src), "-o", str(out), "--prompt-template", "About {{ topic }}",
                    "--limit", "3"]) == 0  # the same template: nothing left to do


def test_a_job_file_template_table(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "topic": "owls"}])
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{src}"]\noutput = "{tmp_path / "out"}"\n'
                   '[template]\nsystem = "Be brief about {{ topic }}."\nuser = "What do {{ topic }} eat?"\n')
    assert run_cli(["generate", "--config", str(job)]) == 0
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["fingerprint_fields"]["template"] == {
        "prompt": "What do {{ topic }} eat?", "system": "Be brief about {{ topic }}."}
    got = _rendered([src], job_templates("What do {{ topic }} eat?", "Be brief about {{ topic }}."))
    assert got["a"] == "<|system|>Be brief about owls.\n<|user|>What do owls eat?\n<|assistant|>"
