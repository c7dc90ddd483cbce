#!/usr/bin/env python
"""One small decode under CPU contention, with torch's default OpenMP waiting vs passive waiting, side by side.

Each setting runs the same job in a fresh subprocess (the OpenMP wait policy is fixed when torch loads), first
on the machine as it is and then beside ``--hogs`` busy-looping processes. A job on a loaded machine should
slow down roughly in proportion to the load (with two hogs on two cores: ~2x), not collapse.

    python scripts/bench/bench_contention.py --hogs 2 --prompts 2 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JOB = r"""
import json, sys, time, torch
from dspine import generate, load_draft, load_target
from dspine.embedded.smollm2 import embedded_draft_path, embedded_target_path
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
target = load_target(embedded_target_path())
draft = load_draft(embedded_draft_path()).use_kernels() if cfg["draft"] else None  # packed, as the engine runs it
prompts = [torch.randint(0, 40000, (60,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(cfg["prompts"])]
generate(target, draft, prompts[:1], max_new_tokens=4)  # warm-up
t0 = time.perf_counter()
n = 0
for p in prompts:
    n += len(generate(target, draft, [p], max_new_tokens=cfg["new_tokens"])[0].token_ids)
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": n, "threads": torch.get_num_threads()}))
"""

SETTINGS = {
    "default": {},  # torch's libgomp default: busy-wait between parallel regions
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin_1e4": {"GOMP_SPINCOUNT": "10000"},  # bounded spinning, then sleep (libgomp)
    "spin_1e5": {"GOMP_SPINCOUNT": "100000"},
    "one_thread": {"OMP_NUM_THREADS": "1"},
}


def run_job(extra_env: dict[str, str], cfg: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(extra_env)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", JOB, json.dumps(cfg)], env=env, capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["tok_per_s"] = res["tokens"] / res["seconds"]
    return res


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-draft", action="store_true", help="plain decoding instead of the embedded pair")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args()
    cfg = {"prompts": args.prompts, "new_tokens": args.new_tokens, "draft": not args.no_draft}
    report: dict = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "hogs": args.hogs,
                    "job": cfg, "load_before": os.getloadavg(), "results": {}}
    for name in args.settings:
        quiet = run_job(SETTINGS[name], cfg)
        hogs = start_hogs(args.hogs)
        try:
            time.sleep(0.5)
            loaded = run_job(SETTINGS[name], cfg)
        finally:
            stop_hogs(hogs)
        report["results"][name] = {"quiet_s": round(quiet["seconds"], 2), "loaded_s": round(loaded["seconds"], 2),
                                   "slowdown": round(loaded["seconds"] / quiet["seconds"], 2),
                                   "threads": quiet["threads"]}
        print(json.dumps({name: report["results"][name]}), flush=True)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
