#!/usr/bin/env python
"""Benchmark the dspine-batch pipeline itself (source -> scheduler -> engine -> sink), engine cost removed.

Three numbers, each from a real ``dspine-batch generate`` subprocess on the scripted engine in zero-cost mode
(``--engine scripted --engine-arg zero_cost=1``: no token synthesis, so only the pipeline is measured):

1. throughput: rows/s over ``--rows`` generated Parquet input rows (default 10M);
2. memory: peak RSS of that run, and RSS sampled along the way (it must stay flat, not grow with input);
3. resume start-up with ``--resume-rows`` (default 1M) committed rows: time to rebuild the done-set, and time
   from process start until the first new part is committed (done-set + skipping the committed input rows).
4. ``--resume-scale 1000000,10000000``: resume over each number of committed rows in one shard, by the full
   done-set (``DSPINE_BATCH_WATERMARKS=0``, the path before watermarks) and by the watermarks, side by side on the
   same OUTDIR, alternating order, ``--repeats`` each: time to the done-set, to the first new part, and the
   process's peak RSS (VmHWM) when that part appears. Each resume is killed there and what it wrote removed, so
   every run starts from the same committed rows. ``--only-scale`` skips 1-3.

Targets (issue 3): >= 50,000 rows/s, flat RSS < 1 GB, resume start-up < 3 s. Issue 56: resume over 10M committed
rows: first new part <= 3 s at <= 300 MB peak; 100M <= 10 s.

Usage:
    python scripts/bench/bench_pipeline.py                      # full run (~5 min on 2 cores)
    python scripts/bench/bench_pipeline.py --rows 1000000       # quicker
    python scripts/bench/bench_pipeline.py --only-scale --resume-scale 1000000,10000000 --repeats 2
    # 100M rows: build the OUTDIR once (~75 min on 2 loaded cores), then resume over it as often as wanted
    python scripts/bench/bench_pipeline.py --only-scale --resume-scale 100000000 --tmp /work/scale --keep --repeats 0
    python scripts/bench/bench_pipeline.py --only-scale --resume-scale 100000000 --tmp /work/scale --keep \
        --scale-paths watermarks --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ["Explain {i} in one sentence.", "Write a Python function that returns {i} squared.",
             "What is {i} plus {j}?", "Summarize the plot of story number {i}.", "Translate '{i}' into French."]


def make_input(path: Path, rows: int, chunk: int = 500_000) -> None:
    """Parquet input with varied short prompts, written in row groups (never all in memory)."""
    schema = pa.schema([("prompt", pa.string())])
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            w.write_table(pa.table({"prompt": [TEMPLATES[i % 5].format(i=i, j=i % 97)
                                               for i in range(start, start + n)]}), row_group_size=100_000)


def status_mb(pid: int, field: str = "VmRSS") -> float | None:
    """A process's memory figure from /proc (``VmRSS`` now, ``VmHWM`` its peak so far), in MB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run(args: list[str], out: Path, watch_parts: int | None = None, commit_rows: int = 100_000,
        stop_at_part: bool = False, env_extra: dict | None = None, commit_seconds: float | None = None) -> dict:
    """Run dspine-batch; sample RSS every 0.5 s; optionally time until part number ``watch_parts`` appears
    (``stop_at_part``: then kill it, its peak RSS read first)."""
    env = dict(os.environ, DSPINE_BATCH_PROGRESS="log", DSPINE_BATCH_LOG_INTERVAL="5",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", *args, "-o", str(out), "--engine", "scripted",
           "--engine-arg", "zero_cost=1", "--raw", "--max-in-flight", "1024", "--commit-rows", str(commit_rows),
           *(["--commit-seconds", str(commit_seconds)] if commit_seconds else [])]
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # stderr to a file, not a pipe: a run of hours logs more than a pipe holds, and nothing reads it meanwhile
    log = tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen(cmd, env=env, stderr=log, text=True)
    samples, first_new_part, peak = [], None, None
    while p.poll() is None:
        r = status_mb(p.pid)
        if r:
            samples.append((round(time.perf_counter() - t0, 2), round(r, 1)))
        if watch_parts is not None and first_new_part is None and out.exists():
            if len([n for n in os.listdir(out) if n.endswith(".parquet")]) > watch_parts:
                first_new_part = time.perf_counter() - t0
                if stop_at_part:
                    peak = status_mb(p.pid, "VmHWM")
                    p.kill()
                    break
        time.sleep(0.02 if watch_parts is not None else 0.5)
    wall = time.perf_counter() - t0
    p.wait()
    log.seek(0)
    err = log.read()
    log.close()
    if not stop_at_part and p.returncode != 0:
        raise SystemExit(f"dspine-batch failed ({p.returncode}):\n{err}")
    m = re.search(r"already committed in \d+ parts(?:, checked)? \(([\d.]+)s\)", err)
    committed = re.search(r"resuming: ([\d,]+) rows already committed", err)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime - cpu0.ru_utime) + (usage.ru_stime - cpu0.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "rss_samples_mb": samples, "peak_rss_mb_children": usage.ru_maxrss / 1024,
            "done_set_s": float(m.group(1)) if m else None, "first_new_part_s": first_new_part, "log": err,
            "peak_rss_mb": peak, "committed": int(committed.group(1).replace(",", "")) if committed else None}


def committed_outdir(tmp: Path, rows: int) -> tuple[Path, Path, int]:
    """An input of ``rows`` + 100k rows and an OUTDIR of one shard with exactly ``rows`` of them committed (all
    committed, then the last 100k-row part and its record dropped); returns (input, OUTDIR, parts left). One built
    before in the same ``--tmp`` (``--keep``) is used again: 100M rows take most of an hour to commit."""
    src = tmp / f"scale-{rows}.parquet"
    ready = tmp / f"scale-{rows}.ready"
    out = tmp / f"scale-{rows}-out"
    if ready.exists():
        return src, out, int(ready.read_text())
    make_input(src, rows + 100_000)
    run([str(src)], out, commit_seconds=86400)  # parts of exactly 100k rows
    last = sorted(n for n in os.listdir(out) if n.endswith(".parquet"))[-1]
    os.unlink(out / last)
    stem = last.removeprefix("train-").removesuffix(".parquet")
    for sidecar in (f"keys-{stem}.npy", f"commit-{stem}.json"):
        if (out / "_dspine" / "keys" / sidecar).exists():
            (out / "_dspine" / "keys" / sidecar).unlink()
    (out / "_SUCCESS").unlink()
    parts = sorted(str(out / n) for n in os.listdir(out) if n.endswith(".parquet"))
    # the state file as the last commit left it (a kill -9 between commits): its totals those of the parts kept
    # (read once here; a start whose state disagrees with the parts reads every part for them)
    sys.path.insert(0, str(ROOT))
    from dspine_batch.run.sink import committed_tallies

    state_path = out / "_dspine" / "state-00000-of-00001.json"
    state = json.loads(state_path.read_text())
    kept = committed_tallies(parts)
    state.update(rows_done=kept.rows, error_rows=kept.error_rows, totals=kept.totals(), next_seq=len(parts),
                 state="interrupted")
    state_path.write_text(json.dumps(state))
    ready.write_text(str(len(parts)))
    return src, out, len(parts)


def _files(out: Path) -> set[Path]:
    return {p for p in out.rglob("*") if p.is_file()}


def resume_scale(tmp: Path, sizes: list[int], repeats: int, paths: list[str] | None = None,
                 keep: bool = False) -> list[dict]:
    """Resume by the full done-set and by the watermarks, alternating, on the same committed OUTDIR (``paths``:
    only those; ``keep``: the committed OUTDIR and its input stay for the next run)."""
    rows_out = []
    for n in sizes:
        t = time.perf_counter()
        src, out, parts = committed_outdir(tmp, n)
        print(f"scale {n:,}: committed in {time.perf_counter() - t:.0f}s ({parts} parts)", file=sys.stderr)
        keep = _files(out)
        state = {p: p.read_bytes() for p in keep if "/state-" in str(p)}
        got: dict[str, list[dict]] = {"full done-set": [], "watermarks": []}
        order = [(label, flag) for label, flag in (("full done-set", "0"), ("watermarks", "1"))
                 if paths is None or label.split()[0] in paths]
        if repeats == 0:
            print(f"scale {n:,}: built; kept in {out}", file=sys.stderr)
            continue
        for rep in range(repeats):
            for label, flag in (order if rep % 2 == 0 else order[::-1]):
                load = os.getloadavg()[0]
                r = run([str(src)], out, watch_parts=parts, commit_rows=1000, stop_at_part=True,
                        env_extra={"DSPINE_BATCH_WATERMARKS": flag})
                for p in _files(out) - keep:  # as if this resume never ran
                    p.unlink()
                for p, body in state.items():
                    p.write_bytes(body)
                first = round(r["first_new_part_s"], 2) if r["first_new_part_s"] else None
                got[label].append({"committed": r["committed"], "done_set_s": r["done_set_s"],
                                   "first_new_part_s": first, "peak_rss_mb": round(r["peak_rss_mb"] or 0),
                                   "load_1min": round(load, 2)})
                print(f"scale {n:,} {label}: {got[label][-1]}", file=sys.stderr)
        rows_out.append({"committed_rows": n, "parts": parts, **got})
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
            src.unlink()
            (tmp / f"scale-{n}.ready").unlink()
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--resume-rows", type=int, default=1_000_000)
    ap.add_argument("--tmp", default=None, help="work dir (default: a temp dir, deleted afterwards)")
    ap.add_argument("--resume-scale", default="", help="committed rows to resume over, comma-separated (issue 56)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each resume path in --resume-scale")
    ap.add_argument("--only-scale", action="store_true", help="only --resume-scale (skip throughput and resume)")
    ap.add_argument("--scale-paths", default="full,watermarks",
                    help="resume paths in --resume-scale, comma-separated: full (the done-set before watermarks), "
                         "watermarks")
    ap.add_argument("--keep", action="store_true",
                    help="keep --resume-scale's committed OUTDIRs in --tmp, used again (--repeats 0: build only)")
    a = ap.parse_args()
    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="bench_pipeline_"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict = {"rows": a.rows, "resume_rows": a.resume_rows, "cpus": os.cpu_count()}
    try:
        if a.resume_scale:
            results["resume_scale"] = resume_scale(tmp, [int(x) for x in a.resume_scale.split(",")], a.repeats,
                                                   a.scale_paths.split(","), a.keep)
        if a.only_scale:
            print(json.dumps(results, indent=2))
            return
        big = tmp / "input.parquet"
        t = time.perf_counter()
        make_input(big, a.rows)
        print(f"input: {a.rows:,} rows in {time.perf_counter() - t:.1f}s ({big.stat().st_size / 1e6:.0f} MB)",
              file=sys.stderr)
        r = run([str(big)], tmp / "out")
        samples = r["rss_samples_mb"]
        n = len(samples)
        results["throughput_rows_per_s"] = round(a.rows / r["wall_s"])
        results["throughput_wall_s"] = round(r["wall_s"], 1)
        # rows per CPU-second of the pipeline process: what one free core sustains (wall time includes
        # start-up and any other load on the machine)
        results["throughput_rows_per_cpu_s"] = round(a.rows / r["cpu_s"])
        results["load_average_1min"] = os.getloadavg()[0]
        results["peak_rss_mb"] = round(r["peak_rss_mb_children"])
        results["rss_mb_at_10_50_90_pct"] = [samples[int(n * q)][1] for q in (0.1, 0.5, 0.9)] if n else None
        print(r["log"], file=sys.stderr)
        shutil.rmtree(tmp / "out")

        # resume: commit resume_rows + 100k, drop the last 100k-row part -> exactly resume_rows committed
        small = tmp / "resume.parquet"
        make_input(small, a.resume_rows + 100_000)
        out = tmp / "resume_out"
        run([str(small)], out)
        last = sorted(n for n in os.listdir(out) if n.endswith(".parquet"))[-1]
        os.unlink(out / last)
        stem = last.removeprefix("train-").removesuffix(".parquet")  # and its sidecars: as if never committed
        for sidecar in (f"keys-{stem}.npy", f"commit-{stem}.json"):
            if (out / "_dspine" / "keys" / sidecar).exists():
                (out / "_dspine" / "keys" / sidecar).unlink()
        (out / "_SUCCESS").unlink()
        parts_left = len([n for n in os.listdir(out) if n.endswith(".parquet")])
        r = run([str(small)], out, watch_parts=parts_left, commit_rows=1000)  # first new part: 1000 rows
        results["resume_done_set_s"] = r["done_set_s"]
        results["resume_first_new_part_s"] = round(r["first_new_part_s"], 2) if r["first_new_part_s"] else None
        results["resume_total_wall_s"] = round(r["wall_s"], 2)
        print(r["log"], file=sys.stderr)
    finally:
        if not a.tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
