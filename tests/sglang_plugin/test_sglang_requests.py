"""Request features through ``--engine sglang`` (``dspine_batch.engines.sglang``) on the real SGLang 0.5.23, CPU
test path: a JSON schema, penalties with ``min_tokens`` and ``logit_bias``, logprobs. DSPINE speculation
(``proposers=auto``: suffix matches overwrite the draft block where they win) must give plain SGLang's greedy
tokens exactly, the grammar masking what is actually verified; logprobs are the model's own (the raw logits'
log-softmax) in both, equal within ``LOGPROB_TOL``; the reference engine is the oracle for the tokens.

Two engine starts (plain, DSPINE), each running the whole workload in a module fixture (see test_sglang_e2e.py).
Every schema request runs twice, one after the other: the second run's suffix index holds the first one's output,
so under ``auto`` its rounds verify a suffix match (checked: suffix tokens were proposed and accepted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang", reason="needs the sglang extra (scripts/setup_sglang_venv.sh)")

from helpers import chat_pair  # noqa: E402

from dspine.sglang.cpu import overlap  # noqa: E402
from dspine.sglang.rounds import SYNC_LOG_ENV  # noqa: E402
from dspine_batch.engines.base import Request, SamplingParams, Structure  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue", "two plus"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}
TEXTS = ["hello world", "what is two plus two?", "the answer is", "café ünïcode", "four"]
# float32 on the CPU: a verify computes the block's logits in one forward, a plain step one row; the log-softmax
# of the same position differs by rounding only (not bit-equal: other GEMM shapes). Against the reference engine
# (another implementation of the model, float32 too) REFERENCE_TOL.
LOGPROB_TOL = 1e-4
REFERENCE_TOL = 1e-3
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)
BIAS = ((100, 4.0), (200, 3.0), (250, 2.5))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return chat_pair(tmp_path_factory.mktemp("sglang_req_model"), tmp_path_factory.mktemp("sglang_req_draft"))


def _requests(tok) -> dict[str, list[Request]]:
    stops = tuple(tok.stop_token_ids([]))

    def chat(text: str) -> list[int]:
        return tok.render_chat([{"role": "user", "content": text}])

    def req(name: str, i: int, **p) -> Request:
        p.setdefault("max_new_tokens", 24)
        return Request(f"{name}{i}", 0, chat(TEXTS[i % len(TEXTS)]), SamplingParams(stop_token_ids=stops, **p))

    schema = Structure("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    eos = stops[0]
    return {
        # each twice in a row: the second one's rounds can verify suffix matches of the first's output
        "schema": [req("schema", i, max_new_tokens=48, structure=schema) for i in (0, 0, 1, 1, 2, 2)],
        "plain": [req("plain", i) for i in range(3)],
        "penalized": [req("pen", i, **PENALTIES) for i in range(3)],
        # EOS pushed up by logit_bias: it would end the row at once; min_tokens holds it back for 6 tokens
        "min_tokens": [req("min", i, min_tokens=6, logit_bias=((eos, 30.0),)) for i in range(2)],
        "logprobs": [req("lp", i, logprobs=True, top_logprobs=3) for i in range(2)],
        # logprobs stay the model's own under penalties (what is sampled from is processed, what is reported is not)
        "logprobs_penalized": [req("lpp", i, logprobs=True, top_logprobs=2, **PENALTIES) for i in range(2)],
        # logit_bias alone (issue 51: whether such a batch's verify logits could be skipped; they are not)
        "bias_only": [req("bias", i, logit_bias=BIAS) for i in range(3)],
    }


def _run(engine) -> dict:
    out = {}
    for name, reqs in _requests(engine.tokenizer).items():
        out[name] = [next(engine.run([r], 1)) for r in reqs]  # one at a time: the order the suffix index sees
    return out


def _sglang(models, draft: bool, syncs: Path | None = None) -> dict:
    from dspine_batch.engines.sglang.engine import SGLangEngine

    model, draft_dir = models
    saved = os.environ.get(SYNC_LOG_ENV)
    if syncs is not None:  # read by the DSPINE worker in the scheduler process the engine starts
        os.environ[SYNC_LOG_ENV] = str(syncs)
    try:
        engine = SGLangEngine.load(model, draft_dir if draft else "none", {"proposers": "auto"} if draft else {})
    finally:
        if saved is None:
            os.environ.pop(SYNC_LOG_ENV, None)
        else:
            os.environ[SYNC_LOG_ENV] = saved
    try:
        out = _run(engine)
    finally:
        engine.close()
    if syncs is not None:
        out["syncs"] = [json.loads(line) for line in syncs.read_text().splitlines()]
    return out


@pytest.fixture(scope="module")
def plain(models):
    return _sglang(models, draft=False)


@pytest.fixture(scope="module")
def dspine(models, plain, tmp_path_factory):  # after the plain engine is closed: engines never overlap
    return _sglang(models, draft=True, syncs=tmp_path_factory.mktemp("syncs") / "syncs.jsonl")


@pytest.fixture(scope="module")
def reference(models):
    from dspine_batch.engines.reference import ReferenceEngine

    engine = ReferenceEngine.load(models[0], "none", {"dtype": "float32"})  # SGLang runs it in float32 here
    try:
        return _run(engine)
    finally:
        engine.close()


def _tokens(results) -> list[list[int]]:
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


def test_greedy_json_schema_dspine_equals_plain_sglang_and_validates(plain, dspine):
    import jsonschema

    assert _tokens(dspine["schema"]) == _tokens(plain["schema"])
    for r in dspine["schema"]:
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.finish_reason == "stop"
    assert sum(r.verify_steps or 0 for r in dspine["schema"]) > 0
    # the suffix proposer ran under the grammar and its matches were accepted
    assert sum(r.suffix_tokens_proposed or 0 for r in dspine["schema"]) > 0
    assert sum(r.suffix_tokens_accepted or 0 for r in dspine["schema"]) > 0


def test_json_schema_tokens_equal_the_reference_engines(plain, reference):
    assert _tokens(plain["schema"]) == _tokens(reference["schema"])


def test_only_rows_that_need_it_read_the_device_from_the_host(dspine):
    """Under overlap scheduling a device->host read in a round waits for the round just launched: the DSPINE
    worker reads nothing in rounds without penalties or ``min_tokens`` (suffix proposals, grammars, logit_bias and
    logprobs included), and one read in rounds that have such rows (their generated history and chains)."""
    decode = [r for r in dspine["syncs"] if r["mode"] == "decode"]
    assert any(r["needs"] for r in decode) and any(not r["needs"] for r in decode)
    assert [r for r in decode if not r["needs"] and r["syncs"]] == []
    assert all(r["syncs"] == 1 for r in decode if r["needs"])
    assert all(r["syncs"] == 0 for r in dspine["syncs"] if r["mode"] == "extend")


def test_logit_bias_alone_is_applied_in_the_verify(plain, dspine, reference):
    """A batch whose only processing is ``logit_bias``: DFlash skips the verify logits only with a tensor-parallel
    deferred gather (never under DSPINE, tp 1) and never with a bias; the tokens are plain decoding's."""
    assert _tokens(dspine["bias_only"]) == _tokens(plain["bias_only"]) == _tokens(reference["bias_only"])
    assert _tokens(plain["bias_only"]) != _tokens(plain["plain"])  # the bias changed the output
    assert sum(r.verify_steps or 0 for r in dspine["bias_only"]) > 0


# SGLang 0.5.23's own overlap loop penalizes plain decoding a token late: it accumulates the penalties when it
# prepares step i, from ``output_ids[-1]``, which then is token i-2 (the prompt's last token on the first step), so
# step i's penalties miss token i-1 (a just-generated token can repeat under a presence penalty). The DSPINE verify
# builds each slot's history exactly. So with overlap the oracle for penalized rows is the reference engine.
PLAIN_PENALTIES_EXACT = not overlap()


def test_penalties_and_min_tokens_dspine_equals_plain_equals_reference(plain, dspine, reference):
    for name in ("plain", "penalized", "min_tokens"):
        assert _tokens(dspine[name]) == _tokens(reference[name]), name
        if name != "penalized" or PLAIN_PENALTIES_EXACT:
            assert _tokens(plain[name]) == _tokens(reference[name]), name
    # the penalties changed the output (the same prompts without them), so the equality above tests them
    assert _tokens(dspine["penalized"]) != _tokens(dspine["plain"])
    for r in dspine["min_tokens"]:  # EOS held back for exactly 6 tokens, then taken
        assert r.finish_reason == "stop" and len(r.token_ids) in (6, 7), r.token_ids
    assert sum(r.verify_steps or 0 for name in ("penalized", "min_tokens") for r in dspine[name]) > 0


def _close(a, b, tol: float) -> None:
    assert len(a) == len(b)
    for (ta, la, topa), (tb, lb, topb) in zip(a, b, strict=True):
        assert ta == tb and abs(la - lb) <= tol, (ta, la, lb)
        assert [t for t, _ in topa] == [t for t, _ in topb]
        assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(topa, topb, strict=True))


def test_logprobs_are_the_models_own_under_dspine(plain, dspine, reference):
    for name, k in (("logprobs", 3), ("logprobs_penalized", 2)):
        for d, p, ref in zip(dspine[name], plain[name], reference[name], strict=True):
            assert d.token_ids == ref.token_ids
            assert len(d.logprobs) == len(d.token_ids) and all(len(top) == k for _, _, top in d.logprobs)
            _close(d.logprobs, ref.logprobs, REFERENCE_TOL)
            if name == "logprobs" or PLAIN_PENALTIES_EXACT:
                assert p.token_ids == ref.token_ids
                _close(d.logprobs, p.logprobs, LOGPROB_TOL)
                _close(p.logprobs, ref.logprobs, REFERENCE_TOL)
    for r in dspine["logprobs"]:  # greedy and unprocessed: the chosen token is the most likely one
        for tid, lp, top in r.logprobs:
            assert top[0][0] == tid and top[0][1] == lp and top[0][1] >= top[1][1] >= top[2][1]
    # under penalties the chosen token is sometimes not the model's own most likely one: raw logprobs show it
    assert any(top[0][0] != tid for r in dspine["logprobs_penalized"] for tid, _, top in r.logprobs)
