#!/usr/bin/env python
"""Benchmark ``finalize``'s audit: in memory against by hash partition (``ops/audit.py``), side by side.

Builds an OUTDIR of ``--rows`` rows in ``--shards`` shards with the scripted engine in zero-cost mode (the pipeline
alone, parts of ``--commit-rows``), then runs ``dspine-batch finalize`` on it ``--repeats`` times per setting,
alternating order: "in memory" (``DSPINE_BATCH_AUDIT_ROWS`` above the rows) and "buckets" (``--bucket-rows`` a
bucket). Each run's wall time and peak RSS (the child's ``ru_maxrss`` from ``wait4``) are printed with the load.

Usage:
    python scripts/bench/bench_finalize.py --rows 1000000 --shards 4 --bucket-rows 250000 --repeats 2
    python scripts/bench/bench_finalize.py --rows 10000000 --shards 4 --tmp /work/fin --keep --repeats 1
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
from bench_pipeline import ROOT, make_input  # noqa: E402


def build(tmp: Path, rows: int, shards: int, commit_rows: int) -> Path:
    out = tmp / f"fin-{rows}-{shards}"
    if (out / "_SUCCESS").exists():
        return out
    src = tmp / f"fin-{rows}.parquet"
    if not src.exists():
        make_input(src, rows)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for i in range(shards):
        subprocess.run([sys.executable, "-m", "dspine_batch.cli", "generate", str(src), "-o", str(out), "--engine",
                        "scripted", "--engine-arg", "zero_cost=1", "--raw", "--max-in-flight", "1024",
                        "--commit-rows", str(commit_rows), "--shard", f"{i}/{shards}"], env=env, check=True,
                       stderr=subprocess.DEVNULL)
    return out


def finalize(out: Path, audit_rows: int) -> dict:
    env = dict(os.environ, DSPINE_BATCH_AUDIT_ROWS=str(audit_rows),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (out / "_SUCCESS").unlink(missing_ok=True)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "dspine_batch.cli", "finalize", str(out)], env=env,
                         stderr=subprocess.PIPE, text=True)
    err = p.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"finalize failed:\n{err}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024), "load_1min": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--commit-rows", type=int, default=10_000)
    ap.add_argument("--bucket-rows", type=int, default=250_000, help="rows a bucket in the 'buckets' setting")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tmp", default=None, help="work dir (default: a temp dir, deleted afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the OUTDIR in --tmp and use it again")
    a = ap.parse_args()
    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="bench_finalize_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        out = build(tmp, a.rows, a.shards, a.commit_rows)
        print(f"built {a.rows:,} rows in {a.shards} shards: {time.perf_counter() - t:.0f}s", file=sys.stderr)
        settings = [("in memory", a.rows * 10 + 1), ("buckets", a.bucket_rows)]
        got: dict[str, list[dict]] = {name: [] for name, _ in settings}
        for rep in range(a.repeats):
            for name, rows in (settings if rep % 2 == 0 else settings[::-1]):
                got[name].append(finalize(out, rows))
                print(f"{name}: {got[name][-1]}", file=sys.stderr)
        print(json.dumps({"rows": a.rows, "shards": a.shards, "bucket_rows": a.bucket_rows, **got}, indent=2))
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
