"""The engine boundary: per-row seeds, SGLang stat normalisation, and the scripted test engine."""

from __future__ import annotations

import pytest

from dspine_batch.engines.base import Request, Result, SamplingParams, derive_seed
from dspine_batch.engines.registry import open_engine
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.engines.sglang.stats import stats_from_sglang_meta
from dspine_batch.errors import UsageError


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(0, "a", 0) == derive_seed(0, "a", 0)
    assert len({derive_seed(0, "a", 0), derive_seed(0, "a", 1), derive_seed(1, "a", 0), derive_seed(0, "b", 0)}) == 4
    assert 0 <= derive_seed(123, "row", 7) < 2**63
    assert derive_seed(0, "a", 0) == 3708771627899180524  # pinned: resumed rows must equal earlier runs


def test_sglang_meta_goes_through_the_shared_normaliser():
    meta = {"prompt_tokens": 9, "completion_tokens": 13, "spec_verify_ct": 4, "spec_accepted_drafts": 8,
            "spec_proposed_drafts": 28, "spec_accept_histogram": [1, 0, 3]}
    r = stats_from_sglang_meta(meta, Result("k", 0))
    assert (r.verify_steps, r.draft_tokens_accepted, r.draft_tokens_proposed) == (4, 8, 28)
    assert r.accept_histogram == [1, 0, 3] and r.accept_length == 3.0 and r.prompt_tokens == 9


def test_no_speculation_leaves_stats_null():
    r = stats_from_sglang_meta({"prompt_tokens": 3, "completion_tokens": 5}, Result("k", 0))
    assert r.verify_steps is None and r.accept_length is None and r.completion_tokens == 5


def _req(key, prompt="hello", **p):
    return Request(key, 0, [ord(c) for c in prompt], SamplingParams(**p))


def test_scripted_engine_is_deterministic_and_bounded():
    eng = ScriptedEngine(latency=0.002)
    reqs = [_req(f"r{i}", f"prompt {i}", temperature=0.7, seed=i) for i in range(20)]
    opened = {"max": 0}
    seen = []

    def feed():
        for r in reqs:
            seen.append(r.row_id)
            yield r

    out = []
    for res in eng.run(feed(), max_in_flight=4):
        opened["max"] = max(opened["max"], len(seen) - len(out))
        out.append(res)
    assert opened["max"] <= 4
    again = {r.row_id: r.token_ids for r in ScriptedEngine().run(reqs, 1)}
    assert {r.row_id: r.token_ids for r in out} == again
    assert all(r.verify_steps and r.accept_histogram and r.accept_length for r in out)


def test_scripted_engine_errors_and_stop_strings():
    eng = ScriptedEngine(error_every=1)
    assert next(eng.run([_req("a")], 1)).error
    r = next(ScriptedEngine().run([_req("a", max_new_tokens=2)], 1))
    assert r.finish_reason == "length" and r.completion_tokens == 2
    full = next(ScriptedEngine().run([_req("a", max_new_tokens=64)], 1)).text
    cut = next(ScriptedEngine().run([_req("a", max_new_tokens=64, stop=(full[3:5],))], 1))
    assert cut.text == full[: full.find(full[3:5])] and cut.finish_reason == "stop"


def test_open_engine_choices():
    with pytest.raises(UsageError, match="not available"):
        open_engine("sglang", "embedded", "none", {})
    with pytest.raises(UsageError, match="unknown engine"):
        open_engine("vllm", "embedded", "none", {})
    with pytest.raises(UsageError, match="unknown for the scripted engine"):
        open_engine("scripted", "embedded", "none", {"bogus": "1"})
