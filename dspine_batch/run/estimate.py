"""``dspine-batch estimate``: what a job will take — generated tokens, time, machine-hours and cost, with an interval —
from a small sample of its own rows, run for real (its settings, its engine, this machine) into a scratch folder.

The sample is the rows whose id hash is 0 modulo K (the way ``--shard 0/K`` picks a shard's rows: spread evenly
over the input, whatever its order), K chosen for ``--sample-rows`` rows (default: 1 % of the input, at least 64).
From it: the mean and spread of the tokens a row generates (and reads), the rate at which the engine generates once
warm (generated tokens over the time between the sample's first and last-but-one commits: it commits in ~``PARTS``
parts), and the fixed cost every shard pays once (Python, the checks, the model's load and warm-up, the tail's
part-full batches: what the sample took beyond that rate). The whole job's tokens are
the mean times its rows, with a 95 % interval from the sample's spread (normal approximation, finite-population
corrected); its time is those tokens at the sample's rate, the interval widened by ``RATE_MARGIN`` for the rate
itself (a sample's batches are as full as a job's only when it has enough rows; BENCHMARKS.md measures how well the
interval holds). For N shards each shard runs 1/N of the rows and pays the start-up once.

The scratch folder is removed at the end; the job's own OUTDIR is never created or touched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from dspine_batch.config import GenerateConfig
from dspine_batch.errors import EXIT_OK, UsageError
from dspine_batch.inputs.sources import resolve_inputs
from dspine_batch.inputs.totals import count_rows
from dspine_batch.log import log
from dspine_batch.ops.cost import job_cost
from dspine_batch.outdir.output import arrow_path, committed_parts
from dspine_batch.run.progress import format_seconds
from dspine_batch.run.runner import run_job
from dspine_batch.run.state import since_start

Z95 = 1.96
RATE_MARGIN = 0.15  # the sample's tokens per second, +/- this share, for the time's interval
PARTS = 8  # the sample commits in about this many parts: its timeline (``timeline``)


def sample_size(total: int, asked: int | None) -> int:
    return min(total, asked or max(64, math.ceil(total / 100)))


def estimate_job(cfg: GenerateConfig, raw_stages: Any, sample_rows: int | None, shards: int) -> dict[str, Any]:
    """Run the sample into a scratch folder and extrapolate to the whole input (and ``shards`` shards)."""
    if raw_stages is not None:
        raise UsageError("estimate: not for a job of [[stages]] yet (estimate each stage as a job of its own)")
    files = resolve_inputs([os.path.abspath(p) if "://" not in p else p for p in cfg.inputs], cfg.split)
    total = count_rows(files, cfg.limit)
    if not total:
        raise UsageError("estimate: the inputs have no rows (or cannot be counted)")
    n = sample_size(total, sample_rows)
    k = max(1, total // n)
    scratch = tempfile.mkdtemp(prefix="dspine-batch-estimate-")
    try:
        sample = replace(cfg, output=scratch, shard=f"0/{k}" if k > 1 else "0/1", metrics_push=None,
                         metrics_textfile=None, resume=True, overwrite=False, retry_errors=False,
                         retry_length=False, price_per_hour=None, commit_rows=max(2, n // PARTS))
        log(f"estimate: running a sample of ~{n:,} of the {total:,} input rows (those whose id hash is 0 modulo {k}) "
            f"into a scratch folder, with the job's settings")
        started = time.time() - since_start()  # a job's process starts Python first: its shards pay that too
        rc = run_job(sample)
        if rc != EXIT_OK:
            raise UsageError(f"estimate: the sample run ended with exit {rc}; see its lines above")
        return extrapolate(scratch, total, started, time.time(), shards, cfg.price_per_hour)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def extrapolate(outdir: str, total: int, started: float, ended: float, shards: int,
                price: float | None) -> dict[str, Any]:
    """The whole job's figures from a finished sample in ``outdir`` (``started``/``ended``: the Unix times of its
    process's start and of the sample's end)."""
    parts = committed_parts(outdir)
    if not parts:
        raise UsageError("estimate: the sample committed no rows (too few input rows for --sample-rows?)")
    t = ds.dataset([p.path for p in parts], format="parquet").to_table(
        columns=["row_id", "status", "prompt_tokens", "completion_tokens", "finish_reason"])
    ok = t.filter(pc.equal(t.column("status"), "ok"))
    cut = ok.filter(pc.equal(ok.column("finish_reason"), "length"))  # samples that ran to their token cap
    per_row = ok.group_by("row_id").aggregate([("completion_tokens", "sum"), ("prompt_tokens", "sum")])
    n = len(set(t.column("row_id").to_pylist()))
    gen = [x or 0 for x in per_row.column("completion_tokens_sum").to_pylist()] + [0] * (n - per_row.num_rows)
    read = [x or 0 for x in per_row.column("prompt_tokens_sum").to_pylist()] + [0] * (n - per_row.num_rows)
    fixed, rate = timeline(parts, started, ended)
    wall_s = ended - started
    # a row's tokens are bounded by its cap (max tokens x samples); when rows reach it, the sample's spread is
    # capped too and understates the job's (its few short rows are what a small sample misses): the spread is then
    # taken as at least the largest a bounded value with this mean can have (Bhatia-Davis: (cap - mean) x mean)
    # (the cap: the most any sampled row generated, when some of its samples were cut by length)
    tokens = _total(gen, total, per_row_max(per_row) if cut.num_rows else None)
    prompt = _total(read, total)
    errors = n - per_row.num_rows  # rows with no ok sample

    def seconds(tok: float, margin: float) -> float | None:
        return None if rate is None else tok / (rate * (1 + margin))

    work = [seconds(tokens["low"], RATE_MARGIN), seconds(tokens["mean"], 0.0), seconds(tokens["high"], -RATE_MARGIN)]
    plans = []
    for k in sorted({1, shards}):
        each = [None if w is None else fixed + w / k for w in work]
        cost = [None if e is None else job_cost([{"elapsed_s": e * k, "price_per_hour": price}]) for e in each]
        plans.append({"shards": k, "seconds_per_shard": _interval(each),
                      "machine_hours": _interval([None if e is None else e * k / 3600 for e in each]),
                      "cost": _interval([c["cost"] if c and c["cost"] is not None else None for c in cost])
                      if price is not None else None})
    return {"input_rows": total, "sample_rows": n, "sample_error_rows": errors, "sample_seconds": round(wall_s, 3),
            "fixed_seconds_per_shard": round(fixed, 3), "generated_tokens_per_second": _r(rate),
            "generated_tokens": tokens, "prompt_tokens": prompt, "price_per_hour": price, "plans": plans,
            "cost_per_million_tokens": _r(price / 3600 / rate * 1e6) if price is not None and rate else None,
            "confidence": 0.95}


def timeline(parts: list[Any], started: float, ended: float) -> tuple[float, float | None]:
    """(seconds every shard pays once, generated tokens per second) from the sample's commits: the rate between its
    first part and its last but one (the engine warm, its batches full), and the fixed cost what the whole sample
    took beyond that rate (Python, the checks, the model's load and warm-up, and the tail's part-full batches:
    a shard has each once, whatever its rows)."""
    points = []
    for p in parts:
        src = arrow_path(p.path)
        table = pq.read_table(**src, columns=["completion_tokens"])
        info = json.loads((table.schema.metadata or {}).get(b"dspine_batch.part", b"{}"))
        tok = pc.sum(table.column(0)).as_py() or 0
        points.append((float(info.get("committed_at") or ended), tok))
    points.sort()
    body = points[:-1] if len(points) >= 3 else points  # the last part is the tail: batches no longer full
    between = sum(tok for _, tok in body[1:])
    everything = sum(tok for _, tok in points)
    if len(body) > 1 and body[-1][0] > body[0][0] and between:
        rate = between / (body[-1][0] - body[0][0])
    else:  # one or two parts: the whole sample at one rate, from the process's start
        rate = everything / (ended - started) if everything and ended > started else None
    return max(ended - started - (everything / rate if rate else 0.0), 0.0), rate


def per_row_max(per_row: Any) -> float:
    """The most generated tokens any sampled row has (all its samples)."""
    return max(x or 0 for x in per_row.column("completion_tokens_sum").to_pylist()) if per_row.num_rows else 0.0


def _total(per_row: list[float], total: int, cap: float | None = None) -> dict[str, float]:
    """The whole input's sum from a sample's values: mean x rows, with a 95 % interval (finite-population
    corrected: a sample of every row has none). ``cap``: the values are bounded by it and some sampled rows reached
    it; the spread used is then at least the Bhatia-Davis bound for that cap and the sample's mean."""
    n = len(per_row)
    mean = sum(per_row) / n if n else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_row) / (n - 1)) if n > 1 else 0.0
    if cap is not None and 0.0 < mean < cap:
        sd = max(sd, math.sqrt((cap - mean) * mean))
    half = Z95 * sd / math.sqrt(n) * math.sqrt(max(total - n, 0) / max(total - 1, 1)) * total if n else 0.0
    return {"mean": round(mean * total), "low": max(round(mean * total - half), 0), "high": round(mean * total + half),
            "per_row": _r(mean)}


def _interval(values: list[float | None]) -> dict[str, float] | None:
    if any(v is None for v in values):
        return None
    low, mean, high = values
    return {"mean": _r(mean), "low": _r(low), "high": _r(high)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def format_estimate(e: dict[str, Any]) -> str:
    g, p = e["generated_tokens"], e["prompt_tokens"]
    lines = [f"estimate from {e['sample_rows']:,} of {e['input_rows']:,} rows (run in {e['sample_seconds']:.1f}s, "
             f"{e['fixed_seconds_per_shard']:.1f}s of it what a shard pays once: start-up, load, warm-up, tail), 95% "
             "intervals:",
             f"  generated tokens  {g['mean']:,} ({g['low']:,} .. {g['high']:,}); {g['per_row']:,.1f} a row",
             f"  prompt tokens     {p['mean']:,} ({p['low']:,} .. {p['high']:,})",
             f"  rate              {e['generated_tokens_per_second'] or 0:,.1f} generated tokens/s on this machine"]
    for plan in e["plans"]:
        s = plan["seconds_per_shard"]
        if s is None:
            continue
        m = plan["machine_hours"]
        cost = plan["cost"]
        money = f"; cost {cost['mean']:,.4g} ({cost['low']:,.4g} .. {cost['high']:,.4g})" if cost else ""
        each = f"{format_seconds(s['mean'])} each ({format_seconds(s['low'])} .. {format_seconds(s['high'])})"
        lines.append(f"  {plan['shards']} shard(s){' ' * max(1, 8 - len(str(plan['shards'])))}{each}; "
                     f"{m['mean']:.4g} machine-hours{money}")
    if e.get("cost_per_million_tokens") is not None:
        lines.append(f"  cost per million generated tokens {e['cost_per_million_tokens']:,.4g} (start-up excluded)")
    if e["sample_error_rows"]:
        lines.append(f"  note: {e['sample_error_rows']:,} of the sample's rows were errors (their tokens count as 0)")
    return "\n".join(lines)
