"""How good is ``dspine-batch estimate``? Its figures against the full run's, on the embedded default (real model,
this CPU), for three shapes of job: short answers, long answers, and sampled answers with two samples a row.

  python scripts/bench/bench_estimate.py [--sample-rows 24] [--json FILE]

Each shape: ``estimate INPUT --json`` (a sample of --sample-rows rows run for real into a scratch folder), then
``generate INPUT`` in full (the wall time of its process, its generated tokens from ``report --json``); printed:
the estimate's interval for tokens and time and whether the run fell inside. The inputs are examples/prompts.jsonl
in a dozen settings ("For a bakery: <prompt>"), no two rows alike, to the shape's row count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_line, load_line, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHAPES = (  # name, rows, generate's options
    ("short answers", 160, ["--max-new-tokens", "32"]),
    ("long answers", 96, ["--max-new-tokens", "128"]),
    ("sampled, 2 a row", 96, ["--max-new-tokens", "64", "--temperature", "0.8", "--num-samples", "2"]),
)


TOPICS = ("a bakery", "a hospital", "a school", "a bike shop", "a library", "a farm", "a bank", "a theatre", "a port",
          "a museum", "a startup", "a hotel")


def prompt(base: list[dict], i: int) -> str:
    """Row i's prompt: one of the examples in one of the settings, each pair once (no two rows alike: repeated
    prompts would make the full run's prefix cache and suffix matches flatter it against its sample)."""
    return f"For {TOPICS[(i // len(base)) % len(TOPICS)]}: {base[i % len(base)]['prompt']}"


def cli(*args: str) -> tuple[str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "dspine_batch.cli", *args], capture_output=True, text=True,
                       env={**os.environ, "DSPINE_BATCH_PROGRESS": "none"}, cwd=ROOT)
    if p.returncode:
        sys.exit(f"dspine-batch {' '.join(args)}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return p.stdout, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sample-rows", type=int, default=24)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    base = [json.loads(line) for line in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines() if line]
    print(cpu_line())
    print(load_line())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, rows, opts in SHAPES:
            src = Path(tmp) / f"{rows}.jsonl"
            src.write_text("".join(json.dumps({"id": f"r{i:04d}", "prompt": prompt(base, i)}) + "\n"
                                   for i in range(rows)))
            out = Path(tmp) / name.replace(" ", "-").replace(",", "")
            est_text, est_wall = cli("estimate", str(src), "-o", str(out), "--sample-rows", str(a.sample_rows),
                                     "--json", *opts)
            est = json.loads(est_text)
            _, run_wall = cli("generate", str(src), "-o", str(out), *opts)
            rep = json.loads(cli("report", str(out), "--json")[0])
            g, s = est["generated_tokens"], est["plans"][0]["seconds_per_shard"]
            row = {"shape": name, "rows": rows, "options": " ".join(opts), "sample_rows": est["sample_rows"],
                   "estimate_wall_s": round(est_wall, 1),
                   "tokens": {"estimate": g, "run": rep["completion_tokens"],
                              "inside": g["low"] <= rep["completion_tokens"] <= g["high"]},
                   "seconds": {"estimate": s, "run": round(run_wall, 1), "inside": s["low"] <= run_wall <= s["high"]}}
            results.append(row)
            verdict = {k: "in" if row[k]["inside"] else "OUT" for k in ("tokens", "seconds")}
            print(f"{name:18} {rows:4} rows, sample {est['sample_rows']:3} ({est_wall:5.1f}s): tokens "
                  f"{g['mean']:,} ({g['low']:,}..{g['high']:,}) vs run {rep['completion_tokens']:,} "
                  f"[{verdict['tokens']}]; seconds {s['mean']:.1f} ({s['low']:.1f}..{s['high']:.1f}) vs run "
                  f"{run_wall:.1f} [{verdict['seconds']}]", flush=True)
    print(load_line())
    write_json(a.json_path, {"cpu": cpu_line(), "results": results})


if __name__ == "__main__":
    main()
