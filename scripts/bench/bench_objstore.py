#!/usr/bin/env python
"""What an object-store OUTDIR costs (issue 39): the pipeline on the zero-cost scripted engine into a local OUTDIR
vs an ``s3://`` OUTDIR on a local S3 server (moto's server mode on 127.0.0.1, a subprocess), alternating, with
repeats; the commit latency of one part on each; resume time over many committed rows on s3://; peak RSS while
streaming a big s3:// Parquet input.

Every run is a real ``dspine-batch generate`` subprocess (``--engine scripted --engine-arg zero_cost=1 --raw
--max-in-flight 1024``, default ``--commit-rows 1000``), as in ``bench_pipeline.py``. moto is a Python server on the
same cores, so s3:// numbers here are an upper bound on the protocol's cost (a real store answers from elsewhere,
and in ~10-30 ms per request instead of moto's few ms on a busy CPU).

Usage:
    python scripts/bench/bench_objstore.py                                   # 1M rows per run, 1M resume rows
    python scripts/bench/bench_objstore.py --rows 100000 --resume-rows 100000 --stream-rows 500000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's dspine_batch, not an installed one

from bench_pipeline import make_input, rss_mb  # noqa: E402
from machine import cpu_line, load_line, write_json  # noqa: E402

BUCKET = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, url
        except OSError:
            time.sleep(0.05)
    raise SystemExit("moto server did not start")


def generate(inputs: list[str], out: str, env: dict[str, str], commit_rows: int | None = None) -> dict:
    """One generate run; wall time, peak RSS (sampled every 0.1 s), stderr. ``commit_rows`` None: the tool's
    default for that OUTDIR (what a user gets)."""
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", *inputs, "-o", out, "--engine", "scripted",
           "--engine-arg", "zero_cost=1", "--raw", "--max-in-flight", "1024", "--progress", "none"]
    if commit_rows is not None:
        cmd += ["--commit-rows", str(commit_rows)]
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while p.poll() is None:
        peak = max(peak, rss_mb(p.pid) or 0.0)
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    err = p.stderr.read()
    if p.returncode != 0:
        raise SystemExit(f"dspine-batch failed ({p.returncode}):\n{err}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the generate process only (moto is reaped at the end)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": round(peak), "log": err}


def commit_latency(url: str, parts: int) -> dict:
    """Milliseconds per commit of one 1,000-row part (the sink's default) on a fresh OUTDIR, p50 and p95: until the
    part is committed and published, and how long the pipeline's thread is held (an object store's upload, record
    and publish run on the committer's threads while the pipeline fills the next part)."""
    import numpy as np
    import pyarrow as pa

    from dspine_batch.outdir.output import open_output

    out = open_output(url)
    out.prepare()
    table = pa.table({"row_id": [f"r{i}" for i in range(1000)], "sample_index": [0] * 1000,
                      "output": ["x" * 40] * 1000})
    keys = np.arange(1000, dtype=np.uint64)
    blocking, total = [], []
    for seq in range(parts):
        t = time.perf_counter()
        out.commit_part(f"train-00000-of-00001-{seq:06d}.parquet", table, keys, 1000)
        blocking.append(time.perf_counter() - t)
        out.flush()  # until the record exists and the part is published
        total.append(time.perf_counter() - t)

    def q(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"p50_ms": round(1000 * statistics.median(xs), 1), "p95_ms": round(1000 * xs[int(0.95 * len(xs))], 1)}

    return {"until_committed": q(total), "pipeline_blocked": q(blocking)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per throughput run")
    ap.add_argument("--repeats", type=int, default=3, help="local/s3 pairs, alternating")
    ap.add_argument("--resume-rows", type=int, default=1_000_000, help="committed rows the resume is timed over")
    ap.add_argument("--stream-rows", type=int, default=1_000_000, help="rows of the s3:// input streamed for RSS")
    ap.add_argument("--commit-parts", type=int, default=50, help="parts committed for the latency figure")
    ap.add_argument("--commit-rows", type=int, help="--commit-rows of the throughput and resume runs (default: the "
                    "tool's default for each OUTDIR)")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_objstore_"))
    moto, endpoint = start_moto()
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                           "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")})
    report: dict = {"cpu": cpu_line(), "load_before": load_line(), "rows": a.rows, "repeats": a.repeats}
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        src = tmp / "input.parquet"
        make_input(src, a.rows)
        runs: dict[str, list[float]] = {"local": [], "s3": []}
        cpu: dict[str, list[float]] = {"local": [], "s3": []}  # rows per CPU-second of the generate process
        for r in range(a.repeats):
            for where in ("local", "s3"):  # alternating: drift in the machine's load hits both alike
                out = str(tmp / f"out-{r}") if where == "local" else f"s3://{BUCKET}/out-{r}"
                res = generate([str(src)], out, env, a.commit_rows)
                runs[where].append(a.rows / res["wall_s"])
                cpu[where].append(a.rows / res["cpu_s"])
                print(f"{where} run {r}: {a.rows / res['wall_s']:,.0f} rows/s ({res['wall_s']:.1f}s)", file=sys.stderr)
        for where, rates in runs.items():
            report[f"{where}_rows_per_s"] = [round(x) for x in rates]
            report[f"{where}_rows_per_s_median"] = round(statistics.median(rates))
            report[f"{where}_rows_per_cpu_s_median"] = round(statistics.median(cpu[where]))
        report["s3_cost_pct"] = round(100 * (1 - report["s3_rows_per_s_median"] / report["local_rows_per_s_median"]), 1)
        report["commit_latency_local"] = commit_latency(str(tmp / "latency"), a.commit_parts)
        report["commit_latency_s3"] = commit_latency(f"s3://{BUCKET}/latency", a.commit_parts)

        # resume over resume_rows committed rows on s3:// (default commit size): a rerun with nothing left
        res_src = tmp / "resume.parquet"
        make_input(res_src, a.resume_rows)
        t = time.perf_counter()
        generate([str(res_src)], f"s3://{BUCKET}/resume", env, a.commit_rows)
        report["resume_commit_run_s"] = round(time.perf_counter() - t, 1)
        for where, out in (("s3", f"s3://{BUCKET}/resume"), ("local", str(tmp / "resume-local"))):
            if where == "local":
                generate([str(res_src)], out, env, a.commit_rows)
            res = generate([str(res_src)], out, env, a.commit_rows)
            m = re.search(r"checked in ([\d.]+)s", res["log"])
            report[f"resume_{where}_checked_s"] = float(m.group(1)) if m else None
            report[f"resume_{where}_wall_s"] = round(res["wall_s"], 2)

        # peak RSS streaming a big s3:// input (into a local OUTDIR), against the same input read locally
        big = tmp / "stream.parquet"
        make_input(big, a.stream_rows)
        subprocess.run([sys.executable, "-c", "import s3fs,sys; s3fs.S3FileSystem().put_file(sys.argv[1], sys.argv[2])",
                        str(big), f"{BUCKET}/stream/in.parquet"], env=env, check=True)
        res = generate([f"s3://{BUCKET}/stream/in.parquet"], str(tmp / "stream-out"), env, commit_rows=100_000)
        report["stream_s3_input_rows"] = a.stream_rows
        report["stream_s3_input_mb"] = round(big.stat().st_size / 1e6)
        report["stream_s3_peak_rss_mb"] = res["peak_rss_mb"]
        report["stream_s3_rows_per_s"] = round(a.stream_rows / res["wall_s"])
        res = generate([str(big)], str(tmp / "stream-local"), env, commit_rows=100_000)
        report["stream_local_peak_rss_mb"] = res["peak_rss_mb"]
        report["stream_local_rows_per_s"] = round(a.stream_rows / res["wall_s"])
        report["load_after"] = load_line()
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))
    write_json(a.json, report)


if __name__ == "__main__":
    main()
