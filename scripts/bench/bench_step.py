#!/usr/bin/env python
"""Target step cost per setting, side by side in one process: fp32 with torch's linears, fp32 with our
kernels (dspine.cpu.kernels, the default), fp32 torch with fused projections, bf16, int8 and int4 weight-only.

Times a one-token decode step and a ``--verify``-token verify forward at each batch size, after a ~100-token
context, rounds interleaved across settings (so machine load affects them alike); reports median ms and the
ratio to the first setting (fp32), plus each setting's max |logit| difference from fp32 on the same inputs.

    python scripts/bench/bench_step.py --batch 1 8 --reps 20
    python scripts/bench/bench_step.py --settings fp32_torch fp32 --batch 1 8 32 --verify 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from dspine import load_target

SETTINGS = {
    "fp32_torch": dict(dtype=torch.float32, kernels=False),  # torch's linears and ops (MKL)
    "fp32": dict(dtype=torch.float32),  # dspine.cpu.kernels where they build (the default)
    "fp32_fused": dict(dtype=torch.float32, fuse=True, kernels=False),
    "bf16": dict(dtype=torch.bfloat16),
    "int8": dict(dtype=torch.bfloat16, quant="int8"),
    "q8": dict(dtype=torch.bfloat16, quant="q8"),  # our integer dot products (GGUF-block weights, int8 inputs)
    "int4": dict(dtype=torch.bfloat16, quant="int4"),
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@torch.no_grad()
def make_step(target, batch: int, ctx: int, tokens: int):
    g = torch.Generator().manual_seed(batch * 1000 + tokens)
    prompt = torch.randint(0, target.vocab_size, (batch, ctx), generator=g)
    new = torch.randint(0, target.vocab_size, (batch, tokens), generator=g)
    cache = target.new_cache(batch, ctx + tokens)
    target.forward(prompt, cache)

    @torch.no_grad()
    def step():
        return target.logits(target.forward(new, cache, speculative=True).hidden)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--verify", type=int, default=8, help="tokens per verify forward")
    ap.add_argument("--ctx", type=int, default=100)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args()
    from dspine.cpu.threads import configure_torch

    configure_torch()
    path = args.model
    if path == "embedded":
        from dspine.embedded.smollm2 import embedded_target_path

        path = str(embedded_target_path())
    targets = {name: load_target(path, **SETTINGS[name]) for name in args.settings}
    report: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "capability": torch.backends.cpu.get_cpu_capability(),
                    "steps": {}}
    shapes = [(b, t) for b in args.batch for t in (1, args.verify)]
    for b, t in shapes:
        steps = {name: make_step(tg, b, args.ctx, t) for name, tg in targets.items()}
        ref = steps[args.settings[0]]()
        times: dict[str, list[float]] = {name: [] for name in steps}
        diffs = {name: float((fn() - ref).abs().max()) for name, fn in steps.items()}
        for _ in range(args.reps):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times[args.settings[0]])
        row = {name: {"ms": round(1e3 * statistics.median(ts), 2), "vs_first": round(base / statistics.median(ts), 2),
                      "max_logit_diff": round(diffs[name], 4)} for name, ts in times.items()}
        report["steps"][f"batch{b}_tokens{t}"] = row
        print(json.dumps({f"batch{b}_tokens{t}": row}), flush=True)
    report["load"] = [round(x, 2) for x in os.getloadavg()]
    report["kernels"] = {name: tg.kernel for name, tg in targets.items()}
    print(json.dumps(report, indent=2))
    print(f"\n{report['cpu']}, {report['threads']} threads, load {report['load']}: median ms (x vs {args.settings[0]})")
    print("shape".ljust(18) + "".join(n.rjust(18) for n in args.settings))
    for shape, row in report["steps"].items():
        print(shape.ljust(18) + "".join(f"{row[n]['ms']:>10.1f} ({row[n]['vs_first']:.2f}x)" for n in args.settings))


if __name__ == "__main__":
    main()
