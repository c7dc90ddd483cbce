"""The whole request and the whole answer through the CLI, on the scripted engine: an OpenAI batch file using
every field, read back with pyarrow and duckdb, exported and checked line by line with the ``openai`` package's
own types, reported; job-wide structures; refusals before the model loads; engines that lack a feature."""

from __future__ import annotations

import json
import os

import duckdb
import jsonschema
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from helpers import prompts, read_output, run_cli, write_jsonl
from openai.types.chat import ChatCompletion

from dspine_batch.cli import main
from dspine_batch.engines.registry import engines_replaced
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.outdir.schema import LOGPROBS_TYPE

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _line(cid, body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smol", "messages": [{"role": "user", "content": f"question {cid}"}], **body}}


EVERY_FIELD = [
    _line("schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                               "strict": True}},
                     "n": 3, "temperature": 0.8, "seed": 7, "logprobs": True, "top_logprobs": 4}),
    _line("object", {"response_format": {"type": "json_object"}, "max_completion_tokens": 64}),
    _line("choice", {"guided_choice": ["positive", "negative"], "presence_penalty": 0.3, "frequency_penalty": 0.2,
                     "repetition_penalty": 1.05, "logit_bias": {"17": -5}}),
    _line("regex", {"regex": "[a-z]+", "top_p": 0.9, "top_k": 20}),
    _line("grammar", {"grammar": 'root ::= "yes" | "no"', "stop": ["\n"]}),
    _line("tools", {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
                    "chat_template_kwargs": {"enable_thinking": True}}),
    _line("forced", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    _line("plain", {"max_tokens": 12, "min_tokens": 1}),
]


@pytest.fixture
def every_field_run(tmp_path):
    src = write_jsonl(tmp_path / "batch.jsonl", EVERY_FIELD)
    out = tmp_path / "out"
    rc = run_cli(["generate", str(src), "-o", str(out), "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                  "--engine-arg", "reasoning=1"])
    return rc, out


def test_every_field_runs_with_no_row_refused_and_reads_back_typed(every_field_run):
    rc, out = every_field_run
    assert rc == 0
    t = ds.dataset(str(out), format="parquet").to_table()
    assert t.schema.field("logprobs").type == LOGPROBS_TYPE
    assert t.schema.field("forced_tokens_accepted").type == pa.int32()
    rows = {(r["row_id"], r["sample_index"]): r for r in t.to_pylist()}
    assert all(r["status"] == "ok" for r in rows.values()) and len(rows) == 10  # n=3 on one row
    for s in range(3):
        r = rows[("schema", s)]
        jsonschema.validate(json.loads(r["output"]), SCHEMA)
        assert r["reasoning_content"].startswith("thinking") and r["finish_reason"] == "stop"
        assert len(r["logprobs"]) == r["completion_tokens"] and len(r["logprobs"][0]["top_logprobs"]) == 4
        assert r["structure_kind"] == "json_schema" and json.loads(r["structure"]) == SCHEMA
    assert len({rows[("schema", s)]["output"] for s in range(3)}) > 1  # sampled: seeds differ per sample
    assert isinstance(json.loads(rows[("object", 0)]["output"]), dict)
    assert rows[("choice", 0)]["output"] in ("positive", "negative")
    tools = rows[("tools", 0)]
    assert tools["finish_reason"] == "tool_calls" and tools["output"] == ""
    (call,) = json.loads(tools["tool_calls"])
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    forced = json.loads(rows[("forced", 0)]["tool_calls"])[0]["function"]
    assert forced["name"] == "get_weather" and "city" in json.loads(forced["arguments"])
    assert rows[("plain", 0)]["structure_kind"] is None and rows[("plain", 0)]["logprobs"] is None
    # a reader we did not write agrees on the nested types
    con = duckdb.connect()
    n, tops = con.execute(f"SELECT count(*), max(len(lp.top_logprobs)) FROM read_parquet('{out}/*.parquet'), "
                          "unnest(logprobs) AS u(lp) WHERE row_id = 'schema'").fetchone()
    assert n == sum(rows[("schema", s)]["completion_tokens"] for s in range(3)) and tops == 4
    assert run_cli(["finalize", str(out)]) == 0  # per-row n: samples 0..n-1 of each row, exactly once


def test_export_is_an_openai_batch_results_file(every_field_run, tmp_path, capsys):
    rc, out = every_field_run
    assert rc == 0
    bad = write_jsonl(tmp_path / "bad.jsonl", [_line("ok", {}), _line("broken", {"regex": "(?<=x)"})])
    assert run_cli(["generate", str(bad), "-o", str(tmp_path / "mixed"), "--max-error-rate", "1"]) == 0
    for outdir, want in ((out, 8), (tmp_path / "mixed", 2)):
        res = tmp_path / f"{outdir.name}.jsonl"
        assert run_cli(["export", str(outdir), "--format", "openai", "-o", str(res)]) == 0
        lines = [json.loads(x) for x in res.read_text().splitlines()]
        assert len(lines) == want and len({x["id"] for x in lines}) == want
        for x in lines:
            if x["error"] is not None:
                assert x["response"] is None and x["error"]["code"] == "invalid_request"
                assert "field 'body.regex'" in x["error"]["message"] and x["custom_id"] == "broken"
                continue
            body = ChatCompletion.model_validate(x["response"]["body"])  # the openai package's own types
            assert x["response"]["status_code"] == 200 and body.object == "chat.completion"
            assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
            assert [c.index for c in body.choices] == list(range(len(body.choices)))
    lines = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    schema = ChatCompletion.model_validate(lines["schema"]["response"]["body"])
    assert len(schema.choices) == 3
    for c in schema.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.message.reasoning_content.startswith("thinking")  # an extra field, kept by the types
        assert c.logprobs.content and len(c.logprobs.content[0].top_logprobs) == 4
        assert bytes(c.logprobs.content[0].bytes).decode() == c.logprobs.content[0].token
    assert schema.usage.completion_tokens == sum(len(c.logprobs.content) for c in schema.choices)
    tools = ChatCompletion.model_validate(lines["tools"]["response"]["body"]).choices[0]
    assert tools.finish_reason == "tool_calls" and tools.message.content is None
    assert tools.message.tool_calls[0].function.name == "get_weather"
    assert run_cli(["export", str(out), "-o", "-"]) == 0  # stdout
    assert len(capsys.readouterr().out.splitlines()) == 8


def test_report_counts_answers_and_schema_validity(every_field_run, capsys):
    rc, out = every_field_run
    assert rc == 0
    capsys.readouterr()
    assert run_cli(["report", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["answers"]
    # every answer thinks first (reasoning=1), but the grammar row's stop "\n" cuts its block right after <think>
    assert s["with_reasoning"] == 9 and s["with_tool_calls"] == 2 and s["with_logprobs"] == 3
    assert s["structured"]["json_schema"]["valid"] == s["structured"]["json_schema"]["finished_stop"] == 3
    assert s["structured"]["choice"]["valid_share"] == 1.0 and s["structured"]["grammar"]["valid"] is None


def test_job_wide_schema_file_is_part_of_the_identity(tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    src = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--json-schema", str(schema), "--max-new-tokens", "200"]
    assert run_cli(args) == 0
    for r in read_output(out):
        jsonschema.validate(json.loads(r["output"]), SCHEMA)
    assert run_cli([*args[:-2], "--max-new-tokens", "8"]) == 2  # a different run
    capsys.readouterr()
    schema.write_text(json.dumps({**SCHEMA, "required": ["name"]}))
    assert run_cli(args) == 2
    assert "request.structure.digest" in capsys.readouterr().err
    cut = tmp_path / "cut"
    schema.write_text(json.dumps(SCHEMA))
    assert run_cli([*args[:3], str(cut), "--json-schema", str(schema), "--max-new-tokens", "5"]) == 0
    assert {r["finish_reason"] for r in read_output(cut)} == {"length"}
    capsys.readouterr()
    assert run_cli(["report", str(cut), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["answers"]["structured"]["json_schema"]["cut_by_length"] == 6


def test_bad_structures_are_refused_before_the_model_loads(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "wat"}}}))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "a"), "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err
    assert f"--json-schema {schema}: xgrammar cannot compile this json schema: Unsupported type" in err
    assert "loading the model" not in err and "Traceback" not in err and not (tmp_path / "a").exists()
    rows = [_line("a", {}), _line("b", {"grammar": "root ::= undefined_rule"})]
    batch = write_jsonl(tmp_path / "batch.jsonl", rows)
    assert run_cli(["generate", str(batch), "-o", str(tmp_path / "b"), "--on-error", "fail"]) == 2
    err = capsys.readouterr().err
    assert "batch.jsonl: line 2, field 'body.grammar': xgrammar cannot compile this grammar" in err
    assert "loading the model" not in err
    assert run_cli(["generate", str(batch), "-o", str(tmp_path / "c"), "--max-error-rate", "1"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 rows ask for a structure that cannot be used" in err
    assert err.index("structures:") < err.index("loading the model")


def _plain_engine(model, draft, args):
    return ScriptedEngine(name="plain", features=frozenset())


def test_an_engine_without_a_feature_refuses_it_by_name(tmp_path, capsys):
    batch = write_jsonl(tmp_path / "batch.jsonl", [_line("a", {"presence_penalty": 0.5}), _line("b", {"n": 2}),
                                                   _line("c", {"top_logprobs": 2, "logprobs": True})])
    os.environ["DSPINE_BATCH_PROGRESS"] = "none"
    with engines_replaced(_plain_engine):
        for argv, code in ((["generate", str(batch), "-o", str(tmp_path / "a"), "--max-error-rate", "1"], 0),
                           (["generate", str(batch), "-o", str(tmp_path / "b"), "--presence-penalty", "0.1"], 2)):
            with pytest.raises(SystemExit) as e:
                main(argv)
            assert e.value.code == code
    assert "--presence-penalty: not supported by the plain engine yet" in capsys.readouterr().err
    got = {r["row_id"]: r for r in read_output(tmp_path / "a")}
    assert "field 'body.presence_penalty': not supported by the plain engine yet" in got["a"]["error"]
    assert "field 'body.logprobs': not supported by the plain engine yet" in got["c"]["error"]
    assert [r["sample_index"] for r in read_output(tmp_path / "a") if r["row_id"] == "b"] == [0, 1]


def test_job_file_tables_and_env_set_the_request_fields(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(4))
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{src}"]\noutput = "{tmp_path / "a"}"\nchoice = ["yes", "no"]\nlogprobs = true\n'
                   'top-logprobs = 2\nlogit_bias = {"5" = -1.5}\nchat_template_kwargs = {enable_thinking = false}\n'
                   'tool-choice = "none"\n')
    assert run_cli(["generate", "--config", str(job)]) == 0
    got = read_output(tmp_path / "a")
    assert {r["output"] for r in got} <= {"yes", "no"} and all(len(r["logprobs"][0]["top_logprobs"]) == 2
                                                              for r in got)
    request = json.loads((tmp_path / "a" / "_manifest.json").read_text())["fingerprint_fields"]["settings"]["request"]
    assert request["logit_bias"] == [[5, -1.5]] and request["chat_template_kwargs"] == '{"enable_thinking":false}'
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "b")],
                   env={"DSPINE_BATCH_RESPONSE_FORMAT": '{"type": "json_object"}'}) == 0
    assert all(isinstance(json.loads(r["output"]), dict) for r in read_output(tmp_path / "b"))


def test_parquet_columns_are_request_fields(tmp_path, capsys):
    import pyarrow.parquet as pq

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"], "choice": [["red", "blue"], None],
                             "response_format": [None, json.dumps({"type": "json_schema",
                                                                   "json_schema": {"schema": SCHEMA}})],
                             "n": [2, None]}), src)
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out")]) == 0
    assert "per-row request fields from columns: response_format, choice, n" in capsys.readouterr().err
    got = read_output(tmp_path / "out")
    assert [(r["row_id"], r["sample_index"]) for r in got] == [("a", 0), ("a", 1), ("b", 0)]
    assert got[0]["output"] in ("red", "blue")
    jsonschema.validate(json.loads(got[2]["output"]), SCHEMA)


def test_min_tokens_with_a_job_structure_is_refused_before_the_model_loads(tmp_path, capsys):
    """Issue 43: min_tokens against a grammar that has ended used to end the job; the pair is refused up front,
    naming both flags, so neither engine ever runs it."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "a"), "--regex", "[a-z]+", "--min-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "--min-tokens: cannot be combined with --regex" in err, err
    assert "loading the model" not in err and "Traceback" not in err and not (tmp_path / "a").exists()
