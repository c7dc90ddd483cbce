"""What asking for logprobs (and penalties) costs the reference engine, side by side in one run.

The mixed workload of ``bench_suffix.py`` (examples/prompts.jsonl, greedy, the defaults: draft + suffix, live
prices) at each concurrency, with variants alternating from one repeat to the next:
  base        no request field (what every job without the new fields runs)
  top5        ``logprobs`` with ``top_logprobs 5`` on every row
  penalties   ``presence_penalty 0.3``, ``frequency_penalty 0.3``, ``repetition_penalty 1.1`` on every row
Reported: min and median wall seconds, tokens, the ratio to ``base`` (median over median; wall, and process CPU
seconds, the one that holds on a shared machine with ``--threads 1``); ``top5``'s tokens must
equal ``base``'s (logprobs change nothing else).

    python scripts/bench/bench_logprobs.py --repeats 3 --concurrency 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_suffix import load_rows, requests  # noqa: E402
from machine import cpu_line, load_line  # noqa: E402

VARIANTS = {"base": {}, "top5": {"logprobs": True, "top_logprobs": 5},
            "penalties": {"presence_penalty": 0.3, "frequency_penalty": 0.3, "repetition_penalty": 1.1}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None, help="the engine's threads (1: CPU seconds hold under load)")
    args = ap.parse_args()

    from dspine_batch.engines.reference import ReferenceEngine

    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    engine = ReferenceEngine.load("embedded", "embedded", {} if args.threads is None else
                                  {"threads": str(args.threads)})
    base = requests(engine.tokenizer, load_rows(REPO / "examples" / "prompts.jsonl", None), 1, 0.0,
                    args.max_new_tokens)
    work = {v: [replace(r, params=replace(r.params, **VARIANTS[v])) for r in base] for v in args.variants}
    for c in args.concurrency:
        engine.batch_size = c
        engine._cost(c)
        walls: dict[str, list[float]] = {v: [] for v in args.variants}
        cpus: dict[str, list[float]] = {v: [] for v in args.variants}
        outs: dict[str, dict] = {}
        for rep in range(args.repeats):
            for v in (args.variants if rep % 2 == 0 else list(reversed(args.variants))):
                t0, c0 = time.perf_counter(), time.process_time()
                res = list(engine.run(iter(work[v]), c))
                walls[v].append(time.perf_counter() - t0)
                cpus[v].append(time.process_time() - c0)
                outs[v] = {r.row_id: r.token_ids for r in res}
        med = {v: statistics.median(w) for v, w in walls.items()}
        cmed = {v: statistics.median(w) for v, w in cpus.items()}
        for v in args.variants:
            toks = sum(len(t) for t in outs[v].values())
            same = outs[v] == outs["base"] if "base" in outs else None
            print(f"c={c:<3} {v:<9} min {min(walls[v]):6.2f} s  median {med[v]:6.2f} s  {toks:5d} tok  "
                  f"x{med.get('base', med[v]) / med[v]:.3f} vs base (cpu {cmed[v]:.2f} s, "
                  f"x{cmed.get('base', cmed[v]) / cmed[v]:.3f})  same tokens as base: {same}  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
