"""The real ``sglang.Engine`` (0.5.23) runs plain and DSPINE decoding end to end on CPU (the plugin's CPU
bridges, ``dspine.sglang.cpu``), on tiny checkpoints built by ``tests/helpers.py``: a dense Qwen3 target and a
Qwen3.5-style hybrid (Gated DeltaNet + full attention) with ReplaySSM on, so the GDN verify/commit path runs.
SGLang's overlap scheduler runs as on a GPU (``output_ids`` a round behind the device), and the round takes DFlash's
draft-graph branch (run eagerly); ``DSPINE_SGLANG_OVERLAP=0`` and ``DSPINE_SGLANG_GRAPH_TWIN=0`` run the plain loop
and the eager selector (CI runs both ways). On a GPU (``scripts/gpu/gpu_check.sh --sglang``) the same
tests run on CUDA with CUDA graphs.

Each engine start costs 1-2 minutes on a small CPU, so every engine is started once per module and runs its
whole workload in its fixture (engines never overlap: ``Engine.shutdown`` and SGLang's signal handling assume
one engine per process at a time); the tests then check the recorded results.
"""

from __future__ import annotations

import json
import math
import os

import pytest

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang", reason="needs the sglang extra (scripts/setup_sglang_venv.sh)")

import torch  # noqa: E402
from helpers import (  # noqa: E402
    ALTERNATING,
    alternating_hybrid_pair,
    constant_pair,
    hybrid_pair,
    on_gpu,
    random_pair,
    run_engine,
)
from helpers import SGLANG_BLOCK as BLOCK  # noqa: E402

from dspine.sglang.cpu import overlap  # noqa: E402
from dspine.sglang.rounds import SYNC_LOG_ENV  # noqa: E402
from dspine.sglang.worker import PROPOSAL_LOG_ENV  # noqa: E402

PROMPTS = [[3, 17, 42, 99, 7], [200, 11, 5], [64, 64, 1, 250, 31, 8, 19]]
MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
SAMPLED_N = 400  # requests for the chi-square test (first token from prefill, second from a verify round)


def _greedy(engine) -> list[dict]:
    return [engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS]  # one at a time: round order


BIAS = {"17": 3.0, "42": 2.0}


def _processed(engine) -> list[dict]:
    """Greedy requests with logit_bias and a custom logit processor (SGLang applies it after the bias). No penalty
    here: SGLang's own overlap loop penalizes a token late (test_sglang_requests.py)."""
    from sglang_processors import BanArgmax

    sp = {**GREEDY, "logit_bias": BIAS}
    return [engine.generate(input_ids=p, sampling_params=sp, custom_logit_processor=BanArgmax.to_str())
            for p in PROMPTS]


# Hybrid targets: ReplaySSM spec-verify with a float32 SSM state. On a GPU SGLang's auto picks extra_buffer for the
# prefix cache; SGLang keeps Mamba state snapshots on GPUs only, so on the CPU path the prefix cache is off under
# overlap scheduling (auto would pick extra_buffer) and runs without extra buffer (no_buffer) with the plain loop.
# SGLang keeps GDN conv windows (and the ReplaySSM delta/key rings) in bfloat16 whatever the model dtype; that
# rounding moves a tiny random model's logits by ~1e-3, enough to flip near-ties against the float32
# reference, so these runs keep them in float32 (the bfloat16 rings are covered by test_sglang_cpu_kernels).
CPU_HYBRID = {} if on_gpu() or not overlap() else {"disable_radix_cache": True}
HYBRID = dict(enable_linear_replayssm_spec=True, mamba_ssm_dtype="float32", max_mamba_cache_size=16, **CPU_HYBRID)
HYBRID_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


def _reference(target_dir: str, draft_dir: str | None, prompts=PROMPTS, record: list | None = None):
    """dspine's reference engine: outputs (and, with ``record``, every round's proposed tokens)."""
    from dspine import generate, load_draft, load_target

    target = load_target(target_dir)
    draft = None if draft_dir is None else load_draft(draft_dir)
    if draft is not None and record is not None:
        propose = draft.propose

        def recording(*a, **k):
            prop = propose(*a, **k)
            record.append(prop.tokens[:, : BLOCK - 1].tolist())
            return prop

        draft.propose = recording
    outs = []
    for p in prompts:
        outs += generate(target, draft, [p], max_new_tokens=MAX_NEW, temperature=0.0, block_size=BLOCK)
    return outs


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("sglang_random"))


@pytest.fixture(scope="module")
def plain_run(random_models):
    target, _ = random_models
    return run_engine(target, lambda e: {"greedy": _greedy(e), "processed": _processed(e)},
                      enable_custom_logit_processor=True)


@pytest.fixture(scope="module")
def dspine_run(random_models, tmp_path_factory):
    target, draft = random_models
    log = tmp_path_factory.mktemp("proposals") / "rounds.jsonl"
    prompt = PROMPTS[0]

    def workload(engine):
        greedy = _greedy(engine)
        rounds = [json.loads(line) for line in log.read_text().splitlines()]
        sampled = engine.generate(input_ids=[prompt] * SAMPLED_N,
                                  sampling_params=[{"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": i}
                                                   for i in range(SAMPLED_N)])
        return {"greedy": greedy, "rounds": rounds, "sampled": sampled, "processed": _processed(engine)}

    return run_engine(target, workload, draft=draft, env={PROPOSAL_LOG_ENV: str(log)},
                      enable_custom_logit_processor=True)


@pytest.fixture(scope="module")
def accepting_run(tmp_path_factory):
    target, draft = constant_pair(tmp_path_factory.mktemp("sglang_constant"))
    return target, draft, run_engine(target, _greedy, draft=draft)


def test_greedy_dspine_equals_plain_sglang_equals_reference(random_models, plain_run, dspine_run):
    target, _ = random_models
    ref = [o.token_ids for o in _reference(target, None)]
    plain = [o["output_ids"] for o in plain_run["greedy"]]
    spec = [o["output_ids"] for o in dspine_run["greedy"]]
    assert all(len(r) == MAX_NEW for r in ref)
    assert plain == ref
    assert spec == ref
    for o in dspine_run["greedy"]:
        meta = o["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (BLOCK - 1)


def test_a_custom_logit_processor_comes_after_penalties_and_bias_as_in_sglangs_sampler(plain_run, dspine_run):
    """SGLang's sampler: penalties, the grammar mask, logit_bias, then custom logit processors; the DSPINE verify
    in the same order (it applied the processor first: the argmax it banned was the unbiased one)."""
    plain = [o["output_ids"] for o in plain_run["processed"]]
    assert [o["output_ids"] for o in dspine_run["processed"]] == plain
    assert plain != [o["output_ids"] for o in plain_run["greedy"]]
    assert sum(o["meta_info"]["spec_verify_ct"] for o in dspine_run["processed"]) > 0


def test_the_cpu_path_proposes_through_the_branch_a_gpu_captures(dspine_run):
    """On the CPU the draft-graph branch (the selector sampler a GPU folds into its captured draft forward) runs
    eagerly in every round; ``DSPINE_SGLANG_GRAPH_TWIN=0`` takes the eager selector instead (CI's second pass)."""
    from dspine.sglang.worker import GRAPH_TWIN_ENV

    want = "eager" if os.environ.get(GRAPH_TWIN_ENV) == "0" else "graph"
    assert {r["path"] for r in dspine_run["rounds"]} == {want}


def test_sglang_proposals_equal_the_reference_engines_round_by_round(random_models, dspine_run):
    target, draft = random_models
    ref_rounds: list = []
    _reference(target, draft, record=ref_rounds)
    ours = [r["tokens"] for r in dspine_run["rounds"]]
    assert len(ours) >= 3 * len(PROMPTS)
    assert ours == ref_rounds


def test_drafts_that_fit_are_accepted_through_sglang(accepting_run):
    target, draft, outs = accepting_run
    ref = [o.token_ids for o in _reference(target, draft)]
    assert [o["output_ids"] for o in outs] == ref
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
    tau = 1 + correct / verify  # tokens per verify round, the bonus included
    assert tau > 2, f"tau {tau:.2f}"


def _second_token_distribution(target_dir: str, prompt: list[int]) -> torch.Tensor:
    """P(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1) at temperature 1 (transformers as the oracle)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        V = p1.shape[0]
        ids = torch.cat([torch.tensor([prompt]).expand(V, -1), torch.arange(V)[:, None]], dim=1)
        p2 = torch.softmax(model(ids).logits[:, -1].double(), -1)
    return p1 @ p2


def test_sampled_decoding_through_sglang_matches_the_target_distribution(random_models, dspine_run):

    target, _ = random_models
    expected = _second_token_distribution(target, PROMPTS[0]) * SAMPLED_N
    counts = torch.zeros_like(expected)
    verified = 0
    for o in dspine_run["sampled"]:
        counts[o["output_ids"][1]] += 1
        verified += o["meta_info"].get("spec_verify_ct", 0)
    assert verified >= SAMPLED_N  # the second token came out of a verify round
    stat = _assert_chi2_fits(counts, expected)
    assert not math.isnan(stat)


def _assert_chi2_fits(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi2 of observed ``counts`` against ``expected`` counts (cells under 5 pooled); asserts at least
    3 degrees of freedom and p > 1e-3; returns the statistic."""
    from scipy.stats import chi2

    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert dof >= 3
    p = float(chi2.sf(stat, dof))
    assert p > 1e-3, f"chi2 {stat:.1f} on {dof} dof, p={p:.2e}"
    return stat


# -- penalties across retraction: the generated history rebuilt from the device's tails ------------------------------

RETRACT_PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(6)] for i in range(8)]
RETRACT = {"max_new_tokens": 40, "temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.3}


@pytest.fixture(scope="module")
def retract_run(random_models, tmp_path_factory):
    """Eight penalized rows at once in a KV pool too small for all of them: SGLang retracts rows and runs them
    again later (their prefill then covers the tokens generated so far)."""
    target, draft = random_models
    syncs = tmp_path_factory.mktemp("retract") / "syncs.jsonl"
    outs = run_engine(target, lambda e: e.generate(input_ids=RETRACT_PROMPTS, sampling_params=RETRACT), draft=draft,
                      env={SYNC_LOG_ENV: str(syncs)}, max_total_tokens=192, max_running_requests=8)
    return outs, [json.loads(line) for line in syncs.read_text().splitlines()]


def test_penalized_rows_survive_retraction(retract_run):
    """The penalty history of a row re-entering after retraction (under overlap its output_ids then miss the new
    prefill's token) comes from the device's tails: every row completes, every round of a penalized row read its
    history once, and none needed the fallback. It raised in the scheduler and killed the engine. (Equality with
    the rows run alone is not asserted: a batch of eight and a re-prefill round differently from one row alone,
    enough to flip a near-tie of a tiny random model; the penalty arithmetic itself is checked slot by slot in
    test_sglang_processing.py and end to end in test_sglang_requests.py.)"""
    outs, syncs = retract_run
    assert sum(o["meta_info"].get("num_retractions", 0) for o in outs) > 0
    assert all(len(o["output_ids"]) == RETRACT["max_new_tokens"] for o in outs)
    assert all(r["syncs"] == 1 for r in syncs if r["mode"] == "decode" and r["needs"])
    assert sum(r["needs"] for r in syncs) > 0 and sum(r["fallbacks"] for r in syncs) == 0
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


# -- the Qwen3.5 hybrid (GDN + full attention) with ReplaySSM -----------------------------------------------------


def _rounds(log) -> list:
    return [json.loads(line)["tokens"] for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    return hybrid_pair(tmp_path_factory.mktemp("sglang_hybrid"))


@pytest.fixture(scope="module")
def hybrid_plain_run(hybrid_models):
    target, _ = hybrid_models
    return run_engine(target, _greedy, env=HYBRID_ENV, max_mamba_cache_size=16, **CPU_HYBRID)


@pytest.fixture(scope="module")
def hybrid_dspine_run(hybrid_models, tmp_path_factory):
    target, draft = hybrid_models
    log = tmp_path_factory.mktemp("hybrid_proposals") / "rounds.jsonl"
    outs = run_engine(target, _greedy, draft=draft, env={**HYBRID_ENV, PROPOSAL_LOG_ENV: str(log)}, **HYBRID)
    return {"greedy": outs, "rounds": _rounds(log)}


@pytest.fixture(scope="module")
def hybrid_accepting_run(tmp_path_factory):
    target, draft = alternating_hybrid_pair(tmp_path_factory.mktemp("sglang_hybrid_alternating"))
    log = tmp_path_factory.mktemp("hybrid_alternating_proposals") / "rounds.jsonl"
    outs = run_engine(target, _greedy, draft=draft, env={**HYBRID_ENV, PROPOSAL_LOG_ENV: str(log)}, **HYBRID)
    return target, draft, {"greedy": outs, "rounds": _rounds(log)}


def test_hybrid_greedy_dspine_equals_plain_sglang_equals_reference(hybrid_models, hybrid_plain_run,
                                                                    hybrid_dspine_run):
    target, _ = hybrid_models
    ref = [o.token_ids for o in _reference(target, None)]
    assert all(len(r) == MAX_NEW for r in ref)
    assert [o["output_ids"] for o in hybrid_plain_run] == ref
    assert [o["output_ids"] for o in hybrid_dspine_run["greedy"]] == ref
    for o in hybrid_dspine_run["greedy"]:
        meta = o["meta_info"]
        # every round rolls the GDN state back over the rejected drafts: 1 + accepted of the block committed
        assert meta["spec_verify_ct"] >= MAX_NEW // BLOCK
        assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (BLOCK - 1)
        assert meta["spec_num_correct_drafts"] < meta["spec_num_proposed_drafts"]


def test_hybrid_proposals_equal_the_reference_engines_round_by_round(hybrid_models, hybrid_dspine_run):
    target, draft = hybrid_models
    ref_rounds: list = []
    _reference(target, draft, record=ref_rounds)
    assert len(hybrid_dspine_run["rounds"]) >= 3 * len(PROMPTS)
    assert hybrid_dspine_run["rounds"] == ref_rounds


def _trimmed(hist) -> list[int]:
    out = list(hist)
    while out and out[-1] == 0:
        out.pop()
    return out


def test_hybrid_partially_accepted_blocks_commit_through_replayssm(hybrid_accepting_run):
    """X Y X Y ... against a draft that proposes X everywhere: rounds anchored on Y accept one draft of three,
    so ReplaySSM commits 2 of the block's 4 GDN steps and rolls the rest back, again and again (its ring fills
    and folds into the checkpoint several times per request); the outputs, the accept histograms and the
    proposals are the reference engine's."""
    target, draft, run = hybrid_accepting_run
    ref_rounds: list = []
    ref = _reference(target, draft, record=ref_rounds)
    outs = run["greedy"]
    assert [o["output_ids"] for o in outs] == [r.token_ids for r in ref]
    assert all(o["output_ids"][:4] == [*ALTERNATING, *ALTERNATING] for o in outs)
    for o, r in zip(outs, ref, strict=True):
        meta = o["meta_info"]
        hist = meta["spec_correct_drafts_histogram"]
        assert _trimmed(hist) == _trimmed(r.stats.accept_histogram)
        partial = sum(hist[1 : BLOCK - 1])  # rounds that accepted some drafts but not all
        assert partial >= MAX_NEW // 4, hist
        assert meta["spec_num_correct_drafts"] == r.stats.draft_tokens_accepted > 0
    assert run["rounds"] == ref_rounds


# -- suffix proposals beside the draft (DSPINE_PROPOSERS) -----------------------------------------------------------
# Prompts that quote themselves (p + greedy(p) + p), then the first one again: its second run finds the first's
# output in the finished-output index, so suffix proposals exist and are right; outputs must stay plain decoding's.

SUFFIX_SAMPLED_N = 300


def _quoting_prompts(target_dir: str) -> list[list[int]]:
    prompts = PROMPTS[:2]
    ref = [o.token_ids for o in _reference(target_dir, None, prompts=prompts)]
    qs = [p + r + p for p, r in zip(prompts, ref, strict=True)]
    return qs + [qs[0]]


def _suffix_run(target, draft, mode, log, sampled=False, env=None, **kw):
    from dspine.sglang.suffix import PROPOSERS_ENV, ROUND_LOG_ENV

    qs = _quoting_prompts(target)

    def workload(engine):
        greedy = [engine.generate(input_ids=q, sampling_params=GREEDY) for q in qs]
        rounds = [json.loads(line) for line in log.read_text().splitlines()]
        out = {"prompts": qs, "greedy": greedy, "rounds": rounds}
        if sampled:
            out["sampled"] = engine.generate(
                input_ids=[PROMPTS[0]] * SUFFIX_SAMPLED_N,
                sampling_params=[{"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": i}
                                 for i in range(SUFFIX_SAMPLED_N)])
            out["sampled_rounds"] = [json.loads(line) for line in log.read_text().splitlines()][len(rounds):]
        return out

    return run_engine(target, workload, draft=draft,
                      env={**(env or {}), PROPOSERS_ENV: mode, ROUND_LOG_ENV: str(log)}, **kw)


def _by_source(rounds) -> dict[str, dict[str, int]]:
    out = {s: {"rounds": 0, "proposed": 0, "accepted": 0} for s in ("suffix", "dspine")}
    for r in rounds:
        for src, prop, acc in zip(r["source"], r["proposed"], r["accepted"], strict=True):
            out[src]["rounds"] += 1
            out[src]["proposed"] += prop
            out[src]["accepted"] += acc
    return out


def _check_suffix_greedy(target, run):
    ref = [o.token_ids for o in _reference(target, None, prompts=run["prompts"])]
    assert all(len(r) == MAX_NEW for r in ref)
    assert [o["output_ids"] for o in run["greedy"]] == ref
    stats = _by_source(run["rounds"])
    assert stats["suffix"]["rounds"] > 0 and stats["suffix"]["accepted"] > 0, stats
    # the log's rounds are SGLang's: per request the same verify rounds and accepted drafts as its meta_info
    for o in run["greedy"]:
        meta, rid = o["meta_info"], o["meta_info"].get("id")
        if rid is None:
            continue
        mine = [(a, p) for r in run["rounds"] for x, a, p in zip(r["rid"], r["accepted"], r["proposed"]) if x == rid]
        assert len(mine) == meta["spec_verify_ct"]
        assert sum(a for a, _ in mine) == meta["spec_num_correct_drafts"]
    # the same rounds reach the client in meta_info, and become the by-source columns of dspine-batch's results
    from dspine_batch.engines.sglang.stats import by_source, spec_stats

    for o in run["greedy"]:
        meta, rid = o["meta_info"], o["meta_info"].get("id")
        if rid is None:
            continue
        width = meta["spec_num_proposed_drafts"] // meta["spec_verify_ct"]
        want = {"suffix": [0, 0, 0], "dspine": [0, 0, 0]}
        for r in run["rounds"]:
            for x, src, prop, acc in zip(r["rid"], r["source"], r["proposed"], r["accepted"], strict=True):
                if x != rid:
                    continue
                lead = min(acc, prop)  # tokens by who proposed them: the draft's after a shorter suffix match
                want[src] = [want[src][0] + 1, want[src][1] + prop, want[src][2] + lead]
                if src == "suffix" and width > prop:
                    want["dspine"][1:] = [want["dspine"][1] + width - prop, want["dspine"][2] + acc - lead]
        got = by_source(meta, spec_stats(meta, block_size=width + 1), width + 1)
        assert {k: list(v) for k, v in got.items()} == want, (got, want)
    # the repeated prompt's suffix rounds (its first run's output) are accepted whole
    rid = run["greedy"][-1]["meta_info"].get("id")
    if rid is not None:
        last = [(a, p) for r in run["rounds"] for x, a, p, s in zip(r["rid"], r["accepted"], r["proposed"],
                                                                     r["source"]) if x == rid and s == "suffix"]
        assert last and sum(a for a, _ in last) >= MAX_NEW // 2, last
    return stats


@pytest.fixture(scope="module")
def suffix_run(random_models, tmp_path_factory):
    target, draft = random_models
    log = tmp_path_factory.mktemp("suffix_rounds") / "rounds.jsonl"
    syncs = log.with_name("syncs.jsonl")
    run = _suffix_run(target, draft, "suffix", log, sampled=True, env={SYNC_LOG_ENV: str(syncs)})
    return {**run, "syncs": [json.loads(line) for line in syncs.read_text().splitlines()]}


@pytest.fixture(scope="module")
def hybrid_suffix_run(hybrid_models, tmp_path_factory):
    target, draft = hybrid_models
    log = tmp_path_factory.mktemp("hybrid_suffix_rounds") / "rounds.jsonl"
    return _suffix_run(target, draft, "auto", log, env=HYBRID_ENV, **HYBRID)


def test_suffix_proposals_keep_greedy_outputs_plain_decodings(random_models, suffix_run):
    target, _ = random_models
    _check_suffix_greedy(target, suffix_run)


def test_no_round_reads_the_device_from_the_host_unless_a_row_needs_it(suffix_run):
    """Suffix proposals (greedy and sampled rows, proposers=suffix) and the round's accounting without a single
    device->host read in dspine's code during a forward (counted through ``rounds.SyncCounter``): under overlap
    scheduling such a read would wait for the round just launched. (Rows with penalties need one:
    test_sglang_requests.py.)"""
    decode = [r for r in suffix_run["syncs"] if r["mode"] == "decode"]
    assert len(decode) >= 20 and all(r["needs"] == 0 for r in decode)
    assert [r for r in suffix_run["syncs"] if r["syncs"]] == []


def test_sampled_suffix_proposals_keep_the_target_distribution(random_models, suffix_run):
    """The second token of sampled siblings: rows whose first token an earlier sibling wrote verify that
    sibling's second token as a point-mass proposal (the other slots keep the draft's walk and its q)."""

    target, _ = random_models
    stats = _by_source(suffix_run["sampled_rounds"])
    assert stats["suffix"]["rounds"] >= 20, stats
    expected = _second_token_distribution(target, PROMPTS[0]) * SUFFIX_SAMPLED_N
    counts = torch.zeros_like(expected)
    for o in suffix_run["sampled"]:
        counts[o["output_ids"][1]] += 1
    _assert_chi2_fits(counts, expected)


def test_hybrid_suffix_proposals_commit_through_replayssm(hybrid_models, hybrid_suffix_run):
    """proposers=auto on the GDN hybrid: accepted prefixes of suffix proposals commit through ReplaySSM exactly
    as the draft's do (outputs are plain decoding's)."""
    target, _ = hybrid_models
    _check_suffix_greedy(target, hybrid_suffix_run)


def test_a_hybrid_target_without_replayssm_is_refused_on_the_cpu_once_its_pools_exist(hybrid_models, capfd):
    """The check needs the target's Mamba pool, which SGLang builds after the speculative worker: it runs in
    ``init_attention_backends`` (it ran in the worker's constructor, saw no pool and passed)."""
    if on_gpu():
        pytest.skip("a GPU verifies hybrid targets through the recurrent path as well")
    from dspine_batch.engines.sglang.processes import on_sigquit

    target, draft = hybrid_models
    with pytest.raises(Exception):  # noqa: B017 - SGLang reports a dead scheduler as its own error
        run_engine(target, lambda engine: None, draft=draft, env=HYBRID_ENV, mamba_ssm_dtype="float32",
                   max_mamba_cache_size=16, custom_sigquit_handler=on_sigquit, **CPU_HYBRID)
    assert "on the CPU needs --enable-linear-replayssm-spec" in "".join(capfd.readouterr())
