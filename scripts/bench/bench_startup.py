#!/usr/bin/env python
"""Start-up and memory of the README main job (issue 44): the defaults (embedded target + the shipped draft) against
``--draft none``, side by side, in alternating order, ``--repeats`` times each.

Per run, one fresh process (``python -m dspine_batch.cli generate INPUT -o OUT/<run>``): its peak RSS (the child's
``ru_maxrss``, what ``/usr/bin/time -v`` reports as "Maximum resident set size"), "model loaded in" and "first token
... after the command started" from its run log, and the wall time of the command. Caches are warm: one untimed run
of each configuration first (``--no-warmup`` to skip it), so the packed weights, the draft's packed form, the
kernels and the cost calibrations are on disk. ``--prev DIR`` adds a third configuration: the defaults from another
checkout (a git worktree of an older commit, run with its own code on ``PYTHONPATH``), for a before/after.

Prints one line per run, then per configuration the medians, and the CPU model and load averages (before and
after); ``--json FILE`` writes all of it.

    python scripts/bench/bench_startup.py
    python scripts/bench/bench_startup.py --repeats 5 --prev /work/main --json out/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_one(checkout: Path, extra: list[str], inp: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", str(inp), "-o", str(out), *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{log[-2000:]}")

    def grab(pattern: str) -> float | None:
        m = re.search(pattern, log)
        return float(m.group(1)) if m else None

    return {"peak_rss_mb": usage.ru_maxrss / 1024, "model_loaded_s": grab(r"model loaded in ([\d.]+)s"),
            "first_token_s": grab(r"first token ([\d.]+)s after the command"), "wall_s": round(wall, 2),
            "load": loadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, default=REPO / "examples" / "prompts.jsonl")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_startup")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prev", type=Path, help="another checkout: its defaults as a third configuration")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    configs = {"defaults": (REPO, []), "draft_none": (REPO, ["--draft", "none"])}
    if args.prev:
        configs["previous"] = (args.prev.resolve(), [])
    inp = args.input.resolve()
    head = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": loadavg(), "input": str(inp)}
    print(f"cpu: {head['cpu']}, {head['cores']} cores; load before: {head['load_before']}", flush=True)
    if not args.no_warmup:
        for name, (checkout, extra) in configs.items():
            run_one(checkout, extra, inp, args.out / f"warmup-{name}")
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for i in range(args.repeats):
        order = names if i % 2 == 0 else names[::-1]  # alternate which goes first
        for name in order:
            checkout, extra = configs[name]
            r = run_one(checkout, extra, inp, args.out / name)
            runs[name].append(r)
            print(f"{i + 1}/{args.repeats} {name:11s} peak RSS {r['peak_rss_mb']:7.1f} MB, model loaded "
                  f"{r['model_loaded_s']}s, first token {r['first_token_s']}s, wall {r['wall_s']:.1f}s "
                  f"(load {r['load']})", flush=True)
    head["load_after"] = loadavg()
    medians = {}
    for name, rs in runs.items():
        medians[name] = {k: (statistics.median(v) if (v := [r[k] for r in rs if r[k] is not None]) else None)
                         for k in ("peak_rss_mb", "model_loaded_s", "first_token_s", "wall_s")}
        print(f"median {name:11s} " + ", ".join(f"{k} {v if v is None else round(v, 2)}"
                                                for k, v in medians[name].items()))
    d, n = medians["defaults"], medians["draft_none"]
    if d["model_loaded_s"] is not None and n["model_loaded_s"] is not None:
        print(f"model loaded, draft - none: {d['model_loaded_s'] - n['model_loaded_s']:+.2f}s; "
              f"wall none/defaults: {n['wall_s'] / d['wall_s']:.2f}x")
    print(f"load after: {head['load_after']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**head, "runs": runs, "medians": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
