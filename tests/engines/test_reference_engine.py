"""The reference engine (dspine.generate) and its tokenizer/chat template, on a tiny random model.

The chat template is checked against transformers' ``apply_chat_template`` (the semantics we promise);
the engine against direct ``dspine.generate`` calls. The embedded SmolLM2 run is ``slow``.
"""

from __future__ import annotations

import json

import pytest
from helpers import (
    SMOL_TEMPLATE,
    chat_requests,
    grouped_requests,
    read_output,
    reference_engine,
    tokenizer_dir,
    write_jsonl,
)

from dspine.models.tokenizer import HFTokenizer
from dspine_batch.cli import main
from dspine_batch.engines.base import SamplingParams

FANCY_TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
                  "{% set messages = messages[1:] %}{% else %}{% set sys = 'none' %}{% endif %}"
                  "[SYS {{ sys | tojson }}]\n"
                  "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                  "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
                  "  {{ m['role'] | upper }}: {{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}\nASSISTANT:{% endif %}")
MESSAGES = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "be brief, café"}, {"role": "user", "content": " what is two plus two? "},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "ünïcode"}],
]


@pytest.mark.parametrize("template", [SMOL_TEMPLATE, FANCY_TEMPLATE])
def test_chat_template_matches_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    tokenizer_dir(tmp_path, template)
    ours = HFTokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for msgs in MESSAGES:
        text = theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours.render(msgs) == text
        assert ours.render_chat(msgs) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode("hello world") == theirs.encode("hello world")
    assert ours.eos_ids()[0] == theirs.eos_token_id


def test_template_errors_are_row_errors(tmp_path):
    tokenizer_dir(tmp_path, FANCY_TEMPLATE)
    with pytest.raises(ValueError, match="bad role tool"):
        HFTokenizer(tmp_path).render([{"role": "tool", "content": "x"}])


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path, monkeypatch):
    """Calibrated cost models go to a per-test cache directory, never the user's, and are kept whatever else runs
    on the machine (``cost._busy`` would otherwise skip the write on a loaded CI box)."""
    from dspine.decoding import cost as cost_mod

    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "dspine-cache"))
    monkeypatch.setattr(cost_mod, "_busy", lambda: False)


def test_engine_matches_dspine_generate_and_reports_stats(tiny):
    from dspine import generate

    eng = reference_engine(tiny, batch_size="8", verify="fixed")
    reqs = chat_requests(eng)
    got = list(eng.run(iter(reqs), max_in_flight=8))
    want = generate(eng.target, eng.draft, [r.prompt_ids for r in reqs], max_new_tokens=5,
                    stop_token_ids=list(reqs[0].params.stop_token_ids))
    assert [r.token_ids for r in got] == [w.token_ids for w in want]
    assert all(r.verify_steps and r.accept_histogram and len(r.accept_histogram) == 5 for r in got)
    assert all(r.finish_reason in ("stop", "length") and r.error is None for r in got)
    plain = list(reference_engine(tiny, draft=False).run(iter(reqs), 8))
    assert [r.token_ids for r in plain] == [r.token_ids for r in got]  # lossless: same greedy output
    assert all(r.verify_steps is None and r.accept_length is None for r in plain)


def test_cost_aware_verification_is_the_default(tiny, tmp_path):
    """verify=cost (default): same greedy tokens as plain, streamed as rows finish; the calibration is cached
    on disk per model/machine/threads and reused; a bad value is a usage error."""
    from dspine.decoding import cost as cost_mod
    from dspine_batch.errors import UsageError

    eng = reference_engine(tiny, batch_size="2")
    assert eng.verify == "cost" and eng.identity()["verify"] == "cost"
    reqs = chat_requests(eng, n=5)
    got = list(eng.run(iter(reqs), 8))
    plain = list(reference_engine(tiny, draft=False).run(iter(reqs), 8))
    assert sorted((r.row_id, r.token_ids) for r in got) == sorted((r.row_id, r.token_ids) for r in plain)
    assert all(r.verify_steps is not None and r.draft_tokens_proposed is not None for r in got)
    cached = list((tmp_path / "dspine-cache" / "cost").glob("*.json"))
    assert len(cached) == 1

    def no_calibration(*a, **k):
        raise AssertionError("calibrated again despite the cache")

    orig = cost_mod.calibrate
    cost_mod.calibrate = no_calibration
    try:
        again = list(reference_engine(tiny, batch_size="2").run(iter(reqs), 8))
    finally:
        cost_mod.calibrate = orig
    assert [r.token_ids for r in again] == [r.token_ids for r in got]
    with pytest.raises(UsageError, match="verify=always: expected cost or fixed"):
        reference_engine(tiny, verify="always")


def test_rows_stream_back_as_they_finish(tiny):
    """A short request is handed back before a long one that started with it; admission stays lazy."""
    eng = reference_engine(tiny, batch_size="2", proposers="dspine")  # suffix jumps would reorder the long rows
    reqs = chat_requests(eng, n=4)
    for r, m in zip(reqs, [40, 2, 40, 2]):
        r.params = SamplingParams(max_new_tokens=m, stop_token_ids=())
    keys = [r.row_id for r in eng.run(iter(reqs), 8)]
    assert keys.index("r1") < keys.index("r0") and keys.index("r3") < keys.index("r2")


def test_dynamic_threshold_engine_arg(tiny, tmp_path):
    """``--engine-arg dynamic_threshold=X`` stops proposals early with a fitted confidence head (same greedy
    output, fewer drafts); without a fitted head it is ignored; a non-number is a usage error."""
    import torch

    from dspine import load_draft
    from dspine_batch.errors import UsageError

    model, draft_dir = tiny
    d = load_draft(draft_dir)
    with torch.no_grad():
        d.confidence_head.proj.weight.zero_()
        d.confidence_head.proj.bias.fill_(-2.0)  # c = 0.12 everywhere: below 0.5, so every proposal stops at 0
    d.confidence_trained = True
    d.save(tmp_path / "fitted")
    reqs = chat_requests(reference_engine(tiny))
    full = list(reference_engine(tiny, verify="fixed").run(iter(reqs), 8))
    cut = list(reference_engine((model, tmp_path / "fitted"), dynamic_threshold="0.5", verify="fixed")
               .run(iter(reqs), 8))
    assert [r.token_ids for r in cut] == [r.token_ids for r in full]
    assert all(r.draft_tokens_proposed == 0 for r in cut) and all(r.draft_tokens_proposed > 0 for r in full)
    unfitted = reference_engine(tiny, dynamic_threshold="0.5")
    assert unfitted.dynamic_threshold is None and "dynamic_threshold" not in unfitted.identity()
    with pytest.raises(UsageError, match="expected a number"):
        reference_engine(tiny, dynamic_threshold="high")


def test_decode_json_defaults_and_overrides(tiny, tmp_path):
    """A draft's decode.json sets block_size/dynamic_threshold unless --engine-arg does; bad values are usage
    errors naming the file."""
    import json
    import shutil

    from dspine_batch.errors import UsageError

    model, draft_dir = tiny
    d = tmp_path / "draft"
    shutil.copytree(draft_dir, d)
    (d / "decode.json").write_text(json.dumps({"_measured": "BENCHMARKS.md", "block_size": 3}))
    assert reference_engine((model, d)).block_size == 3
    assert reference_engine((model, d), block_size="4").block_size == 4
    assert reference_engine((model, d)).identity()["block_size"] == 3
    with pytest.raises(UsageError, match="supports 2..4"):
        reference_engine((model, d), block_size="9")
    (d / "decode.json").write_text(json.dumps({"block_size": "eight"}))
    with pytest.raises(UsageError, match=r"decode\.json: block_size must be an integer"):
        reference_engine((model, d))
    (d / "decode.json").write_text(json.dumps({"speed": 1}))
    with pytest.raises(UsageError, match="unknown key 'speed'"):
        reference_engine((model, d))


def test_per_request_sampling_and_bounded_batches(tiny):
    eng = reference_engine(tiny, draft=False, batch_size="2")
    reqs = chat_requests(eng, n=3, temperature=1.0, seed=3)
    a = [r.token_ids for r in eng.run(iter(reqs), 8)]
    b = [r.token_ids for r in eng.run(iter(reqs), 1)]  # different batching, same seeds -> same samples
    assert a == b
    pulled = []

    def feed():
        for r in reqs:
            pulled.append(r.row_id)
            yield r

    it = eng.run(feed(), 8)
    next(it)
    assert len(pulled) == 2  # batch_size bounds admission


def test_overlong_request_fails_alone(tiny):
    eng = reference_engine(tiny, draft=False)
    reqs = chat_requests(eng, n=3)
    reqs[1].prompt_ids = reqs[1].prompt_ids * 10  # longer than the 96-token context
    out = {r.row_id: r for r in eng.run(iter(reqs), 8)}  # finish order: the rejected row comes back first
    assert out["r0"].error is None and out["r2"].error is None
    assert "engine rejected the request" in out["r1"].error


def test_embedded_draft_only_with_the_embedded_model(tiny, capsys, monkeypatch):
    from dspine.embedded import smollm2 as embedded
    from dspine_batch.engines.reference import ReferenceEngine, resolve_draft

    eng = ReferenceEngine.load(str(tiny[0]), "embedded", {})  # the default --draft with a custom model
    assert eng.draft is None and "pairs only with --model embedded" in capsys.readouterr().err

    def missing():
        raise FileNotFoundError("not shipped")

    monkeypatch.setattr(embedded, "embedded_draft_path", missing, raising=False)
    assert resolve_draft("embedded", "embedded") is None
    assert "no embedded draft is available (not shipped)" in capsys.readouterr().err
    assert resolve_draft("none", "embedded") is None and resolve_draft(str(tiny[1]), "x") == tiny[1]


def test_cli_on_the_reference_engine(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("DSPINE_BATCH_TEST_ENGINE", raising=False)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello world"},
                                               {"id": "b", "messages": None, "prompt": "two plus two"}])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["generate", str(src), "-o", str(out), "--engine", "reference", "--model", str(tiny[0]),
              "--draft", str(tiny[1]), "--max-new-tokens", "5", "--progress", "none", "--stop", "the"])
    assert e.value.code == 0
    rows = read_output(out)
    # the speculative columns are filled with a draft (verify_steps may be 0: cost-aware verification can
    # judge a random draft not worth running, and then every round is a plain step)
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["verify_steps"] is not None for r in rows)
    assert all("the" not in (r["output"] or "") for r in rows)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["fingerprint_fields"]["engine"]["draft"]["path"] == str(tiny[1])


@pytest.mark.slow
def test_embedded_model_end_to_end(tmp_path, monkeypatch):
    try:
        from dspine.embedded.smollm2 import embedded_target_path

        embedded_target_path()
    except Exception as e:  # not installed here
        pytest.skip(f"embedded model unavailable: {e}")
    monkeypatch.delenv("DSPINE_BATCH_TEST_ENGINE", raising=False)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "q", "prompt": "What is 2+2?"}])
    with pytest.raises(SystemExit) as e:
        main(["generate", str(src), "-o", str(tmp_path / "out"), "--max-new-tokens", "8", "--progress", "none"])
    assert e.value.code == 0
    (row,) = read_output(tmp_path / "out")
    assert row["status"] == "ok" and row["output"] and row["completion_tokens"] <= 8


def test_proposers_auto_is_the_default_and_reports_stats_by_source(tiny):
    """Default proposers=auto: greedy tokens equal plain decoding's; every verify step is either the draft's or a
    suffix match's, and the by-source columns add up to the totals; ``--draft none`` speculates with nothing."""
    eng = reference_engine(tiny, batch_size="3")
    assert eng.proposers == "auto" and eng.identity()["proposers"] == "auto"
    reqs = chat_requests(eng, n=5)
    for r in reqs:
        r.params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    got = sorted(eng.run(iter(reqs), 8), key=lambda r: r.row_id)
    plain = sorted(reference_engine(tiny, draft=False).run(iter(reqs), 8), key=lambda r: r.row_id)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    for r in got:
        assert r.verify_steps == r.dspine_verify_steps + r.suffix_verify_steps
        assert r.draft_tokens_proposed == r.dspine_tokens_proposed + r.suffix_tokens_proposed
        assert r.draft_tokens_accepted == r.dspine_tokens_accepted + r.suffix_tokens_accepted
    assert sum(r.suffix_tokens_accepted for r in got) > 0  # the tiny model repeats itself: suffix matches pay
    assert all(r.verify_steps is None and r.suffix_verify_steps is None for r in plain)
    assert reference_engine(tiny, draft=False).proposers is None
    # explain(): the results' counts by source; under auto the cost model chooses (its reasons: the decode loop's)
    why = eng.explain()
    for src in ("dspine", "suffix"):
        assert [why[src][k] for k in ("rounds", "proposed", "accepted")] == [
            sum(getattr(r, f"{src}_{k}") for r in got) for k in ("verify_steps", "tokens_proposed", "tokens_accepted")]
        assert why[src]["ran"] == (why[src]["rounds"] > 0) and "cost model" in why[src]["chooser"]
    assert why["suffix"]["ran"] and why["suffix"]["why"] is None
    plain_why = reference_engine(tiny, draft=False).explain()
    assert not plain_why["dspine"]["ran"] and "plain decoding" in plain_why["dspine"]["why"]


def test_a_released_draft_is_loaded_again_for_the_next_run_and_changes_no_token(tiny):
    """The engine reads its draft's weights when a stream first needs them, not at load (``dspine.draft.lazy``); a
    stream that retires the draft frees them (``release_retired``) and the next run reads them again (the same
    proposals: the same tokens and schedule as a fresh engine's), and records when its first token came."""
    reqs = chat_requests(reference_engine(tiny), n=4)
    for r in reqs:
        r.params = SamplingParams(max_new_tokens=16, stop_token_ids=())
    fresh = reference_engine(tiny, batch_size="3", proposers="dspine")
    want = [(r.token_ids, r.verify_steps) for r in sorted(fresh.run(iter(reqs), 8), key=lambda r: r.row_id)]
    eng = reference_engine(tiny, batch_size="3", proposers="dspine")
    assert eng.first_token_at is None
    assert not eng.draft.loaded and eng.draft.loads == 0  # loading the engine read no tensor of the draft
    got = [(r.token_ids, r.verify_steps) for r in sorted(eng.run(iter(reqs), 8), key=lambda r: r.row_id)]
    assert got == want and eng.draft.loads == 1
    eng.draft.release()  # as a retiring stream leaves it
    assert not eng.draft.loaded
    got = [(r.token_ids, r.verify_steps) for r in sorted(eng.run(iter(reqs), 8), key=lambda r: r.row_id)]
    assert got == want and eng.draft.loads == 2
    assert eng.first_token_at is not None


@pytest.mark.parametrize("args,msg", [
    ({"proposers": "ngram"}, "proposers=ngram: expected one of auto, dspine, suffix"),
    ({"proposers": "suffix", "verify": "fixed"}, "proposers=suffix needs verify=cost"),
    ({"suffix_max": "0"}, "suffix_max=0: expected 1..64"),
    ({"suffix_cap": "0"}, "suffix_cap=0: expected a positive token count"),
])
def test_proposer_args_are_checked_before_loading(tiny, args, msg):
    from dspine_batch.errors import UsageError

    with pytest.raises(UsageError, match=msg):
        reference_engine(tiny, **args)


def test_suffix_only_and_dspine_only(tiny):
    """proposers=suffix never runs the draft; proposers=dspine never proposes a suffix; both lossless."""
    eng_s = reference_engine(tiny, proposers="suffix", suffix_max="8")
    eng_d = reference_engine(tiny, proposers="dspine")
    reqs = chat_requests(eng_s, n=3)
    for r in reqs:
        r.params = SamplingParams(max_new_tokens=20, stop_token_ids=())
    s = sorted(eng_s.run(iter(reqs), 8), key=lambda r: r.row_id)
    d = sorted(eng_d.run(iter(reqs), 8), key=lambda r: r.row_id)
    assert [r.token_ids for r in s] == [r.token_ids for r in d]
    assert all(r.dspine_verify_steps == 0 for r in s) and all(r.suffix_verify_steps == 0 for r in d)
    assert "proposers" not in eng_d.identity()  # the old loop's fingerprint is unchanged
    assert eng_s.explain()["dspine"] | {"chooser": None} == {
        "rounds": 0, "proposed": 0, "accepted": 0, "ran": False, "chooser": None,
        "why": "--engine-arg proposers=suffix (suffix matches only)"}
    assert eng_d.explain()["suffix"]["why"] == "--engine-arg proposers=dspine (the draft only)"
    d_why = eng_d.explain()["dspine"]  # it may still never run: the cost model may find plain steps cheaper
    assert d_why["ran"] == (sum(r.dspine_verify_steps for r in d) > 0) and "proposers=dspine" in d_why["chooser"]


def test_prefix_cache_serves_shared_system_prompts_and_siblings_without_changing_outputs(tiny):
    """Rows behind one long system prompt and the --num-samples siblings of a row: the engine reports what its
    prefix cache served per row; tokens equal a run with the cache off (prefix_cache_mb=0), sampled rows too."""
    from dspine_batch.engines.base import Request

    on, off = reference_engine(tiny, batch_size="3"), reference_engine(tiny, batch_size="3", prefix_cache_mb="0")
    assert on.prefix is not None and off.prefix is None
    assert "prefix" not in json.dumps(on.identity())  # a hit never changes an output: not part of the identity
    system = "You are careful. Answer in one sentence."
    reqs = []
    for i, q in enumerate(["hello world", "what is two plus two?", "the answer", "café"]):
        ids = on.tokenizer.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for s in range(2 if i == 0 else 1):  # row 0 asks two samples
            reqs.append(Request(f"r{i}", s, ids, SamplingParams(max_new_tokens=8, temperature=0.8 if s else 0.0,
                                                                seed=7, stop_token_ids=())))
    got = sorted(on.run(iter(reqs), 8), key=lambda r: (r.row_id, r.sample_index))
    ref = sorted(off.run(iter(reqs), 8), key=lambda r: (r.row_id, r.sample_index))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert all(r.error is None and r.token_ids for r in got)
    assert [r.cached_prompt_tokens for r in ref] == [0] * len(ref)
    total = sum(r.prompt_tokens for r in got)
    computed = total - sum(r.cached_prompt_tokens for r in got)
    assert computed == on.prefix.computed
    assert computed < total / 2  # the system prompt (most of every prompt) computed once
    assert got[1].cached_prompt_tokens == got[1].prompt_tokens  # the second sample: its whole prompt from cache


def test_prefix_cache_arg_is_checked(tiny):
    from dspine_batch.errors import UsageError

    with pytest.raises(UsageError, match="prefix_cache_mb=-1: expected MB >= 0"):
        reference_engine(tiny, prefix_cache_mb="-1")


def test_prefill_chunk_arg(tiny):
    """``prefill_chunk``: default ``DEFAULT_PREFILL_CHUNK``, 0 = whole prompts, checked in one line, listed in
    ``--help``; outputs and the identity do not depend on it; under torch's GEMMs (quant) prompts stay whole."""
    from click.testing import CliRunner

    from dspine_batch.cli import cli
    from dspine_batch.engines.reference import DEFAULT_PREFILL_CHUNK
    from dspine_batch.errors import UsageError

    base = dict(batch_size="2", verify="fixed")
    default, cut, whole = (reference_engine(tiny, **base, **extra)
                           for extra in ({}, {"prefill_chunk": "3"}, {"prefill_chunk": "0"}))
    assert (default.prefill_chunk, cut.prefill_chunk, whole.prefill_chunk) == (DEFAULT_PREFILL_CHUNK, 3, 0)
    assert cut.identity() == whole.identity() == default.identity()
    reqs = chat_requests(cut, n=5)
    for r, m in zip(reqs, [12, 2, 9, 1, 6]):
        r.params = SamplingParams(max_new_tokens=m, temperature=0.7 if m % 2 else 0.0, seed=m, stop_token_ids=())
    got = sorted(cut.run(iter(reqs), 8), key=lambda r: r.row_id)
    ref = sorted(whole.run(iter(reqs), 8), key=lambda r: r.row_id)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert all(r.error is None and r.token_ids for r in got)
    for bad, why in (("-1", "prefill_chunk=-1: expected a token count >= 0"),
                     ("big", "prefill_chunk=big: expected an integer")):
        with pytest.raises(UsageError, match=why):
            reference_engine(tiny, prefill_chunk=bad)
    assert reference_engine(tiny, draft=False, quant="int8", prefill_chunk="3").prefill_chunk == 0
    assert "prefill_chunk" in CliRunner().invoke(cli, ["generate", "--help"]).output


def test_structured_penalties_and_logprobs_through_the_engine(tiny):
    """The request features the reference engine declares reach the decoding loop: a choice and a JSON schema are
    obeyed (compiled against the model's own tokenizer), greedy outputs are the same with speculation on and off,
    and logprobs come back, one per kept token."""
    from dspine_batch.engines.base import FEATURES, Structure

    schema = json.dumps({"type": "object", "properties": {"answer": {"enum": ["four", "two"]}},
                         "required": ["answer"]}, separators=(",", ":"))
    outs = {}
    for draft in (False, True):
        eng = reference_engine(tiny, draft=draft)
        assert eng.features == FEATURES
        groups = {"lp": dict(logprobs=True, top_logprobs=2, presence_penalty=0.4),
                  "choice": dict(structure=Structure("choice", '["hello", "world"]'), max_new_tokens=24),
                  "schema": dict(structure=Structure("json_schema", schema), min_tokens=2, max_new_tokens=24)}
        reqs = grouped_requests(eng, groups)
        got = {r.row_id: r for r in eng.run(iter(reqs), 4)}
        outs[draft] = {k: r.token_ids for k, r in got.items()}
        assert all(r.error is None for r in got.values())
        for rid, r in got.items():
            if rid.startswith("lp-"):
                assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
                assert all(len(top) == 2 and top[0][1] >= top[1][1] for _, _, top in r.logprobs)
            elif rid.startswith("choice-") and r.finish_reason == "stop":
                assert r.text in ("hello", "world")
            elif rid.startswith("schema-") and r.finish_reason == "stop":
                assert json.loads(r.text)["answer"] in ("four", "two")
        assert sum(r.finish_reason == "stop" for rid, r in got.items() if not rid.startswith("lp-")) >= 2
    assert outs[True] == outs[False]
