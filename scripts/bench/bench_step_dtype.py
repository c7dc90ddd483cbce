#!/usr/bin/env python
"""Decode and verify forwards under dtype=float32 vs dtype=bfloat16 (issue 26): is the bf16 policy's decode slower?

Full target forwards of the embedded SmolLM2 (one token per row at 1/8/32 rows; verify-shaped 1 and 8 rows x 4 and
x 17 tokens; logits of every new token, as a verify needs them) over a ``--context``-token cache, ``speculative=True``
so the cache stays at that length. Columns, interleaved shape by shape and rep by rep in one process so they share
the machine's load:

- ``fp32``: the default (Q4_1/Q8_0 blocks, fp32 kernels, fp32 KV);
- ``bf16-panels-kv32``: the bf16 family over bf16 panels (2 bytes a weight), fp32 KV: the bf16 policy before the
  block formats and the bf16 KV cache;
- ``bf16-kv32``: the bf16 family over the GGUF blocks (``bf16dp_q4_1``/``bf16dp_q8_0``), fp32 KV;
- ``bf16``: the bf16 policy as loaded now: blocks and a bf16 KV cache.

Median milliseconds per forward; the CPU, threads and load are printed (the machines are shared: compare columns
within one run).

    python scripts/bench/bench_step_dtype.py --reps 15 --json out/step_dtype.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_prefill import cpu_line, load_line  # noqa: E402

SHAPES = ((1, 1), (8, 1), (32, 1), (1, 4), (8, 4), (1, 17), (8, 17))  # (rows, tokens per row)
COLUMNS = ("fp32", "bf16-panels-kv32", "bf16-kv32", "bf16")


def load(column: str):
    import torch

    from dspine import load_target
    from dspine.cpu.kernels import BF16DP
    from dspine_batch.engines.models import resolve_model

    path = resolve_model("embedded")
    if column == "fp32":
        return load_target(path)
    if column == "bf16-panels-kv32":
        return load_target(path, kernels=False).use_kernels(formats=(BF16DP,))
    if column == "bf16-kv32":
        return load_target(path, dtype=torch.bfloat16, kv_dtype=torch.float32)
    return load_target(path, dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300, help="tokens already in each row's cache")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from dspine.cpu import kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {cpu_line()}, torch threads {torch.get_num_threads()}, {load_line()}", flush=True)
    targets = {c: load(c) for c in args.columns}
    for c, t in targets.items():
        print(f"# {c}: kernel {t.kernel}, KV {t.kv_dtype}, formats {kernels.weight_formats(t)}", flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(targets.values())).vocab_size
    most = max(r for r, _ in SHAPES)
    ctx = torch.randint(0, vocab, (most, args.context), generator=g)
    new = torch.randint(0, vocab, (most, max(t for _, t in SHAPES)), generator=g)
    caches = {}
    with torch.no_grad():
        for c, t in targets.items():
            for rows in sorted({r for r, _ in SHAPES}):
                cache = t.new_cache(rows, args.context + 32)
                t.forward(ctx[:rows], cache)
                caches[c, rows] = cache
        times = {(c, s): [] for c in targets for s in SHAPES}
        for rep in range(args.reps + 1):  # rep 0 warms up
            for s in SHAPES:
                rows, toks = s
                for c, t in targets.items():
                    t0 = time.perf_counter()
                    t.logits(t.forward(new[:rows, :toks], caches[c, rows], speculative=True).hidden)
                    if rep:
                        times[c, s].append(time.perf_counter() - t0)
    print(f"# after: {load_line()}\n")
    head = " | ".join(f"{c} ms" for c in targets)
    print(f"| rows x tokens | {head} | " + " | ".join(f"{c} / fp32" for c in targets if c != "fp32") + " |")
    print("|---|" + "---:|" * (2 * len(targets) - ("fp32" in targets)))
    out = []
    for s in SHAPES:
        ms = {c: 1000 * statistics.median(times[c, s]) for c in targets}
        rel = [f"{ms[c] / ms['fp32']:.2f}x" for c in targets if c != "fp32" and "fp32" in ms]
        print(f"| {s[0]} x {s[1]} | " + " | ".join(f"{ms[c]:.1f}" for c in targets) + " | " + " | ".join(rel) + " |")
        out.append({"rows": s[0], "tokens": s[1], "ms": ms})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_line(), "threads": torch.get_num_threads(), "context": args.context,
                                         "reps": args.reps, "shapes": out}, indent=1))


if __name__ == "__main__":
    main()
