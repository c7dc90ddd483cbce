"""What ``auto`` runs beside plain decoding on rows that hardly propose: call counts (and, for what they are worth
on a shared machine, seconds) of a round's pieces under cProfile, ``--draft none`` against the defaults, on the
reference engine with the embedded pair (issue 44, item 1).

Per cell (workload x concurrency): one warm-up of each variant, then none, auto, auto, none under cProfile; for
the second run of each it prints the calls and cumulative seconds of the forward, the sampling head, the suffix
lookups and feeding, the plan and the price updates, the forwards' shapes (ids, packed or not, speculative,
taps, KV capacity) and the suffix lookups skipped by ``SuffixSource.could_match`` (when the tree has it).
Counts are the figure to read: they do not depend on the machine's load.

    python scripts/bench/profile_auto.py --workloads samples mixed --concurrency 8 32 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_suffix import load_rows, requests  # noqa: E402
from machine import cpu_line, fresh_job, load_line  # noqa: E402

KEYS = ("forward", "logits", "sample_first", "target_probs", "sample_from", "keyed_uniforms", "suggest", "extend",
        "could_match", "plan_packed", "point_proposals", "suffix_survival", "feed_suffix", "_feed", "hold",
        "catch_up", "extend_context", "mixed_round", "plain_round", "_quiet_round", "observe", "prefill", "propose",
        "record", "verify_slots")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["samples", "mixed"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=None, help="prompts of examples/prompts.jsonl (default: all; "
                    "samples: 8)")
    args = ap.parse_args()

    from dspine.decoding import suffix
    from dspine_batch.engines.reference import ReferenceEngine

    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    eng = ReferenceEngine.load("embedded", "embedded", {})
    T = type(eng.target)
    forward = T.forward
    shapes: collections.Counter = collections.Counter()
    skipped = [0]

    def counted(self, ids, cache, n_valid=None, speculative=False, taps=()):
        shapes[(tuple(ids.shape), n_valid is None, speculative, bool(taps), cache.layers[0].k.shape[2])] += 1
        return forward(self, ids, cache, n_valid, speculative, taps)

    T.forward = counted
    could = getattr(suffix.SuffixSource, "could_match", None)
    if could is not None:
        def could_match(src, key):
            ok = could(src, key)
            skipped[0] += not ok
            return ok

        suffix.SuffixSource.could_match = could_match
    work = {"mixed": (load_rows(REPO / "examples" / "prompts.jsonl", args.limit), 1, 0.0),
            "samples": (load_rows(REPO / "examples" / "prompts.jsonl", args.limit or 8), 4, 0.8)}

    def run(variant: str, c: int, prof: bool, reqs) -> tuple:
        eng.proposers = None if variant == "none" else variant
        eng.batch_size = c
        eng._cost(c)
        fresh_job(eng)  # as a fresh job's generation starts (``machine.fresh_job``)
        shapes.clear()
        skipped[0] = 0
        pr = cProfile.Profile() if prof else None
        t0 = time.perf_counter()
        if pr:
            pr.enable()
        res = list(eng.run(iter(reqs), c))
        if pr:
            pr.disable()
        wall = time.perf_counter() - t0
        return ({(r.row_id, r.sample_index): r.token_ids for r in res}, wall, pstats.Stats(pr) if pr else None,
                dict(shapes), skipped[0])

    for name in args.workloads:
        rows, samples, temp = work[name]
        reqs = requests(eng.tokenizer, rows, samples, temp, args.max_new_tokens)
        for c in args.concurrency:
            for v in ("none", "auto"):
                run(v, c, False, reqs)
            res: dict[str, list] = {}
            for v in ("none", "auto", "auto", "none"):
                res.setdefault(v, []).append(run(v, c, True, reqs))
            same = all(r[0] == res["none"][0][0] for rs in res.values() for r in rs)
            print(f"== {name} c={c} identical={same} {load_line()}", flush=True)
            for v in ("none", "auto"):
                out, wall, st, shp, skip = res[v][1]
                print(f"-- {v}: wall {[round(r[1], 2) for r in res[v]]} s; lookups skipped by could_match: {skip}")
                agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
                for (fn, _, fname), (_, nc, _, ct, _) in st.stats.items():
                    if fname in KEYS:
                        key = f"{os.path.basename(fn)}:{fname}"
                        agg[key][0] += nc
                        agg[key][1] += ct
                for k in sorted(agg):
                    n, ct = agg[k]
                    print(f"   {k:<36} calls {n:7d}  cum {ct:7.3f} s  {1e3 * ct / max(n, 1):8.3f} ms/call")
                top = sorted(shp.items(), key=lambda kv: -kv[1])[:6]
                print("   forwards (ids, unpacked, speculative, taps, KV capacity): count", top, flush=True)


if __name__ == "__main__":
    main()
