#!/usr/bin/env python
"""Full target forwards by shape (rows x tokens, with and without the logits of every token), side by side across
checkouts and precision settings in one run: the verify-shaped cost that speculation pays (issue 34/35).

Each column is a worker process (``PYTHONPATH`` = its checkout, so another commit's kernels can be timed beside this
one's: ``--checkout base=/path/to/worktree``) holding the embedded target under one ``dtype`` with each row's cache
filled to ``--context`` tokens; the forwards run with ``speculative=True`` so the caches stay at that length. The
parent asks the workers in turn, shape by shape and rep by rep (columns alternate, order flipped every rep), so they
share the machine's load. Median milliseconds; the CPU, threads and load average are printed.

    python scripts/bench/bench_forward_shapes.py --column new:bfloat16 --column new:q8 \\
        --checkout base=/tmp/base --column base:bfloat16 --reps 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_line, load_line  # noqa: E402

SHAPES = ("1x1 1x2 1x4 1x8 1x9 1x12 1x16 1x17 1x24 1x32 8x1 8x2 8x4 8x17 32x1 "
          "L1x1 L1x8 L1x17 L8x1 L8x2 L8x4 L8x17 L1x64 L1x128 L1x300")  # L: logits of every token too

WORKER = r"""
import json, sys, time, torch
from dspine import load_target
from dspine.models.registry import auto_dtype
from dspine_batch.engines.models import resolve_model
job = json.loads(sys.stdin.readline())
torch.set_num_threads(job["threads"]) if job["threads"] else None
path = resolve_model("embedded")
dtype = job["dtype"]
if dtype == "auto":
    dtype = auto_dtype(path)
kw = {"float32": {}, "bfloat16": {"dtype": torch.bfloat16}}.get(dtype)
if kw is None:  # an integer policy (quant=q8 / q16)
    kw = {"dtype": torch.bfloat16, "quant": dtype}
t = load_target(path, **kw)
g = torch.Generator().manual_seed(0)
rows_all, most = job["rows"], job["tokens"]
ctx = torch.randint(0, t.vocab_size, (max(rows_all), job["context"]), generator=g)
new = torch.randint(0, t.vocab_size, (max(rows_all), most), generator=g)
caches = {}
with torch.no_grad():
    for r in rows_all:
        caches[r] = t.new_cache(r, job["context"] + most + 1)
        t.forward(ctx[:r], caches[r])
print(json.dumps({"kernel": t.kernel}), flush=True)
for line in sys.stdin:
    rows, toks, logits = json.loads(line)
    with torch.no_grad():
        t0 = time.perf_counter()
        h = t.forward(new[:rows, :toks], caches[rows], speculative=True).hidden
        if logits:
            t.logits(h)
        dt = time.perf_counter() - t0
    print(json.dumps(dt), flush=True)
"""


def parse_shape(s: str) -> tuple[int, int, bool]:
    logits = s.startswith("L")
    rows, toks = s.lstrip("L").split("x")
    return int(rows), int(toks), logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                    help="another source tree to time (``new`` is this one)")
    ap.add_argument("--column", action="append", metavar="CHECKOUT:DTYPE",
                    help="a worker: checkout name and dtype (float32, bfloat16, auto) or integer policy (q8, q16); "
                         "default new:bfloat16")
    ap.add_argument("--shapes", nargs="+", default=SHAPES.split(), help="RxT, LRxT with logits of every token")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees = {"new": REPO} | {k: Path(v).resolve() for k, v in (c.split("=", 1) for c in args.checkout)}
    columns = args.column or ["new:bfloat16"]
    shapes = [parse_shape(s) for s in args.shapes]
    job = {"rows": sorted({r for r, _, _ in shapes}), "tokens": max(t for _, t, _ in shapes),
           "context": args.context, "threads": args.threads}
    print(f"# {cpu_line()}, threads {args.threads or 'default'}, context {args.context}, {load_line()}", flush=True)
    workers = {}
    for col in columns:
        tree, dtype = col.split(":", 1)
        env = {**os.environ, "PYTHONPATH": str(trees[tree])}
        p = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env, cwd=str(trees[tree]))
        p.stdin.write(json.dumps(job | {"dtype": dtype}) + "\n")
        p.stdin.flush()
        workers[col] = p
    for col, p in workers.items():
        print(f"# {col} ({trees[col.split(':')[0]]}): kernel {json.loads(p.stdout.readline())['kernel']}", flush=True)

    def ask(col: str, shape) -> float:
        p = workers[col]
        p.stdin.write(json.dumps(list(shape)) + "\n")
        p.stdin.flush()
        return float(p.stdout.readline())

    times = {(c, s): [] for c in columns for s in shapes}
    for rep in range(args.reps + 1):  # rep 0 warms up
        order = columns if rep % 2 else columns[::-1]
        for s in shapes:
            for c in order:
                dt = ask(c, s)
                if rep:
                    times[c, s].append(dt)
    for p in workers.values():
        p.stdin.close()
        p.wait()
    print(f"# after: {load_line()}\n")
    first = columns[0]
    print("| rows x tokens | logits | " + " | ".join(f"{c} ms" for c in columns) + " | "
          + " | ".join(f"{c} / {first}" for c in columns[1:]) + " |")
    print("|---|---|" + "---:|" * (2 * len(columns) - 1))
    out = []
    for s in shapes:
        ms = {c: 1000 * statistics.median(times[c, s]) for c in columns}
        rel = [f"{ms[c] / ms[first]:.2f}x" for c in columns[1:]]
        print(f"| {s[0]} x {s[1]} | {'yes' if s[2] else 'no'} | " + " | ".join(f"{ms[c]:.1f}" for c in columns)
              + " | " + " | ".join(rel) + " |")
        out.append({"rows": s[0], "tokens": s[1], "logits": s[2], "ms": ms})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_line(), "context": args.context, "reps": args.reps,
                                         "columns": columns, "shapes": out}, indent=1))


if __name__ == "__main__":
    main()
