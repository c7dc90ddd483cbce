"""Reading the answer: reasoning and tool-call parsers on outputs as the models write them, and the answer step
(finish_reason, call ids, token texts of logprobs)."""

from __future__ import annotations

import json

import pytest

from dspine_batch.engines.base import Result
from dspine_batch.engines.scripted import ScriptedTokenizer
from dspine_batch.requests.answers import Answers, call_id
from dspine_batch.requests.fields import RowOptions
from dspine_batch.requests.reasoning import split_reasoning
from dspine_batch.requests.tool_calls import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "detailed": {"type": "boolean"}, "threshold": {"type": "number"},
                                     "options": {"type": "object"}, "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]

QWEN3_THINKING = """<think>
The user wants the weather in Paris for three days. I should call get_weather with city Paris and days 3.
</think>

<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
</tool_call>"""

HERMES_TWO_CALLS = """I'll look both up for you.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}
</tool_call>"""

QWEN3_CODER = """Let me check that.

<tool_call>
<function=get_weather>
<parameter=city>
San Francisco
</parameter>
<parameter=days>
3
</parameter>
<parameter=detailed>
true
</parameter>
<parameter=threshold>
0.5
</parameter>
<parameter=options>
{"units": "metric"}
</parameter>
<parameter=zip>
02134
</parameter>
</function>
</tool_call>"""


@pytest.mark.parametrize("parser, text, reasoning, answer", [
    ("qwen3", "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4.", "Two plus two is four.",
     "The answer is 4."),
    ("qwen3", "The enable_thinking=false prompt already closed the block.\nThe answer is 4.", None,
     "The enable_thinking=false prompt already closed the block.\nThe answer is 4."),
    ("qwen3", "Thinking that began in the prompt (Qwen3 thinking models).\n</think>\n\nFour.",
     "Thinking that began in the prompt (Qwen3 thinking models).", "Four."),
    ("qwen3", "<think>\nStill thinking when max_new_tokens ran out", "Still thinking when max_new_tokens ran out", ""),
    ("qwen3", "<think>\n\n</think>\n\nNo thoughts.", None, "No thoughts."),
    ("deepseek-r1", "Okay, the user asks for 2+2. That is 4.\n</think>\n\n**4**", "Okay, the user asks for 2+2. "
     "That is 4.", "**4**"),
    ("deepseek-r1", "<think>\nHmm.\n</think>\nDone.", "Hmm.", "Done."),
    ("deepseek-r1", "All reasoning, cut off", "All reasoning, cut off", ""),
])
def test_reasoning_parsers(parser, text, reasoning, answer):
    assert split_reasoning(text, parser) == (reasoning, answer)


def test_hermes_reads_qwen3_output_after_its_reasoning():
    reasoning, text = split_reasoning(QWEN3_THINKING, "qwen3")
    assert reasoning.startswith("The user wants the weather")
    content, calls = parse_tool_calls(text, "hermes", TOOLS)
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]


def test_hermes_several_calls_and_the_text_before_them():
    content, calls = parse_tool_calls(HERMES_TWO_CALLS, "hermes", TOOLS)
    assert content == "I'll look both up for you."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["arguments"]) == {"timezone": "Europe/Paris"}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_new_tokens
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not one of the row's tools
    '<tool_call>\nget_weather(city="Paris")\n</tool_call>',  # not JSON
    "No call here, just <b>markup</b>.",
])
def test_hermes_keeps_what_it_cannot_read_in_the_text(text):
    assert parse_tool_calls(text, "hermes", TOOLS) == (text, [])


def test_hermes_accepts_arguments_written_as_json_text_and_an_unclosed_last_block():
    content, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}',
                                      "hermes", TOOLS)
    assert content == "" and calls == [{"name": "get_time", "arguments": '{"tz": "UTC"}'}]


def test_qwen3_coder_types_values_by_the_tool_schema():
    content, calls = parse_tool_calls(QWEN3_CODER, "qwen3_coder", TOOLS)
    assert content == "Let me check that."
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "San Francisco", "days": 3, "detailed": True,
                                                 "threshold": 0.5, "options": {"units": "metric"}, "zip": "02134"}


def test_qwen3_coder_multiline_string_values_and_unknown_parameters_stay_text():
    text = ("<tool_call>\n<function=get_time>\n<parameter=note>\nline one\nline two\n</parameter>\n"
            "<parameter=count>\n7\n</parameter>\n</function>\n</tool_call>")
    _, calls = parse_tool_calls(text, "qwen3_coder", TOOLS)
    assert json.loads(calls[0]["arguments"]) == {"note": "line one\nline two", "count": "7"}  # no schema: text
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert parse_tool_calls(cut, "qwen3_coder", TOOLS) == (cut, [])


def _result(text, finish="stop", logprobs=None, tokens=()):
    return Result("row", 1, list(tokens), text, finish, 3, len(tokens), logprobs=logprobs)


def test_answer_step_sets_columns_finish_reason_and_stable_ids():
    answers = Answers(ScriptedTokenizer(), "qwen3", "hermes", warn=pytest.fail)
    opts = RowOptions(tools=TOOLS)
    r = _result(QWEN3_THINKING)
    answers.apply(opts, r)
    assert r.text == "" and r.reasoning_content.startswith("The user wants") and r.finish_reason == "tool_calls"
    calls = json.loads(r.tool_calls)
    assert calls == [{"id": call_id("row", 1, 0), "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]
    cut = _result(HERMES_TWO_CALLS, "length")
    answers.apply(RowOptions(tools=TOOLS, parallel_tool_calls=False), cut)
    assert cut.finish_reason == "length" and len(json.loads(cut.tool_calls)) == 1  # parallel_tool_calls: false
    none = _result(HERMES_TWO_CALLS)
    answers.apply(RowOptions(tools=TOOLS, tool_choice="none"), none)
    assert none.tool_calls is None and none.text == HERMES_TWO_CALLS and none.finish_reason == "stop"


def test_a_forced_call_is_the_output_itself_and_tools_without_a_parser_warn_once():
    warnings = []
    answers = Answers(ScriptedTokenizer(), None, None, warn=warnings.append)
    forced = _result('{"name": "get_time", "arguments": {"tz": "UTC"}}')
    answers.apply(RowOptions(tools=TOOLS, tool_choice="required"), forced)
    assert forced.text == "" and json.loads(forced.tool_calls)[0]["function"]["name"] == "get_time"
    for _ in range(3):
        answers.apply(RowOptions(tools=TOOLS), _result(HERMES_TWO_CALLS))
    assert len(warnings) == 1 and "--tool-call-parser" in warnings[0]


def test_logprobs_get_token_texts_and_follow_the_cut_tokens():
    answers = Answers(ScriptedTokenizer(), None, None, warn=pytest.fail)
    r = _result("ab", logprobs=[(1, -0.5, ((1, -0.5), (2, -1.0))), (2, -0.25, ()), (3, -9.0, ())], tokens=(1, 2))
    answers.apply(None, r)
    assert r.logprobs == [
        {"token_id": 1, "token": "b", "bytes": b"b", "logprob": -0.5, "top_logprobs": [
            {"token_id": 1, "token": "b", "bytes": b"b", "logprob": -0.5},
            {"token_id": 2, "token": "c", "bytes": b"c", "logprob": -1.0}]},
        {"token_id": 2, "token": "c", "bytes": b"c", "logprob": -0.25, "top_logprobs": []}]  # a stop string cut 3


def _strict(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("args", ['{"threshold": NaN}', '{"threshold": -Infinity}', '{"threshold": 1e400}',
                                  '"{\\"threshold\\": Infinity}"', '{"options": {"deep": [1, NaN]}}'])
def test_hermes_refuses_arguments_that_are_json_only_to_python_and_says_why(args):
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    refused: list[str] = []
    content, calls = parse_tool_calls(text, "hermes", TOOLS, refused)
    assert calls == [] and content == text  # the call stays in the text, whole
    assert len(refused) == 1 and "not strict JSON" in refused[0] and "stays in the text" in refused[0]


def test_arguments_that_are_written_are_strict_json():
    big = "1" + "0" * 400  # a huge integer is JSON (only floats overflow)
    text = f'<tool_call>{{"name": "get_weather", "arguments": {{"days": {big}, "threshold": 0.5}}}}</tool_call>'
    (call,) = parse_tool_calls(text, "hermes", TOOLS)[1]
    assert _strict(call["arguments"]) == {"days": 10**400, "threshold": 0.5}
    for value in ("nan", "inf", "-Infinity", "1e400"):  # qwen3_coder: a number that is not finite stays a string
        coder = f"<tool_call><function=get_weather><parameter=threshold>{value}</parameter></function></tool_call>"
        (call,) = parse_tool_calls(coder, "qwen3_coder", TOOLS)[1]
        assert _strict(call["arguments"]) == {"threshold": value}
    coder = "<tool_call><function=get_weather><parameter=options>{\"a\": NaN}</parameter></function></tool_call>"
    assert _strict(parse_tool_calls(coder, "qwen3_coder", TOOLS)[1][0]["arguments"]) == {"options": '{"a": NaN}'}


def test_a_forced_call_beyond_a_doubles_range_stays_text_with_a_warning():
    warnings: list[str] = []
    answers = Answers(ScriptedTokenizer(), None, None, warn=warnings.append)
    text = '{"name": "get_weather", "arguments": {"threshold": 1e400}}'  # a schema's grammar allows it
    for _ in range(2):
        r = _result(text)
        answers.apply(RowOptions(tools=TOOLS, tool_choice="required"), r)
        assert r.tool_calls is None and r.text == text and r.finish_reason == "stop"
    assert len(warnings) == 1 and "row 'row' (sample 1)" in warnings[0] and "1e400" in warnings[0]


def test_a_completion_nested_beyond_the_stack_stays_text():
    """A model can write a thousand ``[``: Python's json then raises RecursionError, which must not escape."""
    deep = "[" * 100_000
    answers = Answers(ScriptedTokenizer(), None, "hermes", warn=pytest.fail)
    call = '<tool_call>{"name": "get_time", "arguments": %s}</tool_call>'
    for options, text in ((RowOptions(tools=TOOLS, tool_choice="required"), deep),
                          (RowOptions(tools=TOOLS), call % deep), (RowOptions(tools=TOOLS), call % f'"{deep}"')):
        r = _result(text)
        answers.apply(options, r)
        assert r.tool_calls is None and r.text == text
    coder = f"<tool_call><function=get_weather><parameter=options>{deep}</parameter></function></tool_call>"
    assert json.loads(parse_tool_calls(coder, "qwen3_coder", TOOLS)[1][0]["arguments"]) == {"options": deep}
