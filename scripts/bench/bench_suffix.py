"""Suffix proposals beside the DSpine draft on batch workloads, side by side with plain decoding in one run.

Workloads (the reference engine on the embedded SmolLM2 pair, chat template, one engine load):
  edit     examples/edit_prompts.jsonl: answers that quote their input (docstrings, grammar, JSON -> YAML), greedy
  mixed    examples/prompts.jsonl: chat, code and math, greedy
  samples  the first prompts of examples/prompts.jsonl, 4 samples each at T = 0.8 (``--num-samples 4``)
Each (workload, concurrency) runs every variant back to back, interleaved over ``--repeats``: ``none`` (``--draft
none``: plain decoding, the baseline), ``auto`` (the default: draft and suffix per row and round), and optionally
``dspine`` / ``suffix`` alone. Reported per run: wall seconds, generated tokens, tok/s, the ratio to ``none``,
whether greedy outputs equal ``none``'s, tau and accepted tokens by source, µs per suffix proposal, and the
suffix index's size. The CPU model and load average are printed first. Cost models are calibrated before timing.

    python scripts/bench/bench_suffix.py                           # everything (~15 min on 2 cores)
    python scripts/bench/bench_suffix.py --workloads edit --concurrency 1 --variants none auto suffix
    python scripts/bench/bench_suffix.py --json out/bench_suffix.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def cpu_line() -> str:
    name = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    flags = Path("/proc/cpuinfo").read_text()
    isa = "amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "?"
    return f"{name} ({isa}), {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"


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
    t0 = time.perf_counter()
    results = list(engine.run(iter(reqs), concurrency))
    wall = time.perf_counter() - t0
    toks = sum(r.completion_tokens for r in results)
    src = {}
    for name in ("dspine", "suffix"):
        steps = sum(getattr(r, f"{name}_verify_steps") or 0 for r in results)
        acc = sum(getattr(r, f"{name}_tokens_accepted") or 0 for r in results)
        prop = sum(getattr(r, f"{name}_tokens_proposed") or 0 for r in results)
        src[name] = {"steps": steps, "proposed": prop, "accepted": acc,
                     "tau": round((acc + steps) / steps, 3) if steps else None}
    return {"variant": variant, "wall_s": round(wall, 2), "tokens": toks, "tok_s": round(toks / wall, 2),
            "outputs": {(r.row_id, r.sample_index): r.token_ids for r in results}, "by_source": src,
            **timer.take()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["edit", "mixed", "samples"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--variants", nargs="+", default=["none", "auto"], help="none auto dspine suffix")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--limit", type=int, default=None, help="rows per workload (default: all)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: the engine's, auto)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from dspine_batch.engines.reference import ReferenceEngine

    print(f"cpu: {cpu_line()}", flush=True)
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
    report = {"cpu": cpu_line(), "runs": []}
    for name in args.workloads:
        rows, samples, temp = work[name]
        reqs = requests(tok, rows, samples, temp, args.max_new_tokens)
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {v: [] for v in args.variants}
            for _ in range(args.repeats):
                for v in args.variants:
                    runs[v].append(run_once(engine, v, reqs, c, timer))
            base = min(runs["none"], key=lambda r: r["wall_s"]) if "none" in runs else None
            for v, rs in runs.items():
                best = min(rs, key=lambda r: r["wall_s"])
                same = None if base is None or temp > 0 else best["outputs"] == base["outputs"]
                sampled_same = None if base is None or temp == 0 else best["outputs"] == base["outputs"]
                line = {k: best[k] for k in ("variant", "wall_s", "tokens", "tok_s", "by_source", "proposals",
                                             "us_per_proposal") if k in best}
                line.update(workload=name, concurrency=c, load=round(os.getloadavg()[0], 2),
                            vs_none=round(base["wall_s"] / best["wall_s"], 3) if base else None,
                            greedy_identical=same, sampled_identical=sampled_same, index=best.get("index"))
                report["runs"].append(line)
                bs = best["by_source"]
                print(f"{name:<8} c={c:<3} {v:<7} {best['wall_s']:7.1f} s {best['tokens']:6d} tok "
                      f"{best['tok_s']:7.1f} tok/s  x{line['vs_none'] or 0:.3f} vs none  "
                      f"identical={same if temp == 0 else sampled_same}  "
                      f"tau dspine {bs['dspine']['tau']} ({bs['dspine']['accepted']} acc) "
                      f"suffix {bs['suffix']['tau']} ({bs['suffix']['accepted']} acc)  "
                      f"{best.get('us_per_proposal')} us/proposal  load {line['load']}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
