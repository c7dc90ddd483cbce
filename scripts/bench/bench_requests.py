#!/usr/bin/env python
"""What reading request fields costs the pipeline: rows/s of ``generate`` on the zero-cost scripted engine, for
two checkouts side by side (``--code A --code B``, alternating, ``--repeats`` each), on three inputs:

* ``plain``: JSON Lines rows ``{"id", "prompt"}`` (no request fields: the pipeline now looks for every field in
  schema-less rows, so this is the case that must not get slower);
* ``openai``: OpenAI batch lines with ``messages``, ``max_tokens`` and ``temperature``;
* ``schema`` (checkouts that have structures only): the same lines with a ``response_format`` JSON schema, which
  adds the up-front grammar check (``structures.prescan``) and the per-row structure parse.

Usage:
    python scripts/bench/bench_requests.py --code /work/main --code . --rows 200000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_line, load_line  # noqa: E402

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}, "reason": {"type": "string"}},
          "required": ["label", "reason"]}


def write_inputs(d: Path, rows: int) -> dict[str, Path]:
    paths = {name: d / f"{name}.jsonl" for name in ("plain", "openai", "schema")}
    with open(paths["plain"], "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"Classify review number {i} please."}) + "\n")
    for name, extra in (("openai", {}), ("schema", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "label", "schema": SCHEMA}}})):
        with open(paths[name], "w") as f:
            for i in range(rows):
                body = {"model": "m", "messages": [{"role": "user", "content": f"Classify review number {i}."}],
                        "max_tokens": 32, "temperature": 0.0, **extra}
                f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + "\n")
    return paths


def run(code: Path, src: Path, out: Path) -> tuple[float, str]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code), "DSPINE_BATCH_PROGRESS": "none"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "dspine_batch.cli", "generate", str(src), "-o", str(out), "--engine",
                        "scripted", "--engine-arg", "zero_cost=1", "--commit-rows", "20000"],
                       env=env, capture_output=True, text=True, cwd=code)  # cwd: `-m` imports from it first
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        return float("nan"), p.stderr.strip().splitlines()[-1]
    note = next((ln.split("structures: ", 1)[1] for ln in p.stderr.splitlines() if "structures: " in ln), "")
    return dt, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", action="append", required=True, help="a checkout's root (repeat for each)")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-requests-"))
    try:
        print(cpu_line())
        paths = write_inputs(tmp, args.rows)
        for name, src in paths.items():
            times: dict[str, list[float]] = {c: [] for c in args.code}
            notes: dict[str, str] = {}
            print(f"{name}: {load_line()}")
            for rep in range(args.repeats):
                order = args.code if rep % 2 == 0 else list(reversed(args.code))
                for code in order:
                    dt, note = run(Path(code).resolve(), src, tmp / "out")
                    times[code].append(dt)
                    notes[code] = note or notes.get(code, "")
            for code in args.code:
                best = min(times[code])
                rate = f"{args.rows / best:9,.0f} rows/s" if best == best else "   failed"
                print(f"  {code:<24} best {best:6.2f}s  {rate}  {notes[code]}")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
