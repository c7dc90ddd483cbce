"""Speculation against plain decoding on batch workloads, side by side in one run, in an order that cannot flatter.

Workloads (the reference engine on the embedded SmolLM2 pair, chat template, one engine load):
  edit     examples/edit_prompts.jsonl: answers that quote their input (docstrings, grammar, JSON -> YAML), greedy
  mixed    examples/prompts.jsonl: chat, code and math, greedy
  samples  the first prompts of examples/prompts.jsonl, 4 samples each at T = 0.8 (``--num-samples 4``)
Each run starts as a fresh job's generation does (``machine.fresh_job``: prefix cache empty, draft not loaded yet).
Each (workload, concurrency) cell runs every variant ``--repeats`` times, the variants' order alternating from one
repeat to the next (none, auto, then auto, none, ...), so a load that rises or falls during a cell lands on both:
``none`` (``--draft none``: plain decoding, the baseline), ``auto`` (the default: draft and suffix per row and
round, priced live), and optionally ``dspine`` / ``suffix`` alone. Reported per variant: min and median wall
seconds, tok/s at the median, the ratio to ``none`` (median over median, and the per-repeat pair ratios' median),
the same ratio in process CPU seconds (with ``--threads 1`` the figure that
holds on a shared machine: another process's load stretches wall time, not this one's CPU time), whether greedy
outputs equal ``none``'s, tau and accepted tokens by source, µs per suffix proposal, the suffix
index's size. The CPU model and the load average are printed first and per cell. Cost models are calibrated
before timing. ``--overhead`` also times what the live pricing adds to a round (observe + price lookups) next to
the plain round it rides on.

    python scripts/bench/bench_suffix.py --repeats 3                        # the table (c = 1 8 32 64)
    python scripts/bench/bench_suffix.py --workloads edit --concurrency 1 --variants none auto suffix
    python scripts/bench/bench_suffix.py --json out/bench_suffix.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from machine import cpu_line, fresh_job, load_line, write_json  # noqa: E402


def load_rows(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def requests(tok, rows: list[dict], samples: int, temperature: float, max_new: int):
    from dspine_batch.engines.base import Request, SamplingParams, derive_seed

    out = []
    for r in rows:
        ids = tok.render_chat([{"role": "user", "content": r["prompt"]}])
        for k in range(samples):
            sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=derive_seed(0, r["id"], k),
                                stop_token_ids=tuple(tok.eos_ids()))
            out.append(Request(r["id"], k, ids, sp))
    return out


class SuffixTimer:
    """Counts and times every suffix proposal and keeps the stream's source (for its memory)."""

    def __init__(self):
        from dspine.decoding import suffix

        self.mod, self.calls, self.seconds, self.sources = suffix, 0, 0.0, []
        self.orig_suggest, self.orig_init = suffix.SuffixSource.suggest, suffix.SuffixSource.__init__
        timer = self

        def suggest(src, key, max_len=None):
            t0 = time.perf_counter()
            try:
                return timer.orig_suggest(src, key, max_len)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer.calls += 1

        def init(src, *a, **kw):
            timer.orig_init(src, *a, **kw)
            timer.sources.append(src)

        suffix.SuffixSource.suggest, suffix.SuffixSource.__init__ = suggest, init

    def take(self) -> dict:
        out = {"proposals": self.calls, "us_per_proposal": round(1e6 * self.seconds / self.calls, 1) if self.calls
               else None}
        if self.sources:
            out["index"] = self.sources[-1].memory()
        self.calls, self.seconds, self.sources = 0, 0.0, []
        return out


def run_once(engine, variant: str, reqs, concurrency: int, timer: SuffixTimer) -> dict:
    engine.proposers = None if variant == "none" else variant
    engine.batch_size = concurrency
    engine._cost(concurrency)  # calibrated (or read from the cache) outside the timing
    fresh_job(engine)  # as a fresh job's generation starts (``machine.fresh_job``)
    t0, c0 = time.perf_counter(), time.process_time()
    results = list(engine.run(iter(reqs), concurrency))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    toks = sum(r.completion_tokens for r in results)
    src = {}
    for name in ("dspine", "suffix"):
        steps = sum(getattr(r, f"{name}_verify_steps") or 0 for r in results)
        acc = sum(getattr(r, f"{name}_tokens_accepted") or 0 for r in results)
        prop = sum(getattr(r, f"{name}_tokens_proposed") or 0 for r in results)
        src[name] = {"steps": steps, "proposed": prop, "accepted": acc,
                     "tau": round((acc + steps) / steps, 3) if steps else None}
    return {"variant": variant, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "tokens": toks,
            "tok_s": round(toks / wall, 2),
            "outputs": {(r.row_id, r.sample_index): r.token_ids for r in results}, "by_source": src,
            "load": round(os.getloadavg()[0], 2), **timer.take()}


def overhead_us(engine, concurrency: int, rounds: int = 2000) -> dict:
    """What live pricing adds to a round: a ``Stopwatch``, ``observe`` and the price lookups a plan makes, timed
    alone (µs per round), beside the plain round they ride on as priced by the cost model at this concurrency."""
    import torch

    from dspine.decoding.prices import LivePrices, Stopwatch

    cost = engine._cost(concurrency)
    prices = LivePrices(cost, packed=True)
    ks = torch.arange(1, 4 * concurrency + 1)
    t0 = time.perf_counter()
    for i in range(rounds):
        watch = Stopwatch()
        prices.round_s(concurrency, 0)
        prices.round_many(concurrency, ks)
        prices.plain_due(concurrency)
        prices.explore_due(concurrency)
        prices.observe(concurrency, (i % 3) * 2, cost.target_s(concurrency, 1) * (1 + 0.1 * (i % 3)), 0, 0.0)
        watch.elapsed()
    us = 1e6 * (time.perf_counter() - t0) / rounds
    step_ms = 1e3 * cost.target_s(concurrency, 1)
    return {"concurrency": concurrency, "pricing_us_per_round": round(us, 1), "plain_step_ms": round(step_ms, 2),
            "share_of_step": round(us / (1e3 * step_ms), 5)}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["edit", "mixed", "samples"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--variants", nargs="+", default=["none", "auto"], help="none auto dspine suffix")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--limit", type=int, default=None, help="rows per workload (default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: the engine's, auto)")
    ap.add_argument("--overhead", action="store_true", help="also time the live pricing per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from dspine_batch.engines.reference import ReferenceEngine

    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    opts = {} if args.threads is None else {"threads": str(args.threads)}
    if args.dtype:
        opts["dtype"] = args.dtype
    engine = ReferenceEngine.load("embedded", "embedded", opts)
    print(f"engine: dtype {engine.identity()['dtype']}, kernel {engine.target.kernel}", flush=True)
    timer = SuffixTimer()
    tok = engine.tokenizer
    work = {
        "edit": (load_rows(REPO / "examples" / "edit_prompts.jsonl", args.limit), 1, 0.0),
        "mixed": (load_rows(REPO / "examples" / "prompts.jsonl", args.limit), 1, 0.0),
        "samples": (load_rows(REPO / "examples" / "prompts.jsonl", args.limit or 8), 4, 0.8),
    }
    report = {"cpu": cpu_line(), "runs": [], "overhead": []}
    if args.overhead:
        for c in args.concurrency:
            o = overhead_us(engine, c)
            report["overhead"].append(o)
            print(f"pricing c={c:<3} {o['pricing_us_per_round']:7.1f} us/round vs a plain step of "
                  f"{o['plain_step_ms']:.2f} ms (calibrated): {100 * o['share_of_step']:.3f} %", flush=True)
    for name in args.workloads:
        rows, samples, temp = work[name]
        reqs = requests(tok, rows, samples, temp, args.max_new_tokens)
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {v: [] for v in args.variants}
            for rep in range(args.repeats):
                order = args.variants if rep % 2 == 0 else list(reversed(args.variants))
                for v in order:
                    runs[v].append(run_once(engine, v, reqs, c, timer))
            base = runs.get("none")
            for v, rs in runs.items():
                walls = [r["wall_s"] for r in rs]
                med = _median(walls)
                first = rs[0]
                same = all(r["outputs"] == base[0]["outputs"] for r in rs) if base else None
                pair = [b["wall_s"] / r["wall_s"] for b, r in zip(base, rs)] if base else []
                cpus = [r["cpu_s"] for r in rs]
                line = {"variant": v, "workload": name, "concurrency": c, "min_s": min(walls), "median_s": med,
                        "walls": walls, "cpus": cpus,
                        "cpu_vs_none_median": round(_median([b["cpu_s"] for b in base]) / _median(cpus), 3)
                        if base else None, "tokens": first["tokens"], "tok_s_median": round(first["tokens"] / med, 2),
                        "vs_none_median": round(_median([b["wall_s"] for b in base]) / med, 3) if base else None,
                        "vs_none_pairs_median": round(_median(pair), 3) if pair else None,
                        "identical_to_none": same, "by_source": first["by_source"],
                        "loads": [r["load"] for r in rs], "us_per_proposal": first.get("us_per_proposal"),
                        "index": first.get("index")}
                report["runs"].append(line)
                bs = first["by_source"]
                print(f"{name:<8} c={c:<3} {v:<7} min {min(walls):6.2f} s  median {med:6.2f} s  "
                      f"{first['tokens']:6d} tok {line['tok_s_median']:7.1f} tok/s  "
                      f"x{line['vs_none_median'] or 0:.3f} vs none (pairs "
                      f"x{line['vs_none_pairs_median'] or 0:.3f}; cpu x{line['cpu_vs_none_median'] or 0:.3f})  "
                      f"identical={same}  "
                      f"tau dspine {bs['dspine']['tau']} ({bs['dspine']['accepted']} acc) "
                      f"suffix {bs['suffix']['tau']} ({bs['suffix']['accepted']} acc)  "
                      f"loads {line['loads']}", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
