"""The request parser is total: whatever JSON value a row puts in whatever field, the row becomes either valid
requests or one error line naming file, row and field. Never another exception: one row must not end a job.

Rows go through the reader (``sources._parse_line``, JSON text as a file holds it) and the mapper, as in a job.
Two inputs found by review used to escape as bare exceptions: a ``logit_bias`` key ``"²"`` (``str.isdigit``
accepts it, ``int`` refuses it) and a JSON integer beyond float range (``math.isfinite(10**400)`` raises).
"""

from __future__ import annotations

import itertools
import json
import math

import pyarrow.dataset as ds
import pytest
from helpers import run_cli, write_jsonl
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dspine_batch.engines.base import SamplingParams
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.inputs.sources import _parse_line, iter_inputs, resolve_inputs
from dspine_batch.requests.fields import INT32_MAX, ROW_FIELDS, SEED_RANGE, Defaults, RowOptions
from dspine_batch.requests.mapping import MapSettings, RowMapper, WorkItem, resolve_columns
from dspine_batch.requests.structures import StructureCheck

MSG = [{"role": "user", "content": "hi"}]
BIG = 10**400  # a JSON integer literal of 401 digits: Python's json reads it as an int beyond float range
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"x": {"type": "integer"}}}}}

# -- strategies: any JSON value, and values shaped like each field with junk inside ------------------------------
text = st.text(st.characters(codec="utf-8"), max_size=8) | st.sampled_from(
    ["²", "٣", " 5 ", "7", "0", "-1", "1e400", "NaN", "Infinity", "{", "[1, 2]", '{"type": "object"}', "",
     "9" * 30, "text", "json_schema", "json_object", "function", "auto", "required", "none", "user", "[a-z]+",
     'root ::= "a"'])
numbers = st.integers() | st.sampled_from([BIG, -BIG, 2**63, 2**64, -(2**63) - 1, 0, 1, 20, 21, 128]) | st.floats()
leaf = st.none() | st.booleans() | numbers | text
junk = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=8)
as_text = junk.map(lambda v: json.dumps(v))  # object-valued fields may be given as JSON text
schema = st.just({"type": "object"}) | st.dictionaries(
    st.sampled_from(["type", "properties", "required", "maxLength", "minimum", "enum", "items"]), junk, max_size=3)
function = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | junk},
                                 optional={"parameters": schema | junk, "description": junk})
tool = st.fixed_dictionaries({"function": function}, optional={"type": st.just("function") | junk})

SHAPED = {
    "logit_bias": st.dictionaries(st.sampled_from(["²", "٣", "5", "0", " 7", "-3", "9" * 30, "9" * 5000]) | text,
                                  numbers | junk, max_size=3) | st.lists(st.lists(numbers | text, max_size=3)),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | junk},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": schema | junk, "strict": junk,
                                                                     "name": junk}) | junk}),
    "guided_json": schema,
    "tools": st.lists(tool, max_size=2) | st.just([TOOL]),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function") | junk, "function": st.fixed_dictionaries({"name": st.just("f") | junk})}),
    "stop": st.lists(text | junk, max_size=3),
    "choice": st.lists(text, max_size=3),
    "guided_choice": st.lists(text | junk, max_size=3),
    "chat_template_kwargs": st.dictionaries(text | st.sampled_from(["messages", "enable_thinking"]), junk,
                                            max_size=2),
    "messages": st.lists(st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool"]) | junk,
        "content": text | junk | st.lists(st.fixed_dictionaries({"type": st.just("text") | junk,
                                                                  "text": text | junk}), max_size=2),
        "tool_calls": junk | st.lists(st.fixed_dictionaries({"function": function}), max_size=1)}), max_size=3),
}
unit = st.floats(0, 1, exclude_min=True)
VALID = {  # good values, so that rows of several fields also parse (and the valid side is checked too)
    "max_new_tokens": st.integers(1, 64), "max_tokens": st.integers(1, 64), "temperature": st.floats(0, 2),
    "top_p": unit, "top_k": st.integers(-1, 50), "seed": st.integers(-(2**63), 2**64 - 1), "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 4), "n": st.integers(1, 3),
    "logit_bias": st.dictionaries(st.integers(0, 60).map(str), st.floats(-100, 100), max_size=3),
    "stop": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=3), max_size=2),
    "regex": st.just("[a-z]+"), "choice": st.lists(st.sampled_from(["a", "b", "yes"]), min_size=1, max_size=3),
    "response_format": st.just({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
    "tools": st.just([TOOL]), "tool_choice": st.sampled_from(["auto", "none", "required"]),
}
FIELDS = ROW_FIELDS + ("messages", "prompt", "an_unknown_key", "model")


@st.composite
def fields(draw: st.DrawFn) -> dict:
    """A few fields, each a good value, a bare JSON value, a value shaped like the field with junk inside, or its
    JSON text."""
    names = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True))
    out = {}
    for n in names:
        bad = junk | as_text | SHAPED.get(n, junk)
        out[n] = draw(st.one_of(VALID[n], VALID[n], bad) if n in VALID else bad)
    return out


# -- the mapper, as a job builds it -----------------------------------------------------------------------------
def _mapper(path, lines):
    files = resolve_inputs([str(write_jsonl(path, lines))])
    cols = resolve_columns(files, None, None, None, [], True)
    engine = ScriptedEngine()
    defaults = Defaults(SamplingParams(max_new_tokens=16), RowOptions(), {})
    mapper = RowMapper(MapSettings(cols, defaults, None, True, engine.name, engine.features), engine.tokenizer,
                       engine.max_context, StructureCheck(), warn=lambda m: None)
    return files[0], mapper, engine


_ids = itertools.count()


def _one_row(file, mapper, obj: dict, index: int = 3) -> WorkItem:
    """``obj`` as a line of ``file`` (JSON text, as written: ``Infinity``, 401-digit integers) through the reader
    and the mapper, under an id of its own (the mapper refuses a repeated id before it reads any field)."""
    obj = {**obj, ("custom_id" if file.kind == "openai" else "id"): f"r{next(_ids)}"}
    row = _parse_line(file.name, index, json.dumps(obj).encode(), file.kind == "openai")
    ids, problems, hashes = mapper.assign_ids(_Batch(file, [index], [row]))
    return mapper.build(ids[0], file, index, row, problems[0], int(hashes[0]))


class _Batch:  # the two attributes assign_ids reads of a RowBatch
    def __init__(self, file, indices, rows):
        self.file, self.indices, self.rows = file, indices, rows

    def __len__(self):
        return len(self.rows)

    def column(self, name):
        return [r.get(name) if isinstance(r, dict) else None for r in self.rows]


def _check(item: WorkItem, name: str, vocab: int) -> None:
    """Either valid requests, or one line naming the file, the row and a field."""
    event("error" if item.error else "requests")  # (hypothesis --hypothesis-show-statistics: both kinds occur)
    if item.error is not None:
        assert not item.requests
        assert item.error.startswith(f"{name}: line 4 ") and ", field " in item.error, item.error  # (index 3)
        assert "\n" not in item.error and len(item.error) < 2000, item.error
        return
    assert item.requests
    for r in item.requests:
        p = r.params
        for v in (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty):
            assert isinstance(v, float) and math.isfinite(v)
        assert all(-100 <= b <= 100 and 0 <= t < vocab for t, b in p.logit_bias)
        assert SEED_RANGE[0] <= p.seed < SEED_RANGE[1] and 0 <= p.top_logprobs <= 20
        assert 1 <= p.max_new_tokens <= INT32_MAX and 0 <= p.top_k <= INT32_MAX and 0 <= p.min_tokens <= INT32_MAX
        assert all(isinstance(s, str) and s for s in p.stop)
        if p.structure is not None:
            assert StructureCheck().problem(p.structure) is None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=fields())
def test_any_json_in_any_field_of_an_openai_body_is_a_request_or_one_error_line(openai_mapper, body):
    file, mapper, engine = openai_mapper
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": MSG, **body}}
    _check(_one_row(file, mapper, line), file.name, engine.tokenizer.vocab_size)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(row=fields())
def test_any_json_in_any_column_of_a_row_is_a_request_or_one_error_line(jsonl_mapper, row):
    file, mapper, engine = jsonl_mapper
    _check(_one_row(file, mapper, {"prompt": "hi", **row}), file.name, engine.tokenizer.vocab_size)


def test_the_two_hidden_inputs_are_one_error_each_naming_the_field(openai_mapper):
    """The review's two inputs, each alone: a named error, not an exception (they escaped before)."""
    file, mapper, _ = openai_mapper
    for body, field in (({"logit_bias": {"²": 1}}, "body.logit_bias"), ({"temperature": BIG}, "body.temperature"),
                        ({"logit_bias": {"5": BIG}}, "body.logit_bias"), ({"top_p": -BIG}, "body.top_p"),
                        ({"seed": BIG}, "body.seed"), ({"logit_bias": {"9" * 5000: 1}}, "body.logit_bias"),
                        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "body.messages[0].role"),
                        ({"response_format": "[" * 100_000}, "body.response_format"), ({"stop": ""}, "body.stop")):
        item = _one_row(file, mapper, {"custom_id": "c", "body": {"messages": MSG, **body}})
        err = item.error
        assert err and err.startswith(f"{file.name}: line 4 (custom_id ") and f", field {field!r}: " in err, (body, err)
        assert len(err) < 400, err
    ok = _one_row(file, mapper, {"custom_id": "c", "body": {"messages": MSG, "logit_bias": {" 7 ": 2}}})
    assert ok.error is None and ok.requests[0].params.logit_bias == ((7, 2.0),)
    # a top_k beyond what engines hold (SGLang's int32 tensors) means what it says: every token
    huge = _one_row(file, mapper, {"custom_id": "c", "body": {"messages": MSG, "top_k": BIG}})
    assert huge.error is None and huge.requests[0].params.top_k == 0
    # a max_tokens beyond the context is refused naming the limit, as vLLM and OpenAI answer it (issue 50)
    huge = _one_row(file, mapper, {"custom_id": "c", "body": {"messages": MSG, "max_tokens": BIG}})
    assert ", field 'body.max_tokens': 100000000000... (401 digits) is too large: the model's context is " in huge.error
    big = _one_row(file, mapper, {"custom_id": "c", "body": {"messages": MSG, "max_tokens": 2**40}})
    assert "too large" in big.error  # (clamped to INT32_MAX first: still past any context)


def test_the_reader_turns_what_json_cannot_hold_into_row_errors(tmp_path):
    """Python's json reads ``1e400`` as inf and a 401-digit literal as an int (the mapper's to refuse), but
    refuses more than 4,300 digits (ValueError), recurses on deep nesting (RecursionError, not a ValueError),
    and turns an unpaired surrogate escape into a str that no UTF-8 writer takes: each must stay in its row."""
    raw = [b'{"id": "inf", "prompt": "hi", "temperature": 1e400}',
           b'{"id": "big", "prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
           b'{"id": "huge", "prompt": "hi", "temperature": 1' + b"0" * 5000 + b"}",
           b'{"id": "deep", "prompt": ' + b"[" * 100_000 + b"}",
           b'{"id": "lone", "prompt": "hi \\udc00"}',
           b'{"id": "key", "prompt": "hi", "chat_template_kwargs": {"\\ud800": 1}}',
           b'{"id": "pair", "prompt": "hi \\ud83d\\ude00"}']
    files = resolve_inputs([str(write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "hi"}], raw))])
    (batch,) = iter_inputs(files, None)
    rows = dict(zip(batch.indices, batch.rows, strict=True))
    assert rows[0] == {"id": "ok", "prompt": "hi"} and rows[7]["prompt"] == "hi \U0001f600"
    assert rows[1]["temperature"] == math.inf and rows[2]["temperature"] == BIG
    assert "malformed JSON" in str(rows[3]) and "malformed JSON" in str(rows[4])
    assert "in.jsonl: line 6, field 'prompt': holds a lone UTF-16 surrogate" in str(rows[5])
    assert "line 7, field 'chat_template_kwargs.\\\\ud800'" in str(rows[6]), str(rows[6])
    for row in rows.values():  # what becomes an error line must be writable text
        str(row).encode("utf-8")


def test_a_batch_with_the_hidden_bad_inputs_answers_the_good_rows(tmp_path):
    """End to end, an OpenAI batch file as users write it: the two inputs the review found become one error row
    each (file, row, field), the other rows are answered, and the exit code follows the error-rate rules."""
    def line(cid: str, extra: str = "") -> bytes:
        return (f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/chat/completions", "body": {{"messages": '
                f'[{{"role": "user", "content": "question {cid}"}}]{extra}}}}}').encode()

    bad = [line("sq", ', "logit_bias": {"\u00b2": 1}'), line("big", ', "temperature": 1' + "0" * 400)]
    for good, rate, rc in ((48, None, 0), (4, None, 3), (4, "0.5", 0)):
        raw = [line(f"g{i}") for i in range(good // 2)] + bad + [line(f"g{i}") for i in range(good // 2, good)]
        src = write_jsonl(tmp_path / f"batch{good}.jsonl", [], raw)
        out = tmp_path / f"out{good}{rate}"
        assert run_cli(["generate", str(src), "-o", str(out)] + (["--max-error-rate", rate] if rate else [])) == rc
        rows = {r["row_id"]: r for r in ds.dataset(str(out), format="parquet").to_table().to_pylist()}
        assert len(rows) == good + 2
        assert all(rows[f"g{i}"]["status"] == "ok" and rows[f"g{i}"]["output"] for i in range(good))
        name = src.name
        assert rows["sq"]["status"] == "error" and rows["big"]["status"] == "error"
        assert rows["sq"]["error"].startswith(
            f"{name}: line {good // 2 + 1} (custom_id 'sq'), field 'body.logit_bias': token id '²'")
        assert rows["big"]["error"].startswith(
            f"{name}: line {good // 2 + 2} (custom_id 'big'), field 'body.temperature': expected")
        assert len(rows["big"]["error"]) < 300  # the 401-digit value is quoted cut


# -- fixtures (module-scoped: hypothesis runs many examples per test) ------------------------------------------
@pytest.fixture(scope="module")
def openai_mapper(tmp_path_factory):
    line = {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": MSG}}
    return _mapper(tmp_path_factory.mktemp("openai") / "batch.jsonl", [line])


@pytest.fixture(scope="module")
def jsonl_mapper(tmp_path_factory):
    return _mapper(tmp_path_factory.mktemp("jsonl") / "rows.jsonl", [{"id": "r0", "prompt": "hi"}])
