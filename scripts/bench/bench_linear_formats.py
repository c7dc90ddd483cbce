#!/usr/bin/env python
"""One linear of the embedded model's shapes in each of our weight formats, by row count (issue 34): median ms.

The weights are random GGUF grids (Q4_1 for the decoder's gate/up and down projections, Q8_0 for the 49k-row head),
so every block format applies; the formats' columns alternate rep by rep. One thread by default (``--threads``):
on a shared machine a single thread's timing survives neighbours that make two-thread timings meaningless.

    python scripts/bench/bench_linear_formats.py --formats bf16dp_q4_1 q16dp_q4_1 q8dp_q4_1 q4_1 --rows 1 8 17 64
    python scripts/bench/bench_linear_formats.py --shapes head --formats bf16dp_q8_0 q16dp_q8_0 q8dp_q8_0 q8_0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from machine import cpu_line, load_line  # noqa: E402

SHAPES = {"qkv": (960, 576, "q4_1"), "o": (576, 576, "q4_1"), "gate_up": (3072, 576, "q4_1"),
          "down": (576, 1536, "q4_1"), "head": (49152, 576, "q8_0")}


def grid(n: int, k: int, kind: str, seed: int = 1):
    """A weight on GGUF's grid: Q4_1 (d * q + m, q in 0..15, min and max hit) or Q8_0 (d * q), float16 scales."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
        return (d * q + (torch.randn(n, k // 32, 1, generator=g) * 0.05).half().float()).reshape(n, k)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 5] = 127
    return ((torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float() * q).reshape(n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gate_up", "down"], choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["bf16dp_q4_1", "q16dp_q4_1", "q8dp_q4_1", "q4_1"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 9, 17, 32, 64, 192, 512])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from dspine.cpu import kernels

    torch.set_num_threads(args.threads)
    print(f"# {cpu_line()}, threads {args.threads}, {load_line()}", flush=True)
    for name in args.shapes:
        n, k, kind = SHAPES[name]
        w = grid(n, k, kind)
        lins = {f: kernels.PackedLinear(w, formats=(f,)) for f in args.formats}
        for f, lin in lins.items():
            if lin.format != f:
                raise SystemExit(f"{name}: format {f} does not apply (got {lin.format})")
        for m in args.rows:
            x = torch.randn(m, k)
            times = {f: [] for f in lins}
            for rep in range(max(3, int(2e8 / (n * k * max(m, 4)))) + 1):
                for f, lin in lins.items():
                    t0 = time.perf_counter()
                    lin(x)
                    if rep:
                        times[f].append(time.perf_counter() - t0)
            cells = "  ".join(f"{f} {1e3 * statistics.median(t):.3f} ms" for f, t in times.items())
            print(f"{name} {m} rows: {cells}", flush=True)
    print(f"# after: {load_line()}")


if __name__ == "__main__":
    main()
