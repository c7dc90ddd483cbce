"""The SGLang adapter without SGLang: meta_info -> stats on recorded 0.5.23 dicts, server-arg building, and the
engine loop (bounded in-flight window, lazy admission, aborts, request errors, engine death, scoped shutdown)
against ``tests/fake_sglang.FakeEngine``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_sglang import FakeEngine, FakeTokenizer

from dspine_batch.engines.base import FEATURES, Request, Result, SamplingParams, Structure
from dspine_batch.engines.sglang import engine as se
from dspine_batch.engines.sglang import stats as sglang_stats
from dspine_batch.errors import FatalError, UsageError

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_0_5_23_meta_info.json").read_text())


# -- meta_info -> stats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_meta_info_maps_to_our_stats(name):
    case = RECORDED[name]
    meta, B, rounds = case["meta_info"], case["block_size"], case["accepted_per_round"]
    st = sglang_stats.spec_stats(meta, block_size=B)
    if not rounds:  # prefill only: SGLang sends no spec fields, our columns stay null
        assert st is None
        return
    assert st.verify_steps == len(rounds)
    assert st.draft_tokens_accepted == sum(rounds)
    assert st.draft_tokens_proposed == len(rounds) * (B - 1)
    hist = [0] * (B + 1)
    for a in rounds:
        hist[a] += 1
    assert st.accept_histogram == hist  # padded to B + 1 like the reference engine's
    # ours: verify-round tokens per round, bonus counted, the prefill token not
    assert st.accept_length == pytest.approx((meta["completion_tokens"] - 1) / len(rounds))
    sg = sglang_stats.spec_stats(meta, block_size=B, convention=sglang_stats.ACCEPT_LENGTH_SGLANG)
    assert sg.accept_length == pytest.approx(meta["spec_accept_length"])


OLD_NAMES = {"spec_num_correct_drafts": "spec_accept_token_num", "spec_num_proposed_drafts": "spec_draft_token_num",
             "spec_correct_drafts_histogram": "spec_accept_histogram"}
MIDDLE_NAMES = {"spec_num_correct_drafts": "spec_accepted_drafts", "spec_num_proposed_drafts": "spec_proposed_drafts"}


@pytest.mark.parametrize("renames", [OLD_NAMES, MIDDLE_NAMES])
def test_older_field_names_give_the_same_stats(renames):
    meta = RECORDED["greedy_b16_length"]["meta_info"]
    old = {renames.get(k, k): v for k, v in meta.items()}
    assert sglang_stats.spec_stats(old, block_size=16) == sglang_stats.spec_stats(meta, block_size=16)


def test_missing_fields_are_derived_or_null():
    meta = dict(RECORDED["greedy_b16_length"]["meta_info"])
    del meta["spec_num_proposed_drafts"], meta["spec_num_correct_drafts"]
    st = sglang_stats.spec_stats(meta, block_size=16)
    assert st.draft_tokens_proposed == 5 * 15 and st.draft_tokens_accepted == 40  # from B and the histogram
    assert sglang_stats.spec_stats({"completion_tokens": 9}) is None
    assert sglang_stats.spec_stats({"spec_verify_ct": 0, "completion_tokens": 1}) is None


def test_malformed_meta_info_is_an_error_not_zeros():
    meta = dict(RECORDED["greedy_b16_length"]["meta_info"])
    with pytest.raises(ValueError, match="histogram counts"):
        sglang_stats.spec_stats({**meta, "spec_correct_drafts_histogram": [1, 2]})
    with pytest.raises(ValueError, match="non-negative integer"):
        sglang_stats.spec_stats({**meta, "spec_verify_ct": 2.5})


def test_finish_reasons():
    assert sglang_stats.finish({"finish_reason": {"type": "length", "length": 3}}) == ("length", None)
    assert sglang_stats.finish({"finish_reason": {"type": "stop", "matched": 2}}) == ("stop", None)
    assert sglang_stats.finish({"finish_reason": "stop"}) == ("stop", None)
    reason, err = sglang_stats.finish(RECORDED["aborted"]["meta_info"])
    assert reason == "abort" and "Abort in waiting queue" in err and "500" in err
    assert sglang_stats.finish({})[0] == "error"


def test_apply_fills_a_result():
    res = sglang_stats.apply(RECORDED["stop_mid_round_b16"]["meta_info"], Result("k", 0), block_size=16)
    assert (res.prompt_tokens, res.completion_tokens, res.verify_steps) == (12, 16, 3)
    assert res.accept_length == pytest.approx(15 / 3) and res.latency_s == 0.25


def test_counts_by_source_become_the_by_source_columns():
    """The DSPINE worker's per-token counts (``dspine.sglang.suffix.SourceCounts``) are summed; rounds they do not
    cover are the draft's whole blocks; another speculative algorithm fills no by-source column."""
    from dspine.sglang import SOURCE_COUNTS_KEY
    from dspine.sglang.suffix import SourceCounts, count_round

    meta = RECORDED["stop_mid_round_b16"]["meta_info"]  # 3 verify rounds, B = 16
    res = sglang_stats.apply(meta, Result("k", 0), block_size=16)
    assert (res.dspine_verify_steps, res.dspine_tokens_proposed, res.dspine_tokens_accepted) == (
        3, 45, res.draft_tokens_accepted)
    assert (res.suffix_verify_steps, res.suffix_tokens_proposed, res.suffix_tokens_accepted) == (0, 0, 0)
    # two suffix rounds (4 tokens proposed, 3 accepted; 15 proposed, 15 accepted) and one uncovered draft round,
    # as the worker reports them: a per-token list, counts at each chunk's first token
    req = type("Req", (), {"customized_info": None})()
    count_round(req, 4, 15, 3)
    chunk1 = req.customized_info[SOURCE_COUNTS_KEY][0:5]
    count_round(req, 15, 15, 15)
    chunk2 = req.customized_info[SOURCE_COUNTS_KEY][5:16]
    assert len(chunk1) == 5 and len(chunk2) == 11 and chunk1[1:] == [None] * 4
    assert isinstance(req.customized_info[SOURCE_COUNTS_KEY], SourceCounts)
    hist = [0] * 17
    hist[3], hist[15], hist[2] = 1, 1, 1  # the uncovered draft round accepted 2
    meta2 = {**meta, "spec_verify_ct": 3, "spec_num_correct_drafts": 20, "spec_correct_drafts_histogram": hist,
             "completion_tokens": 24, SOURCE_COUNTS_KEY: chunk1 + chunk2}
    res = sglang_stats.apply(meta2, Result("k", 0), block_size=16)
    assert (res.suffix_verify_steps, res.suffix_tokens_proposed, res.suffix_tokens_accepted) == (2, 19, 18)
    # the draft's: its 11 slots after the 4-token match (0 accepted) and the uncovered round's 15 (2 accepted)
    assert (res.dspine_verify_steps, res.dspine_tokens_proposed, res.dspine_tokens_accepted) == (1, 26, 2)
    assert res.dspine_tokens_accepted + res.suffix_tokens_accepted == res.draft_tokens_accepted
    other = sglang_stats.apply(meta2, Result("k", 0), block_size=16, dspine=False)
    assert other.verify_steps == 3 and other.dspine_verify_steps is None and other.suffix_verify_steps is None
    with pytest.raises(ValueError, match="more rounds"):
        sglang_stats.apply({**meta2, "spec_verify_ct": 1, "spec_correct_drafts_histogram": None}, Result("k", 0),
                           block_size=16)


def test_cached_tokens_become_cached_prompt_tokens():
    """SGLang's per-request radix-cache hit count is copied as is; 0 is a real "no hit", not a missing value."""
    meta = RECORDED["stop_mid_round_b16"]["meta_info"]
    assert meta["cached_tokens"] == 0  # 0.5.23 sends it on every finished request
    assert sglang_stats.apply(meta, Result("k", 0)).cached_prompt_tokens == 0
    res = sglang_stats.apply({**meta, "cached_tokens": 11}, Result("k", 0), block_size=16)
    assert (res.cached_prompt_tokens, res.prompt_tokens) == (11, 12)
    assert sglang_stats.apply({**meta, "cached_tokens": 12.0}, Result("k", 0)).cached_prompt_tokens == 12
    without = {k: v for k, v in meta.items() if k != "cached_tokens"}
    assert sglang_stats.apply(without, Result("k", 0)).cached_prompt_tokens is None  # an SGLang that does not say


@pytest.mark.parametrize("bad", [-1, 2.5, "many", True, 13])
def test_malformed_cached_tokens_are_an_error_not_a_guess(bad):
    """A count we cannot read, or more cached tokens than the prompt has, means a meta_info we do not understand."""
    meta = {**RECORDED["stop_mid_round_b16"]["meta_info"], "cached_tokens": bad}
    with pytest.raises(ValueError, match="cached_tokens"):
        sglang_stats.apply(meta, Result("k", 0))


# -- server args --------------------------------------------------------------------------------------------------


def _mini_parser():
    """The shape of SGLang's parser for a few fields (the real one is exercised in test_sglang_plugin.py)."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--model-path", dest="model_path")
    p.add_argument("--speculative-algorithm", dest="speculative_algorithm")
    p.add_argument("--speculative-num-draft-tokens", dest="speculative_num_draft_tokens", type=int)
    p.add_argument("--mem-fraction-static", dest="mem_fraction_static", type=float)
    p.add_argument("--enable-linear-replayssm-spec", dest="enable_linear_replayssm_spec", action="store_true")
    p.add_argument("--dtype", dest="dtype", default="auto")
    p.add_argument("--mamba-radix-cache-strategy", dest="mamba_radix_cache_strategy")
    return p


def test_build_server_kwargs_precedence_and_types():
    kw, opts = se.build_server_kwargs(
        "/m", "/d", {"server_flags": "--dtype bfloat16 --mem-fraction-static 0.8 --enable-linear-replayssm-spec",
                     "mem-fraction-static": "0.7", "block_size": "8", "poll_seconds": "0.5"}, parser=_mini_parser())
    assert kw["model_path"] == "/m" and kw["speculative_draft_model_path"] == "/d"
    assert kw["speculative_algorithm"] == "DSPINE" and kw["skip_tokenizer_init"] is False  # grammars need it
    assert kw["dtype"] == "bfloat16" and kw["mem_fraction_static"] == 0.7  # single arg beats server_flags
    assert kw["speculative_num_draft_tokens"] == 8 and kw["enable_linear_replayssm_spec"] is True
    assert kw["custom_sigquit_handler"] is se.on_sigquit and opts["poll_seconds"] == 0.5
    kw, _ = se.build_server_kwargs("/m", None, {"enable_linear_replayssm_spec": "false"}, parser=_mini_parser())
    assert "speculative_algorithm" not in kw and kw["enable_linear_replayssm_spec"] is False


@pytest.mark.parametrize("args, match", [
    ({"mem_fracton_static": "0.5"}, "did you mean mem_fraction_static"),
    ({"enable_linear_replayssm_spec": "maybe"}, "expected true or false"),
    ({"model_path": "/x"}, "use --model/--draft"),
    ({"server_flags": "--no-such-flag 1"}, "unknown"),
    ({"speculative_num_draft_tokens": "many"}, "SGLang flags"),
])
def test_build_server_kwargs_errors(args, match):
    with pytest.raises(UsageError, match=match):
        se.build_server_kwargs("/m", "/d", args, parser=_mini_parser())


def test_extra_buffer_is_refused_on_the_cpu_path():
    """SGLang keeps Mamba prefix-cache state snapshots on GPUs only (docs/design.md, "The CPU test path")."""
    with pytest.raises(UsageError, match="extra_buffer: SGLang 0.5.23 keeps no Mamba state snapshots on the CPU"):
        se.build_server_kwargs("/m", "/d", {"mamba_radix_cache_strategy": "extra_buffer"}, parser=_mini_parser(),
                               on_cpu=True)
    kw, _ = se.build_server_kwargs("/m", "/d", {"mamba_radix_cache_strategy": "extra_buffer"}, parser=_mini_parser())
    assert kw["mamba_radix_cache_strategy"] == "extra_buffer"  # a GPU run keeps it
    kw, _ = se.build_server_kwargs("/m", "/d", {}, parser=_mini_parser(), on_cpu=True)
    assert kw["device"] == "cpu" and kw["disable_overlap_schedule"] is False  # overlap scheduling, as on a GPU


def test_a_hybrid_target_on_the_cpu_runs_overlap_without_the_prefix_cache(tmp_path, monkeypatch, capsys):
    """With overlap scheduling SGLang's auto Mamba strategy is extra_buffer, which the CPU cannot snapshot: the CPU
    path turns the prefix cache off for hybrid targets (and leaves it on without overlap, where auto is no_buffer)."""
    (tmp_path / "config.json").write_text(json.dumps({"layer_types": ["linear_attention", "full_attention"]}))
    monkeypatch.delenv("DSPINE_SGLANG_OVERLAP", raising=False)
    kw, _ = se.build_server_kwargs(str(tmp_path), "/d", {}, parser=_mini_parser(), on_cpu=True)
    assert kw["disable_radix_cache"] is True and "without the prefix cache" in capsys.readouterr().err
    monkeypatch.setenv("DSPINE_SGLANG_OVERLAP", "0")
    kw, _ = se.build_server_kwargs(str(tmp_path), "/d", {}, parser=_mini_parser(), on_cpu=True)
    assert kw["disable_overlap_schedule"] is True and "disable_radix_cache" not in kw
    kw, _ = se.build_server_kwargs(str(tmp_path), "/d", {}, parser=_mini_parser())
    assert "disable_radix_cache" not in kw  # a GPU keeps it (extra_buffer)


def test_sampling_params_mapping():
    sp = se.sampling_params(SamplingParams(max_new_tokens=5, temperature=0.0, top_k=0, stop_token_ids=(2, 7)))
    assert sp["top_k"] == se.TOP_K_ALL and sp["stop_token_ids"] == [2, 7] and "sampling_seed" not in sp
    sp = se.sampling_params(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=123))
    assert (sp["top_k"], sp["top_p"], sp["sampling_seed"]) == (20, 0.9, 123)


def test_request_features_reach_sglangs_sampling_params():
    """Penalties, min_tokens and logit_bias under SGLang's names; each structure kind as SGLang's grammar field
    (json_object as the schema the reference engine compiles, choice as an EBNF alternation)."""
    sp = se.sampling_params(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                                           min_tokens=3, logit_bias=((7, -5.0), (11, 2.5))))
    assert (sp["presence_penalty"], sp["frequency_penalty"], sp["repetition_penalty"]) == (0.5, -0.25, 1.2)
    assert sp["min_new_tokens"] == 3 and sp["logit_bias"] == {"7": -5.0, "11": 2.5}
    plain = se.sampling_params(SamplingParams())
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_new_tokens", "logit_bias",
                "json_schema", "regex", "ebnf"} & set(plain)
    schema = '{"properties":{"a":{"type":"integer"}},"type":"object"}'
    cases = {("json_schema", schema): ("json_schema", schema),
             ("json_object", ""): ("json_schema", '{"type": "object"}'),
             ("regex", "[a-z]+"): ("regex", "[a-z]+"),
             ("choice", '["yes","no \\"maybe\\""]'): ("ebnf", 'root ::= "yes" | "no \\"maybe\\""'),
             ("grammar", 'root ::= "x"'): ("ebnf", 'root ::= "x"')}
    for (kind, spec), (field, value) in cases.items():
        sp = se.sampling_params(SamplingParams(structure=Structure(kind, spec)))
        assert sp[field] == value, kind
    assert se.logprob_args(SamplingParams()) == {}
    assert se.logprob_args(SamplingParams(logprobs=True, top_logprobs=3)) == {
        "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": -1}


def test_the_engine_declares_every_request_feature():
    assert se.SGLangEngine.features == FEATURES


def test_choice_ebnf_compiles_to_exactly_the_choices():
    xgrammar = pytest.importorskip("xgrammar")
    sp = se.sampling_params(SamplingParams(structure=Structure("choice", json.dumps(["yes", 'no "maybe"', "café"]))))
    grammar = xgrammar.Grammar.from_ebnf(sp["ebnf"])
    for text, ok in (("yes", True), ('no "maybe"', True), ("café", True), ("no", False), ("yesyes", False)):
        assert xgrammar.testing._is_grammar_accept_string(grammar, text) is ok, text


# -- the engine loop ----------------------------------------------------------------------------------------------


def _engine(fake: FakeEngine, **kw) -> se.SGLangEngine:
    return se.SGLangEngine(fake, FakeTokenizer(), {"engine": "sglang"}, kw.pop("block", 4), 4096, set(),
                           poll_seconds=kw.pop("poll", 0.05), **kw)


def _requests(n, pulled=None, **params):
    for i in range(n):
        if pulled is not None:
            pulled.append(i)
        yield Request(f"row{i}", 0, [1 + i % 7] * (3 + i % 11), SamplingParams(max_new_tokens=8, **params))


@pytest.fixture(autouse=True)
def _clear_death():
    se._SIGQUIT.clear()
    yield
    se._SIGQUIT.clear()


def test_run_returns_every_request_with_stats_and_bounded_window():
    fake = FakeEngine(block=4)
    eng = _engine(fake)
    pulled: list[int] = []
    out = list(eng.run(_requests(40, pulled), max_in_flight=6))
    assert sorted(r.row_id for r in out) == sorted(f"row{i}" for i in range(40))
    assert fake.max_in_flight <= 6 and len(pulled) == 40
    for r in out:
        assert r.error is None and r.finish_reason == "length" and r.completion_tokens == len(r.token_ids)
        if r.completion_tokens > 1:
            assert r.verify_steps and r.accept_length == pytest.approx((r.completion_tokens - 1) / r.verify_steps)
            assert len(r.accept_histogram) == 5  # B + 1
        assert r.text == FakeTokenizer().decode(r.token_ids)
    assert all(c[2]["top_k"] == se.TOP_K_ALL for c in fake.calls)
    assert eng.explain()["dspine"]["rounds"] == 0  # built without DSPINE proposers: no by-source columns
    assert eng.explain()["dspine"]["why"].startswith("no DSPINE speculation")


def test_explain_counts_the_rounds_by_source_and_says_why_suffix_did_not_run():
    eng = _engine(FakeEngine(block=4), proposers="dspine")
    out = list(eng.run(_requests(12), max_in_flight=4))
    why = eng.explain()
    assert why["dspine"]["rounds"] == sum(r.dspine_verify_steps or 0 for r in out) == sum(
        r.verify_steps or 0 for r in out) > 0
    assert why["dspine"]["ran"] and why["suffix"] == {"rounds": 0, "proposed": 0, "accepted": 0, "ran": False,
                                                      "why": "--engine-arg proposers=dspine (the draft only)"}


def test_admission_is_lazy():
    fake = FakeEngine()
    eng = _engine(fake)
    pulled: list[int] = []
    it = eng.run(_requests(100, pulled), max_in_flight=4)
    first = next(it)
    assert first.row_id.startswith("row") and len(pulled) <= 5  # the window, plus at most the one being admitted
    it.close()  # stopping the consumer abandons in-flight work in the engine
    assert len(fake.tokenizer_manager.aborted) <= 4


def test_aborted_and_failed_requests_become_row_errors():
    fake = FakeEngine(abort_keys={"row1"}, fail_keys={"row2"})
    out = {r.row_id: r for r in _engine(fake).run(_requests(4), 8)}
    assert out["row1"].finish_reason == "abort" and "aborted by the engine: Abort in waiting queue" in out["row1"].error
    assert out["row1"].verify_steps is None
    assert "longer than the model's context length" in out["row2"].error and out["row2"].finish_reason == "error"
    assert out["row0"].error is None and out["row3"].error is None


def test_stop_strings_are_applied_after_generation():
    fake = FakeEngine()
    eng = _engine(fake)
    req = Request("k", 0, [5, 5, 5], SamplingParams(max_new_tokens=8))
    full = next(eng.run([req], 1))
    stop = full.text[2:4]
    req.params = SamplingParams(max_new_tokens=8, stop=(stop,))
    cut = next(eng.run([req], 1))
    assert cut.finish_reason == "stop" and stop not in cut.text and cut.text == full.text[: full.text.find(stop)]


def test_logprobs_come_back_per_completion_token_and_follow_stop_cuts():
    fake = FakeEngine()
    eng = _engine(fake)
    req = Request("k", 0, [5, 5, 5], SamplingParams(max_new_tokens=8, logprobs=True, top_logprobs=2))
    full = next(eng.run([req], 1))
    assert fake.calls[-1][0].startswith("k#") and full.error is None
    assert len(full.logprobs) == len(full.token_ids) == 4
    tid, lp, top = full.logprobs[1]
    assert (tid, lp) == (full.token_ids[1], -0.5) and top == ((full.token_ids[1], -0.1), (full.token_ids[1] + 1, -0.2))
    stop = full.text[1:2]  # the tokens through the stop string stay (stop_strings.cut_at_stop): 2 of 4
    req.params = SamplingParams(max_new_tokens=8, logprobs=True, stop=(stop,))
    cut = next(eng.run([req], 1))
    assert len(cut.logprobs) == len(cut.token_ids) < len(full.token_ids)
    assert all(t == () for _, _, t in cut.logprobs)
    assert next(eng.run([Request("k", 0, [5, 5, 5], SamplingParams(max_new_tokens=8))], 1)).logprobs is None


def test_unreadable_logprobs_are_a_row_error():
    from dspine_batch.engines.sglang.logprobs import logprobs

    with pytest.raises(ValueError, match="no output_token_logprobs"):
        logprobs({}, 2)
    with pytest.raises(ValueError, match="1 output_token_logprobs for 2 tokens"):
        logprobs({"output_token_logprobs": [[-1.0, 3, None]]}, 2)


def test_engine_death_raises_and_abandons_in_flight():
    fake = FakeEngine(hang_keys={f"row{i}" for i in range(2, 50)})
    eng = _engine(fake)
    it = eng.run(_requests(50), max_in_flight=5)
    got = [next(it), next(it)]
    assert {r.row_id for r in got} == {"row0", "row1"}
    se.on_sigquit(3, None)  # what SGLang's watchdog does when a scheduler dies
    with pytest.raises(se.EngineDied, match="crashed"):
        next(it)
    assert len(fake.tokenizer_manager.aborted) == 5  # every in-flight request aborted
    with pytest.raises(se.EngineDied):
        list(eng.run(_requests(1), 1))


def test_dead_engine_process_is_detected():
    eng = _engine(FakeEngine(), watch_pids={_dead_pid()})
    with pytest.raises(se.EngineDied, match="exited"):
        list(eng.run(_requests(2), 2))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_close_kills_only_the_engines_processes():
    psutil = pytest.importorskip("psutil")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        before = se._child_pids()
        fake = FakeEngine(spawn_child=True)  # the "scheduler" the engine starts
        owned = se._child_pids() - before
        assert fake.child.pid in owned and bystander.pid not in owned
        eng = se.SGLangEngine(fake, FakeTokenizer(), {}, 4, None, owned)
        eng.close()
        assert fake.shutdown_called
        fake.child.wait(timeout=10)
        assert bystander.poll() is None and psutil.pid_exists(bystander.pid)  # SGLang's own call would kill it
        eng.close()  # idempotent
    finally:
        bystander.kill()
        bystander.wait()


def test_close_and_a_refused_start_destroy_the_zeromq_contexts_made_since_the_start(qwen3_dir, qwen3_target, tmp_path):
    """SGLang makes its ZeroMQ contexts as locals and keeps some sockets in helper objects. A context left with an
    open socket holding an unsent message hung the whole process in ``term()`` when the garbage collector met it
    later (the SGLang test leg, the second engine on). ``close`` destroys, with no linger, every context made since
    the engine started, and leaves older ones alone."""
    zmq = pytest.importorskip("zmq")
    from dspine.draft.io import init_draft

    init_draft(qwen3_target, num_layers=2, block_size=8, transfer_rank=8, message_size=16, top_k=4,
               intermediate_size=64).save(tmp_path / "draft")
    older = zmq.Context()
    made = {}

    def factory(**kw):
        engine = FakeEngine()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect("tcp://127.0.0.1:9")  # no peer: the message stays queued
        push.send(b"pending", zmq.NOBLOCK)
        engine.helper = {"socket": push}  # where close_sockets does not look
        made.update(ctx=ctx, push=push)
        return engine

    def refused(**kw):  # a start SGLang gives up after its tokenizer manager made its sockets
        factory(**kw)
        raise RuntimeError("the scheduler died during start-up")

    try:
        eng = se.SGLangEngine.load(qwen3_dir, str(tmp_path / "draft"), {}, engine_factory=factory,
                                   tokenizer=FakeTokenizer(), server_parser=_mini_parser())
        eng.close()
        assert made["ctx"].closed and made["push"].closed
        assert not older.closed
        with pytest.raises(FatalError, match="failed to start"):
            se.SGLangEngine.load(qwen3_dir, str(tmp_path / "draft"), {}, engine_factory=refused,
                                 tokenizer=FakeTokenizer(), server_parser=_mini_parser())
        assert made["ctx"].closed and made["push"].closed  # the refused start's, closed: close() never comes
        assert not older.closed
    finally:
        older.destroy(linger=0)


@pytest.fixture
def tiny_pair(qwen3_dir, qwen3_target, tmp_path):
    from dspine.draft.io import init_draft

    init_draft(qwen3_target, num_layers=2, block_size=8, transfer_rank=8, message_size=16, top_k=4,
               intermediate_size=64).save(tmp_path / "draft")
    return qwen3_dir, str(tmp_path / "draft")


def _load(model, draft, args, seen):
    def factory(**kw):
        seen.update(kw)
        return FakeEngine()

    return se.SGLangEngine.load(model, draft, args, engine_factory=factory, tokenizer=FakeTokenizer(),
                                server_parser=_mini_parser())


def test_load_with_a_fake_engine_builds_identity_and_kwargs(tiny_pair):
    model, draft = tiny_pair
    seen = {}
    eng = _load(model, draft, {"mem_fraction_static": "0.5", "dtype": "bfloat16"}, seen)
    assert seen["speculative_algorithm"] == "DSPINE" and seen["mem_fraction_static"] == 0.5
    ident = eng.identity()
    assert ident["block_size"] == 8 and ident["server_args"]["dtype"] == "bfloat16"
    assert "mem_fraction_static" not in ident["server_args"]  # operational: may change on resume
    assert eng.max_context == 1024 - 8 - 1
    eng.close()


@pytest.mark.parametrize("args, match", [
    ({"block_size": "9"}, "counts the anchor"),
    ({"speculative_num_draft_tokens": "1"}, "does not fit"),
])
def test_load_checks_the_draft_before_starting_anything(tiny_pair, args, match):
    model, draft = tiny_pair
    seen = {}
    with pytest.raises(UsageError, match=match):
        _load(model, draft, args, seen)
    assert not seen  # no engine was built


def test_load_refuses_a_non_dspine_draft(tiny_pair, tmp_path):
    model, draft = tiny_pair
    bad = tmp_path / "dflash"
    bad.mkdir()
    cfg = json.loads((Path(draft) / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="DFlash draft"):
        _load(model, str(bad), {}, {})


def test_sglang_available_reports_a_reason():
    ok, why = se.sglang_available()
    assert isinstance(ok, bool) and why
    if os.environ.get("CI") and not ok:
        assert "sglang" in why or "GPU" in why


def test_proposers_reach_the_dspine_worker_through_the_environment(tiny_pair, monkeypatch):
    """``--engine-arg proposers=...``: not a server argument; DSPINE_PROPOSERS while the engine starts."""
    from dspine.sglang.sampling import engine_env

    model, draft = tiny_pair
    monkeypatch.delenv(se.PROPOSERS_ENV, raising=False)
    for k in engine_env():
        monkeypatch.delenv(k, raising=False)
    env = {}

    def factory(**kw):
        env["seen"] = os.environ.get(se.PROPOSERS_ENV)
        env["sampling"] = {k: os.environ.get(k) for k in engine_env()}  # the request contract's semantics
        assert "proposers" not in kw
        return FakeEngine()

    def load(args):
        return se.SGLangEngine.load(model, draft, args, engine_factory=factory, tokenizer=FakeTokenizer(),
                                    server_parser=_mini_parser())

    eng = load({})
    assert env["seen"] == "auto" and eng.identity()["proposers"] == "auto"
    assert se.PROPOSERS_ENV not in os.environ  # restored after the start
    for k in engine_env():
        assert k not in os.environ
    assert env["sampling"] == engine_env()
    eng.close()
    eng = load({"proposers": "dspine"})
    assert env["seen"] == "dspine" and "proposers" not in eng.identity()
    eng.close()
    with pytest.raises(UsageError, match="expected one of"):
        load({"proposers": "ngram"})
    _, opts = se.build_server_kwargs("/m", None, {"proposers": "suffix"}, parser=_mini_parser())
    assert opts["proposers"] is None  # no DSPINE: nothing to set


# -- --engine auto: every piece a GPU run needs, checked before the choice (engines/sglang/readiness.py) -----------


class _Cuda:
    def __init__(self, bf16=True, capability=(9, 0)):
        self.bf16, self.capability = bf16, capability

    def is_available(self):
        return True

    def is_bf16_supported(self):
        return self.bf16

    def get_device_name(self, i):
        return "NVIDIA H100"

    def get_device_capability(self, i):
        return self.capability


def _importer(missing=()):
    import types

    def import_module(name):
        if name in missing or any(name.startswith(m + ".") for m in missing):
            raise ImportError(f"{name}: libcuda.so.1: cannot open shared object file")
        return types.SimpleNamespace(STAND_IN=False)

    return import_module


@pytest.fixture
def sglang_spec(monkeypatch):
    """``find_spec('sglang')`` answers yes (the default suite's venv has no SGLang)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))


def test_auto_falls_back_with_one_line_when_sgl_kernel_does_not_import(sglang_spec, monkeypatch, capsys):
    from dspine_batch.engines import registry
    from dspine_batch.engines.sglang import readiness

    real = readiness.check
    monkeypatch.setattr(readiness, "check", lambda: real(_importer({"sgl_kernel"}), _Cuda(), lambda: []))
    assert registry.resolve_name("auto") == "reference"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dspine-batch: --engine auto picked reference (sgl_kernel (SGLang's CUDA kernels) does not "
                   "import: ImportError: sgl_kernel: libcuda.so.1: cannot open shared object file)"]


@pytest.mark.parametrize("cuda, missing, problems, want", [
    (_Cuda(bf16=False), (), [], "has no bfloat16"),
    (_Cuda(), ("flashinfer", "sgl_kernel.flash_attn", "triton"), [], "no attention backend imports"),
    (_Cuda(), (), ["SGLANG_PLUGINS='x' does not include 'dspine'"], "does not include 'dspine'"),
    (_Cuda(), ("dspine.sglang.plugin",), [], "the DSPINE plugin does not import"),
])
def test_auto_checks_what_a_gpu_run_needs(sglang_spec, cuda, missing, problems, want):
    from dspine_batch.engines.sglang.readiness import check

    ready = check(_importer(set(missing)), cuda, lambda: problems)
    assert not ready.ok and want in ready.why and "\n" not in ready.why


def test_auto_takes_sglang_with_an_attention_backend_that_imports(sglang_spec):
    from dspine_batch.engines.sglang.readiness import check, gpu_dtype

    ready = check(_importer(), _Cuda(), lambda: [])
    assert ready.ok and ready.engine_args == {} and "bfloat16" in ready.why  # flashinfer: SGLang's own default
    ready = check(_importer({"flashinfer"}), _Cuda(), lambda: [])
    assert ready.ok and ready.engine_args == {"attention_backend": "fa3"}
    ready = check(_importer({"flashinfer"}), _Cuda(capability=(8, 0)), lambda: [])
    assert ready.ok and ready.engine_args == {"attention_backend": "triton"} and "flashinfer does not" in ready.why
    assert gpu_dtype(_Cuda()) == "bfloat16" and gpu_dtype(_Cuda(bf16=False)) == "float32"


def test_a_gpu_run_gets_the_dtype_both_engines_resolve(tiny_pair):
    """No dtype: bfloat16 (the GPU's resolution of ``auto``), never the checkpoint's own; an explicit one wins."""
    kw, _ = se.build_server_kwargs("/m", "/d", {}, parser=_mini_parser())
    assert kw["dtype"] == "bfloat16"
    kw, _ = se.build_server_kwargs("/m", "/d", {"dtype": "auto"}, parser=_mini_parser(), gpu_dtype="float32")
    assert kw["dtype"] == "float32"
    kw, _ = se.build_server_kwargs("/m", "/d", {"dtype": "float16"}, parser=_mini_parser())
    assert kw["dtype"] == "float16"
    kw, _ = se.build_server_kwargs("/m", "/d", {}, parser=_mini_parser(), on_cpu=True)
    assert kw["dtype"] == "float32"  # the CPU path's


def test_unhonoured_seeds_are_said_once_and_recorded(tiny_pair, capsys):
    """SGLang 0.5.23 ignores per-request seeds (plain and DSPINE): said in one line when the first sampled row is
    sent, and recorded in the run identity, so a resumed job's sampled rows are not taken for reproductions."""
    eng = _engine(FakeEngine(block=4))
    list(eng.run(_requests(3), max_in_flight=2))  # greedy rows: nothing to say
    assert "seeds" not in capsys.readouterr().err
    list(eng.run(_requests(5, temperature=0.7, seed=3), max_in_flight=2))
    assert capsys.readouterr().err.count("does not honour per-request seeds") == 1
    model, draft = tiny_pair
    loaded = _load(model, draft, {}, {})
    assert loaded.identity()["seeds"] == "not honoured"
    loaded.close()


# -- scoring on the real SGLang (CPU test path) ------------------------------------------------------------------
# float32 on both sides; SGLang's prefill and HF's forward are two implementations of the same model (other kernels,
# other GEMM shapes): the log-softmax of a position agrees to rounding (measured: bit for bit plain, 1e-6 under DSPINE).
SCORE_TOL = 1e-4


@pytest.mark.sglang
@pytest.mark.parametrize("draft", [False, True], ids=["plain", "dspine"])
def test_sglang_scores_are_hf_transformers_log_softmax(tmp_path, draft):
    pytest.importorskip("sglang", reason="needs the sglang extra (scripts/setup_sglang_venv.sh)")
    import torch
    from helpers import chat_pair
    from transformers import AutoModelForCausalLM

    (tmp_path / "model").mkdir()
    (tmp_path / "draft").mkdir()
    model, draft_dir = chat_pair(tmp_path / "model", tmp_path / "draft")
    last = json.loads((Path(model) / "config.json").read_text())["vocab_size"] - 1
    engine = se.SGLangEngine.load(model, draft_dir if draft else "none", {})  # under DSPINE too
    try:
        tok = engine.tokenizer
        prompts = [tok.render_chat([{"role": "user", "content": t}]) for t in ("is it red?", "say a long thing")]
        labels = ((11,), (42,), (200,), (7, 99, 3))  # several one-token labels and a multi-token one
        reqs = [Request("labels", 0, prompts[0], SamplingParams(), continuations=labels),
                # the vocabulary's last id too (SGLang reports it as 0: sglang.logprobs.continuation)
                Request("cont", 0, prompts[1], SamplingParams(), continuations=((5, 17, 250, last, 8, 64),)),
                Request("empty", 0, prompts[1], SamplingParams(), continuations=((),))]
        got = engine.score(reqs)
    finally:
        engine.close()
    assert got[2].error is not None and got[2].continuation_logprobs is None  # refused, as on the reference engine
    assert len({lp[0] for lp in got[0].continuation_logprobs}) == len(labels)  # each label its own number
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    for req, res in zip(reqs[:2], got[:2], strict=True):
        assert res.error is None, res.error
        assert len(res.continuation_logprobs) == len(req.continuations)
        for cont, lps in zip(req.continuations, res.continuation_logprobs, strict=True):
            ids = torch.tensor([list(req.prompt_ids) + list(cont)])
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
            n = len(req.prompt_ids)
            want = [float(logp[n - 1 + j, t]) for j, t in enumerate(cont)]
            assert len(lps) == len(cont)
            worst = max(abs(a - b) for a, b in zip(lps, want, strict=True))
            print(f"scores {req.row_id} {cont}: {lps} max |sglang - hf| = {worst:.2e}")
            assert worst < SCORE_TOL, (lps, want)


def test_continuation_logprobs_are_the_tail_of_sglangs_input_logprobs():
    from dspine_batch.engines.sglang.logprobs import continuation

    meta = {"input_token_logprobs": [[None, 4, None], [-1.5, 7, None], [-0.25, 9, None]]}
    assert continuation({"meta_info": meta}, (7, 9)) == [-1.5, -0.25]
    assert continuation({"meta_info": meta}, (9,)) == [-0.25]
    clipped = {"input_token_logprobs": [[None, 4, None], [-1.5, 7, None], [-3.0, 0, None]]}  # SGLang's last id
    assert continuation({"meta_info": clipped}, (7, 299)) == [-1.5, -3.0]
    with pytest.raises(ValueError, match="not the continuation"):  # SGLang's positions are not ours: never a guess
        continuation({"meta_info": meta}, (9, 7))
    with pytest.raises(ValueError, match="not the continuation"):
        continuation({"meta_info": meta}, (4, 7, 9))  # the first position has no logprob
