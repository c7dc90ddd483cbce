"""New families through the reference engine and the CLI: the model's own chat template and tokenizer, a JSON
schema and logprobs, speculation with a DSpine draft initialised for the family equal to plain decoding, and a
family whose invariance gap turns the prefix cache and chunked prefill off, named in the run log."""

from __future__ import annotations

import json

import pytest
from family_models import save_tiny_family
from helpers import SMOL_TEMPLATE, grouped_requests, read_output, run_cli, tokenizer_dir, write_jsonl

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "two"]}}, "required": ["answer"]}


def _family_pair(tmp_path_factory, family: str, **kw):
    """A tiny ``family`` model with a tokenizer and chat template, and a DSpine draft initialised for it."""
    from dspine import init_draft, load_target

    model_dir, draft_dir = tmp_path_factory.mktemp(family), tmp_path_factory.mktemp(f"{family}_draft")
    vocab = tokenizer_dir(model_dir, SMOL_TEMPLATE)
    save_tiny_family(model_dir, family, vocab_size=vocab, **kw)
    init_draft(load_target(model_dir), num_layers=1, block_size=4, intermediate_size=64).save(draft_dir)
    return model_dir, draft_dir


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def pair(request, tmp_path_factory):
    return request.param, _family_pair(tmp_path_factory, request.param)


def test_schema_logprobs_and_speculation_through_the_engine(pair):
    from dspine_batch.engines.base import Structure
    from dspine_batch.engines.reference import ReferenceEngine

    family, (model, draft) = pair
    outs = {}
    for d in ("none", str(draft)):
        eng = ReferenceEngine.load(str(model), d, {"batch_size": "4"})
        assert eng.target.family == family and eng.prefix is not None and eng.prefill_chunk > 0
        groups = {"lp": dict(logprobs=True, top_logprobs=2),
                  "schema": dict(structure=Structure("json_schema", json.dumps(SCHEMA)), max_new_tokens=24)}
        reqs = grouped_requests(eng, groups)
        got = {r.row_id: r for r in eng.run(iter(reqs), 4)}
        assert all(r.error is None for r in got.values())
        for rid, r in got.items():
            if rid.startswith("lp-"):
                assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
            elif r.finish_reason == "stop":
                assert json.loads(r.text)["answer"] in ("four", "two")
        outs[d] = {k: r.token_ids for k, r in got.items()}
    assert outs["none"] == outs[str(draft)]  # greedy: speculation changes no token


def test_cli_end_to_end(pair, tmp_path, monkeypatch):
    from dspine_batch.engines.reference import ReferenceEngine

    family, (model, draft) = pair
    monkeypatch.delenv("DSPINE_BATCH_TEST_ENGINE", raising=False)
    lines = [{"custom_id": "s", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "what is two plus two?"}],
                       "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                       "max_tokens": 24, "logprobs": True, "top_logprobs": 2}},
             {"custom_id": "p", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6}}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--engine", "reference", "--model", str(model), "--draft",
            str(draft)]
    assert run_cli(args, loader=ReferenceEngine.load) == 0
    rows = {r["row_id"]: r for r in read_output(out)}
    assert all(r["status"] == "ok" for r in rows.values())
    assert len(rows["s"]["logprobs"]) == rows["s"]["completion_tokens"]
    if rows["s"]["finish_reason"] == "stop":
        assert json.loads(rows["s"]["output"])["answer"] in ("four", "two")
    assert run_cli(args, loader=ReferenceEngine.load) == 0  # resumed: nothing left to do, the same rows
    assert {r["row_id"]: r["output"] for r in read_output(out)} == {k: r["output"] for k, r in rows.items()}


def test_invariance_gap_turns_features_off_by_name(tmp_path_factory, capsys):
    from dspine.cpu import kernels
    from dspine_batch.engines.reference import ReferenceEngine

    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    model, _ = _family_pair(tmp_path_factory, "phi3")
    eng = ReferenceEngine.load(str(model), "none", {})
    assert eng.prefix is None and eng.prefill_chunk == 0
    err = capsys.readouterr().err
    assert "phi3: prefix cache and chunked prefill off: longrope" in err


@pytest.mark.slow  # two process starts with torch and a model load: ~40 s on the shared 2-core machine
def test_kill_9_and_resume_on_a_new_family(pair, tmp_path, monkeypatch):
    """The real CLI on the reference engine in a subprocess, killed with SIGKILL once its first part is committed,
    then resumed: the same rows as an uninterrupted run, each exactly once."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT, subprocess_env

    from dspine_batch.engines.reference import ReferenceEngine
    from dspine_batch.outdir.output import list_parts

    family, (model, _) = pair
    monkeypatch.delenv("DSPINE_BATCH_TEST_ENGINE", raising=False)
    texts = ["hello world", "what is two plus two?", "the answer", "café", "four"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": texts[i % 5] + f" {i}"} for i in range(16)])
    args = ["generate", str(src), "--engine", "reference", "--model", str(model), "--draft", "none",
            "--max-new-tokens", "12", "--commit-rows", "2", "--engine-arg", "batch_size=2", "--progress", "none"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli([*args, "-o", str(ref)], loader=ReferenceEngine.load) == 0
    cmd = [sys.executable, "-c", "from dspine_batch.cli import main; main()", *args, "-o", str(out)]
    env = {k: v for k, v in subprocess_env().items() if k != "DSPINE_BATCH_TEST_ENGINE"}
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not (out.exists() and list_parts(str(out))) and p.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.02)
    killed = p.poll() is None
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate()
    assert killed, f"finished before the kill ({p.returncode}): {err.decode()[-500:]}"
    assert run_cli([*args, "-o", str(out)], loader=ReferenceEngine.load) == 0
    assert read_output(out) == read_output(ref)
