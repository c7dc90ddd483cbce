"""``export --format openai`` streaming: a row's samples stay one line across record-batch boundaries and after
compaction; every line passes the ``openai`` package's types."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import prompts, run_cli, write_jsonl
from openai.types.chat import ChatCompletion

from dspine.models.tokenizer import HFTokenizer
from dspine_batch.engines.base import Request, Result
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.ops import export


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_samples_straddling_batches_and_parts_stay_one_line(tmp_path, monkeypatch):
    rows = prompts(40)
    rows[9]["prompt"] = ""  # an error row: one error line
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--num-samples", "3", "--temperature", "0.9",
                    "--commit-rows", "7", "--max-error-rate", "1", "--top-logprobs", "2"]) == 0
    monkeypatch.setattr(export, "BATCH_ROWS", 4)  # 3 samples a row: rows straddle every other batch
    res = tmp_path / "a.jsonl"
    stats = export.export_openai(str(out), str(res))
    lines = _lines(res)
    assert (stats.lines, stats.ok, stats.errors) == (40, 39, 1)
    assert [x["custom_id"] for x in lines] == [r["id"] for r in rows]
    for x in lines:
        if x["custom_id"] == rows[9]["id"]:
            assert x["response"] is None and "field 'prompt': empty prompt" in x["error"]["message"]
            continue
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert [c.index for c in body.choices] == [0, 1, 2]
        for c in body.choices:  # one entry per completion token, whose bytes add up to the content
            assert b"".join(bytes(t.bytes) for t in c.logprobs.content) == c.message.content.encode()
            assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in c.logprobs.content)
        assert body.usage.completion_tokens == sum(len(c.logprobs.content) for c in body.choices)
    assert run_cli(["finalize", str(out), "--compact"]) == 0
    again = tmp_path / "b.jsonl"
    export.export_openai(str(out), str(again))

    def strip(xs):
        return [{**x, "response": x["response"] and {**x["response"], "body": {**x["response"]["body"],
                                                                               "created": 0}}} for x in xs]

    assert strip(_lines(again)) == strip(lines)  # compaction changes the commit time only


def test_export_of_a_folder_that_is_not_an_output_is_one_line(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert run_cli(["export", str(tmp_path / "x"), "-o", str(tmp_path / "r.jsonl")]) == 2
    assert "no _manifest.json (not a dspine-batch output)" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()


# -- what export writes is what it claims: each token's own bytes, strict JSON -----------------------------------
def _sentencepiece_dir(path: Path) -> Path:
    """A tiny SentencePiece-style tokenizer (Llama's layout: ``▁`` for a space, ``<0xNN>`` byte fallback for
    anything outside its vocabulary) with a chat template, as a model dir."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", "h", "i", "é", "o", "k", "▁é", "ok"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "é"), ("o", "k")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m.content }}\n{% endfor %}"}))
    return path


TEXT = "hi é 😊 ok ü"  # an emoji (4 bytes) and ü (2 bytes) outside the vocabulary: one token per byte


def test_token_bytes_add_up_to_the_text_where_tokens_split_characters(tmp_path):
    from dspine.embedded.smollm2 import embedded_target_path

    sp = HFTokenizer(_sentencepiece_dir(tmp_path / "sp"))
    ids = sp.encode(TEXT)
    assert [sp.tok.id_to_token(i) for i in ids[-4:]] == ["ok", "▁", "<0xC3>", "<0xBC>"]
    pieces = [sp.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode() and b"\xf0" in pieces and b"\xc3" in pieces  # one byte per token
    assert "\ufffd" in sp.token_text(ids[pieces.index(b"\xf0")])  # which a token's text cannot say
    smol = HFTokenizer(embedded_target_path())  # GPT-2 byte-level BPE: the emoji is split across two tokens
    ids = smol.encode(TEXT)
    assert sum("\ufffd" in smol.token_text(i) for i in ids) >= 2
    assert b"".join(smol.token_bytes(i) for i in ids) == TEXT.encode()
    assert smol.token_bytes(smol.token_id("<|im_start|>")) == b"<|im_start|>"  # special tokens: their text


@dataclass
class _TokenizerEngine(ScriptedEngine):
    """The scripted engine answering fixed texts through a real tokenizer, with logprobs (-inf among the
    alternatives: a token the model rules out)."""

    tok: Any = None

    @property
    def tokenizer(self) -> Any:
        return self.tok

    def _result(self, req: Request, latency: float) -> Result:
        answers = {"nan": TEXT + ' <tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
                   "big": TEXT + ' <tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>',
                   "good": TEXT + ' <tool_call>{"name": "f", "arguments": {"x": 1.5}}</tool_call>'}
        ids = self.tok.encode(answers.get(req.row_id, TEXT))
        r = Result(req.row_id, req.sample_index, ids, self.tok.decode(ids), "stop", len(req.prompt_ids), len(ids))
        if req.params.logprobs:
            r.logprobs = [(t, -0.5, ((t, -0.5), (0, float("-inf")))[:req.params.top_logprobs]) for t in ids]
        return r


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_export_writes_each_tokens_own_bytes_and_strict_json(tmp_path, capsys):
    """End to end: a completion with characters split across tokens and a -inf alternative, and tool calls
    whose arguments Python's json reads but strict JSON has not (NaN, 1e400): every exported line parses
    strictly and as the openai package's types, bytes add up to the content's UTF-8, and the calls that are not
    strict JSON stay in the text (with a warning saying why)."""
    engine = _TokenizerEngine(tok=HFTokenizer(_sentencepiece_dir(tmp_path / "sp")))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    lines = [{"custom_id": cid, "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                         "top_logprobs": 2, **({"tools": [tool]} if cid != "plain" else {})}}
             for cid in ("plain", "nan", "big", "good")]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out, res = tmp_path / "out", tmp_path / "res.jsonl"
    assert run_cli(["generate", str(src), "-o", str(out), "--tool-call-parser", "hermes"],
                   loader=lambda model, draft, args: engine) == 0
    assert "not strict JSON (NaN is not JSON)" in capsys.readouterr().err
    assert run_cli(["export", str(out), "-o", str(res)]) == 0
    got = {}
    for text in res.read_text().splitlines():
        x = _strict(text)
        got[x["custom_id"]] = ChatCompletion.model_validate(x["response"]["body"]).choices[0]
    for cid in ("plain", "nan", "big"):
        c = got[cid]
        assert c.message.tool_calls is None and c.message.content.startswith(TEXT)
        assert b"".join(bytes(t.bytes) for t in c.logprobs.content) == c.message.content.encode()
        assert any(t.token == "\ufffd" for t in c.logprobs.content)  # the split characters' tokens
        assert all(t.top_logprobs[1].logprob == -9999.0 for t in c.logprobs.content)
    assert "NaN" in got["nan"].message.content and "1e400" in got["big"].message.content
    (call,) = got["good"].message.tool_calls
    assert _strict(call.function.arguments) == {"x": 1.5} and got["good"].message.content == TEXT


def test_rows_the_engine_hung_on_are_engine_errors_and_bad_requests_invalid(tmp_path):
    """A row ended by --request-timeout never got a prompt count from the engine, yet failed on the engine's side:
    OpenAI's batch output says ``engine_error``; a row refused before generation says ``invalid_request``."""
    rows = prompts(10)
    rows[4]["prompt"] = ""  # refused before generation
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out, res = tmp_path / "out", tmp_path / "results.jsonl"
    assert run_cli(["generate", str(src), "-o", str(out), "--max-error-rate", "1", "--request-timeout", "0.2",
                    "--engine-arg", "hang_every=3", "--engine-arg", "latency=0.001"]) == 0
    assert run_cli(["export", str(out), "-o", str(res)]) == 0
    codes = {x["custom_id"]: (x["error"] or {}).get("code") for x in map(json.loads, res.read_text().splitlines())}
    assert codes["r00004"] == "invalid_request"
    hung = {rid for rid, c in codes.items() if c == "engine_error"}
    assert hung and "r00004" not in hung
    assert all(c in (None, "engine_error") for rid, c in codes.items() if rid != "r00004")
