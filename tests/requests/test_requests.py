"""Request fields per row (columns, OpenAI ``body``) and job-wide: parsing, canonical values, and each refusal
naming file, row and field; engine features; structures checked with xgrammar before any work."""

from __future__ import annotations

import json

import pytest
from helpers import map_rows, write_jsonl

from dspine_batch.engines.base import SamplingParams, Structure
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.errors import UsageError
from dspine_batch.inputs.sources import resolve_inputs
from dspine_batch.requests.fields import Defaults, RowOptions, identity, job_request, merge
from dspine_batch.requests.mapping import MapSettings, RowMapper, resolve_columns
from dspine_batch.requests.structures import StructureCheck, prescan

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MSG = [{"role": "user", "content": "hi"}]


def _map(tmp_path, rows, openai=False, features=None, defaults=None, samples=1):
    lines = [{"custom_id": f"c{i}", "body": {"messages": MSG, **r}} for i, r in enumerate(rows)] if openai else \
        [{"id": f"r{i}", "prompt": "hi", **r} for i, r in enumerate(rows)]
    files = resolve_inputs([str(write_jsonl(tmp_path / "in.jsonl", lines))])
    cols = resolve_columns(files, None, None, None, [], True)
    engine = ScriptedEngine()
    d = defaults or Defaults(SamplingParams(max_new_tokens=16), RowOptions(n=samples), {})
    settings = MapSettings(cols, d, None, True, "reference" if features is not None else engine.name,
                           engine.features if features is None else features)
    mapper = RowMapper(settings, engine.tokenizer, engine.max_context, warn=lambda m: None)
    return map_rows(mapper, files, cols)


def test_openai_body_fields_become_params_and_options(tmp_path):
    body = {"max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5,
            "frequency_penalty": -0.25, "repetition_penalty": 1.1, "logit_bias": {"50": 5, "7": -100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
            "n": 3, "temperature": 0.5, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "chat_template_kwargs": {"enable_thinking": False}, "model": "ignored", "stream": False}
    (item,) = _map(tmp_path, [body], openai=True)
    assert item.error is None and item.row_id == "c0" and len(item.requests) == 3
    p = item.requests[0].params
    assert (p.max_new_tokens, p.logprobs, p.top_logprobs) == (7, True, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.1)
    assert p.logit_bias == ((7, -100.0), (50, 5.0))  # sorted by token id
    assert p.structure == Structure("json_schema", json.dumps(SCHEMA, separators=(",", ":")))  # the user's order
    assert len({r.params.seed for r in item.requests}) == 3  # n samples, each with its own derived seed
    assert item.options.tools[0]["function"]["name"] == "get_weather" and not item.options.parallel_tool_calls
    assert item.options.template_kwargs == {"enable_thinking": False}
    prompt = "".join(chr(t) for t in item.requests[0].prompt_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt  # the scripted template ignores tools: system block


def test_min_tokens_without_a_structure_is_taken(tmp_path):
    (item,) = _map(tmp_path, [{"min_tokens": 2, "max_tokens": 5}], openai=True)
    assert item.error is None and item.requests[0].params.min_tokens == 2


def test_min_tokens_with_the_jobs_structure_is_refused_per_row(tmp_path):
    """A row's min_tokens against the job's structure (--regex) is that row's error, naming both; the job's
    structure alone is fine."""
    d = Defaults(SamplingParams(max_new_tokens=16, structure=Structure("regex", "a+")), RowOptions(n=1),
                 {"structure": "--regex"})
    good, bad = _map(tmp_path, [{}, {"min_tokens": 2}], openai=True, defaults=d)
    assert good.error is None
    assert bad.error and "field 'body.min_tokens'" in bad.error and "--regex" in bad.error, bad.error


def test_equal_structures_spelled_differently_are_one(tmp_path):
    a, b, c = _map(tmp_path, [{"guided_json": json.dumps(SCHEMA)},
                              {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
                              {"choice": ["b", "a", "b"]}])
    assert a.requests[0].params.structure == b.requests[0].params.structure
    assert c.requests[0].params.structure == Structure("choice", '["b","a"]')


@pytest.mark.parametrize("body, field, text", [
    ({"presence_penalty": 3}, "body.presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": "x"}, "body.frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "body.repetition_penalty", "> 0"),
    ({"min_tokens": -1}, "body.min_tokens", "integer >= 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "body.min_tokens", "more than max_new_tokens"),
    ({"min_tokens": 3, "regex": "a+"}, "body.min_tokens", "cannot be combined with body.regex"),
    ({"min_tokens": 3, "tools": TOOLS, "tool_choice": "required"}, "body.min_tokens",
     "cannot be combined with body.tool_choice"),
    ({"logprobs": "yes"}, "body.logprobs", "true or false"),
    ({"top_logprobs": 21, "logprobs": True}, "body.top_logprobs", "0..20"),
    ({"top_logprobs": 2}, "body.top_logprobs", "needs logprobs: true"),
    ({"logit_bias": {"a": 1}}, "body.logit_bias", "token id 'a'"),
    ({"logit_bias": {"5": 101}}, "body.logit_bias", "[-100, 100]"),
    ({"n": 0}, "body.n", "1..128"),
    ({"logit_bias": {"99999999": 1}}, "body.logit_bias", "not in the model's vocabulary"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "body.max_completion_tokens", "disagrees with body.max_tokens"),
    ({"response_format": {"type": "xml"}}, "body.response_format.type", "json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "body.response_format.json_schema", "expected an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "body.response_format.json_schema.schema", "expected an object"),
    ({"response_format": "{nope"}, "body.response_format", "not valid JSON"),
    ({"regex": ""}, "body.regex", "non-empty string"),
    ({"choice": []}, "body.choice", "non-empty list"),
    ({"regex": "a", "choice": ["x"]}, "body.choice", "only one structure per request"),
    ({"tools": {"name": "f"}}, "body.tools", "expected a list"),
    ({"tools": [{"type": "function", "function": {}}]}, "body.tools[0].function.name", "non-empty string"),
    ({"tools": [{"type": "retrieval"}]}, "body.tools[0].type", "only \"function\" tools"),
    ({"tool_choice": "always"}, "body.tool_choice", '"none", "auto", "required"'),
    ({"tool_choice": "required"}, "body.tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "body.tool_choice.function.name", "not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "body.tool_choice", "cannot be combined"),
    ({"chat_template_kwargs": {"messages": []}}, "body.chat_template_kwargs.messages", "set by dspine-batch"),
    ({"parallel_tool_calls": 1}, "body.parallel_tool_calls", "true or false"),
    ({"regex": "(?<=a)b"}, "body.regex", "Lookbehind is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
     "body.response_format", "Unsupported type"),
    ({"grammar": "root ::= foo"}, "body.grammar", 'Rule "foo" is not defined'),
    ({"functions": []}, "body.functions", "not a request field dspine-batch supports"),
])
def test_each_bad_body_field_is_one_line_naming_file_row_and_field(tmp_path, body, field, text):
    good, bad = _map(tmp_path, [{}, body], openai=True)
    assert good.error is None
    assert bad.error and not bad.requests and bad.row_id == "c1"  # the custom_id survives the refusal
    assert "in.jsonl: line 2" in bad.error and f"field {field!r}" in bad.error and text in bad.error, bad.error
    assert "\n" not in bad.error and "Traceback" not in bad.error


def test_columns_are_named_as_columns(tmp_path):
    (item,) = _map(tmp_path, [{"presence_penalty": 9}])
    assert "field 'presence_penalty'" in item.error


def test_a_feature_the_engine_does_not_declare_is_refused_naming_the_field(tmp_path):
    items = _map(tmp_path, [{"presence_penalty": 0.5}, {"logprobs": True}, {"choice": ["a", "b"]},
                            {"tools": TOOLS, "tool_choice": "required"}, {"temperature": 0.3, "n": 2}],
                 openai=True, features=frozenset())
    assert "field 'body.presence_penalty': not supported by the reference engine yet" in items[0].error
    assert "field 'body.logprobs': not supported by the reference engine yet" in items[1].error
    assert "field 'body.choice': not supported" in items[2].error
    assert "field 'body.tool_choice': not supported" in items[3].error  # a forced call is a JSON schema
    assert items[4].error is None and len(items[4].requests) == 2  # plain sampling and n need no feature


def test_row_fields_override_the_job_and_text_turns_its_structure_off(tmp_path):
    job = job_request({"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                       "regex": "[a-z]+", "logprobs": False, "top_logprobs": 3, "tool_choice": "auto"})

    def fail(label, msg):
        return UsageError(f"{label}: {msg}")

    over, options, labels = merge(Defaults(SamplingParams(max_new_tokens=16), RowOptions(n=2), {}), job, fail)
    defaults = Defaults(SamplingParams(**over), options, labels)
    assert defaults.params.logprobs and defaults.params.top_logprobs == 3  # --top-logprobs turns on --logprobs
    plain, text, own, off = _map(tmp_path, [{}, {"response_format": {"type": "text"}}, {"choice": ["x"]},
                                            {"logprobs": False}], openai=True, defaults=defaults)
    assert plain.requests[0].params.structure == Structure("regex", "[a-z]+") and len(plain.requests) == 2
    assert text.requests[0].params.structure is None
    assert own.requests[0].params.structure.kind == "choice"
    assert (off.requests[0].params.logprobs, off.requests[0].params.top_logprobs) == (False, 0)


def test_job_flags_are_refused_naming_the_flag(tmp_path):
    base = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "tool_choice": "auto"}
    bad_schema = tmp_path / "s.json"
    bad_schema.write_text("{not json")
    for extra, text in [({"json_schema": str(bad_schema)}, f"--json-schema {bad_schema}: not valid JSON"),
                        ({"json_schema": str(tmp_path / "nope.json")}, "--json-schema"),
                        ({"grammar": str(tmp_path / "nope.gbnf")}, "--grammar"),
                        ({"regex": "a", "choice": ["b"]}, "--choice: only one structure per request"),
                        ({"presence_penalty": 5.0}, "--presence-penalty: expected a number in [-2, 2]"),
                        ({"logit_bias": {"5": "x"}}, "--logit-bias"),
                        ({"chat_template_kwargs": "[1]"}, "--chat-template-kwargs: expected an object"),
                        ({"tools": "[{\"function\": {}}]"}, "--tools[0].function.name: expected a non-empty")]:
        with pytest.raises(UsageError, match="^" + text.replace("[", r"\[").replace("]", r"\]")[:40]):
            job_request(base | extra)


def test_identity_follows_the_schema_content_not_the_file(tmp_path):
    base = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "tool_choice": "auto"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(SCHEMA))
    b.write_text(json.dumps(SCHEMA, indent=2))
    ia = identity(job_request(base | {"json_schema": str(a)}))
    ib = identity(job_request(base | {"json_schema": str(b)}))
    assert ia == ib and ia["structure"]["kind"] == "json_schema"
    b.write_text(json.dumps({**SCHEMA, "required": ["name"]}))
    assert identity(job_request(base | {"json_schema": str(b)})) != ia


def test_prescan_checks_each_distinct_structure_once_and_names_the_first_bad_row(tmp_path):
    rows = [{"custom_id": f"c{i}", "body": {"messages": MSG, "guided_json": SCHEMA}} for i in range(50)]
    rows[30]["body"] = {"messages": MSG, "regex": "(?<=a)b"}
    rows.append({"custom_id": "plain", "body": {"messages": MSG}})
    files = resolve_inputs([str(write_jsonl(tmp_path / "b.jsonl", rows))])
    cols = resolve_columns(files, None, None, None, [], True)
    check = StructureCheck()
    found = prescan(files, cols.row_params, None, Defaults(SamplingParams(), RowOptions(), {}), check)
    assert (found.rows, found.problems, check.compiled) == (50, 1, 2)
    assert found.first.startswith("b.jsonl: line 31, field 'body.regex': xgrammar cannot compile this regex")
