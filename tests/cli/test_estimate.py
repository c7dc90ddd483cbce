"""``dspine-batch estimate`` (issue 54): a sample of the job's own rows, run for real into a scratch folder, gives
the whole job's tokens with an interval that holds the full run's, for one machine and for N shards; the job's
OUTDIR is never created. The scripted engine generates (deterministic tokens a row); how well the time's interval
holds on the embedded model is BENCHMARKS.md's ("How good is `estimate`?"), not a test's (no timed assertions)."""

from __future__ import annotations

import json

from helpers import prompts, run_cli, write_jsonl

from dspine_batch.ops.report import summarize


def test_estimate_holds_the_full_runs_tokens_and_leaves_no_trace(tmp_path, capfd):
    rows = [dict(r, max_new_tokens=8 + (i * 7) % 40) for i, r in enumerate(prompts(1200))]  # rows differ in length
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["estimate", str(src), "-o", str(out), "--shards", "4", "--price-per-hour", "2", "--json"]) == 0
    est = json.loads(capfd.readouterr().out)
    assert not out.exists()  # the sample ran in a scratch folder, removed
    assert est["input_rows"] == 1200 and 40 <= est["sample_rows"] <= 100  # default: 1% but at least 64 (~, by hash)
    assert [p["shards"] for p in est["plans"]] == [1, 4]
    one, four = est["plans"]
    assert four["seconds_per_shard"]["mean"] < one["seconds_per_shard"]["mean"]
    assert one["cost"]["low"] <= one["cost"]["mean"] <= one["cost"]["high"]
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    full = summarize(str(out))
    g, p = est["generated_tokens"], est["prompt_tokens"]
    assert g["low"] <= full["completion_tokens"] <= g["high"] and g["low"] < g["high"]
    assert p["low"] <= full["prompt_tokens"] <= p["high"]


def test_estimate_of_a_job_of_stages_is_refused_in_one_line(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    job = tmp_path / "job.toml"
    job.write_text('[[stages]]\nname = "a"\n\n[[stages]]\nname = "b"\ntemplate = "Again: {{ a.output }}"\n')
    assert run_cli(["estimate", str(src), "--config", str(job), "-o", str(tmp_path / "o")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dspine-batch: error: estimate: not for a job of [[stages]]")
    assert not (tmp_path / "o").exists()


def test_a_sample_whose_rows_reach_their_cap_does_not_trust_its_narrow_spread():
    """Rows cut at their token cap make a sample's spread small (its few short rows are what a small sample misses):
    the benchmark's sampled job, 29 of 31 sampled rows at the cap, put the full run outside a +/-1.4 % interval. With
    the cap known the spread is at least the Bhatia-Davis bound, (cap - mean) x mean; without one it is the
    sample's own."""
    import math

    from dspine_batch.run.estimate import _total

    sample = [128.0] * 29 + [100.0, 90.0]
    free, capped = _total(sample, 96), _total(sample, 96, cap=128.0)
    assert free["mean"] == capped["mean"]
    mean = sum(sample) / len(sample)
    half = 1.96 * math.sqrt((128 - mean) * mean) / math.sqrt(31) * math.sqrt(65 / 95) * 96
    assert capped["high"] - capped["mean"] >= round(half) - 1 > 1.5 * (free["high"] - free["mean"])
    assert _total([128.0] * 31, 96, cap=128.0)["low"] == 96 * 128  # every row at the cap: nothing to widen
