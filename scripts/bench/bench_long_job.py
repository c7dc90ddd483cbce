#!/usr/bin/env python
"""A prompt-heavy job end to end (issue 26): ``dspine-batch generate`` on unique ~1,400-token prompts, few new tokens.

Writes ``--rows`` unique chat prompts (a user asks for a summary of a ~1,400-token report; no two share more
than the chat template's few tokens, so the prefix cache cannot help) to a JSONL file, then runs the CLI on it
once per configuration, each in its own child process, interleaved over ``--repeats``: wall seconds (model
load included) and the child's peak RSS (``wait4``). Configurations are ``NAME=ENGINE_ARGS`` (comma-separated
``key=value`` passed as ``--engine-arg``), optionally ``@CHECKOUT`` to run another checkout's code (a git
worktree of an older commit: the "before"). The CPU, the load before and after, and the resolved dtype/kernel
each run recorded (from its manifest) are printed with the numbers.

    python scripts/bench/bench_long_job.py                                 # default vs dtype=float32
    git worktree add /tmp/before b9eba4f
    python scripts/bench/bench_long_job.py --config before=@/tmp/before default= fp32=dtype=float32
    python scripts/bench/bench_long_job.py --rows 24 --max-new-tokens 16 --json out/long_job.json

Any input and CLI options work too, e.g. decode speed at 8 rows a batch, before and after, on the examples:

    python scripts/bench/bench_long_job.py --input examples/prompts.jsonl --max-new-tokens 128 \
        --cli-args "--draft none" --config before=batch_size=8@/tmp/before after=batch_size=8

Besides wall time (model load included) each run reports the job's own rate from the checkout's ``report``
(``_report.json``: generated tokens over the job's elapsed seconds, prompt reading included, model load not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_line, load_line

REPO = Path(__file__).resolve().parents[2]
TOPICS = ["rivers", "bridges", "libraries", "volcanoes", "orchards", "lighthouses", "railways", "glaciers"]


def report_text(k: int, words: int) -> str:
    """Report ``k``: about ``words`` words of numbered paragraphs, its own numbers and district from the first
    sentence on (so two reports share nothing but the instruction)."""
    parts, i = [], 0
    while sum(len(p.split()) for p in parts) < words:
        t = TOPICS[(i + k) % len(TOPICS)]
        parts.append(f"Report {k}, paragraph {i + 1}: the survey of {t} in district {k * 7 + i} recorded "
                     f"{(k + 3) * (i + 5)} observations, {i % 4 + 1} of them unusual, and the team noted that the "
                     f"{t} changed most after the {['spring', 'summer', 'autumn', 'winter'][i % 4]} storms.")
        i += 1
    return " ".join(parts)


def write_prompts(path: Path, rows: int, words: int) -> None:
    with path.open("w") as f:
        for k in range(rows):
            f.write(json.dumps({"id": f"report-{k:03d}", "prompt": report_text(k, words) +
                                "\n\nSummarise this report in three sentences."}) + "\n")


def run(name: str, args: str, checkout: Path, inp: Path, out: Path, max_new: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", str(inp), "-o", str(out), "--overwrite",
           "--progress", "none", "--max-new-tokens", str(max_new), *extra]
    for kv in filter(None, args.split(",")):
        cmd += ["--engine-arg", kv]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"{name}: exit {status >> 8}: {err[-2000:]}")
    eng = json.loads((out / "_manifest.json").read_text()).get("fingerprint_fields", {}).get("engine", {})
    # the checkout's own `report` (untimed) writes _report.json: generated tokens over the job's elapsed seconds
    subprocess.run([sys.executable, "-m", "dspine_batch.cli", "report", str(out)], cwd=checkout, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    report = json.loads((out / "_report.json").read_text()) if (out / "_report.json").exists() else {}
    return {"config": name, "wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024),
            "gen_tok_s": report.get("tokens_per_s"), "tokens": report.get("completion_tokens"),
            "dtype": eng.get("dtype"), "kernel": eng.get("kernel", "torch"), "load": load_line()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", default=["default=", "fp32=dtype=float32"],
                    help="NAME=ENGINE_ARGS[@CHECKOUT], e.g. before=@/tmp/before or bf16=dtype=bfloat16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--words", type=int, default=920, help="about this many words per report (~1,400 tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--input", type=Path, help="run on this input file instead of the generated long prompts")
    ap.add_argument("--cli-args", default="", help="more `dspine-batch generate` options, e.g. \"--draft none\"")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_long_job")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    configs = []
    for c in args.config:
        name, _, rest = c.partition("=")
        eargs, _, checkout = rest.partition("@")
        configs.append((name, eargs, Path(checkout).resolve() if checkout else REPO))
    args.out = args.out.resolve()  # the children run in their checkouts
    args.out.mkdir(parents=True, exist_ok=True)
    if args.input:
        inp = args.input.resolve()
        what = f"{inp.name}, {args.max_new_tokens} new tokens at most"
    else:
        inp = args.out / "long_prompts.jsonl"
        write_prompts(inp, args.rows, args.words)
        what = f"{args.rows} rows x ~{args.words} words, {args.max_new_tokens} new tokens"
    extra = args.cli_args.split()
    print(f"# {cpu_line()}; {what}; options {' '.join(extra) or '-'}; {load_line()}", flush=True)
    results = []
    for rep in range(args.repeats):  # interleaved: every configuration once per repeat
        for name, eargs, checkout in configs:
            r = run(name, eargs, checkout, inp, args.out / name, args.max_new_tokens, extra)
            r["repeat"] = rep
            results.append(r)
            print(f"{name:<10} wall {r['wall_s']:7.1f} s  gen {r['gen_tok_s'] or 0:7.1f} tok/s ({r['tokens']} tokens)  "
                  f"peak RSS {r['peak_rss_mb']:6d} MB  dtype {r['dtype']}  kernel {r['kernel']}  {r['load']}",
                  flush=True)
    best = {name: min((r for r in results if r["config"] == name), key=lambda r: r["wall_s"]) for name, *_ in configs}
    base = best[configs[0][0]]
    rate = {name: max(r["gen_tok_s"] or 0 for r in results if r["config"] == name) for name, *_ in configs}
    b0 = configs[0][0]
    print(f"\n| config | best wall | vs {b0} | best gen tok/s | vs {b0} | peak RSS | vs {b0} |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, r in best.items():
        gen = f"{rate[name]:.1f} | {rate[name] / rate[b0]:.2f}x" if rate[name] and rate[b0] else "- | -"
        print(f"| {name} | {r['wall_s']:.1f} s | {base['wall_s'] / r['wall_s']:.2f}x | {gen} | {r['peak_rss_mb']} MB | "
              f"{r['peak_rss_mb'] / base['peak_rss_mb']:.0%} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_line(), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
