#!/usr/bin/env python
"""Peak memory and speed of ``dspine-batch export --format openai`` on a large synthetic OUTDIR.

The OUTDIR is written by the pipeline's own part writer (``PartSink``: real parts, commit records, manifest),
``--rows`` rows of one or more samples with ~200-character outputs (every 10th row with a tool call, every
20th a failed row), committed ``--commit-rows`` at a time. Then ``dspine-batch export`` runs as a subprocess on
it and on a 1,000-row OUTDIR of the same shape; the two peak RSS figures side by side show whether memory grows
with the row count (it must not: parts are streamed a record batch at a time).

Usage:
    python scripts/bench/bench_export.py                  # 1,000,000 rows
    python scripts/bench/bench_export.py --rows 100000 --samples 2
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_line, load_line  # noqa: E402

from dspine_batch.engines.base import Result  # noqa: E402
from dspine_batch.outdir.output import open_output  # noqa: E402
from dspine_batch.outdir.schema import output_schema  # noqa: E402
from dspine_batch.requests.mapping import WorkItem  # noqa: E402
from dspine_batch.run.fingerprint import build_manifest  # noqa: E402
from dspine_batch.run.sink import PartSink  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog while the committee reviews row {i}; the answer, after "
        "careful thought, is {j}. Everything else stays as it was, and the report is filed by Friday.")
CALL = json.dumps([{"id": "call_x", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}])


def make_outdir(outdir: Path, rows: int, samples: int, commit_rows: int) -> None:
    outdir.mkdir(parents=True)
    schema = output_schema([], False)
    manifest = open_output(str(outdir)).create_or_check(
        build_manifest({"bench": "export"}, {"model": "bench", "num_samples": samples}, 1, schema.names))
    schema = schema.with_metadata({"dspine_batch.run.fingerprint": json.dumps({"fingerprint":
                                                                                 manifest["fingerprint"]})})
    sink = PartSink(str(outdir), schema, "00000-of-00001", 0, samples, commit_rows, 1e9, 0, lambda s: None)
    for i in range(rows):
        rid = f"row-{i:08d}"
        item = WorkItem(rid, [], None, "in.jsonl: row 3, field 'prompt': empty prompt" if i % 20 == 19 else None,
                        row_hash=i)
        if item.error:
            sink.add(item, None)
        else:
            results = [Result(rid, s, [], TEXT.format(i=i, j=s), "tool_calls" if i % 10 == 3 else "stop", 40, 48,
                              tool_calls=CALL if i % 10 == 3 else None) for s in range(samples)]
            sink.add(item, results)
        if sink.due():
            sink.commit()
    sink.commit()


def run_export(outdir: Path, dest: Path) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of ``dspine-batch export`` in a fresh process."""
    # VmHWM, not ru_maxrss: a forked child's ru_maxrss starts at its parent's RSS (this script holds the rows)
    code = ("import sys; from dspine_batch.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0].split()[1]\n"
            "    print('maxrss_kb', hwm, file=sys.stderr)\n"
            "    raise\n")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, "export", str(outdir), "--format", "openai", "-o", str(dest)],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(p.stderr)
    kb = int(p.stderr.rsplit("maxrss_kb", 1)[1].split()[0])
    return dt, kb / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--commit-rows", type=int, default=100_000)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-export-"))
    try:
        print(cpu_line())
        small, big = tmp / "small", tmp / "big"
        make_outdir(small, 1000, args.samples, 1000)
        t0 = time.perf_counter()
        make_outdir(big, args.rows, args.samples, args.commit_rows)
        size = sum(f.stat().st_size for f in big.glob("*.parquet"))
        print(f"outdir: {args.rows:,} rows x {args.samples} sample(s), {size / 2**20:.1f} MiB of parts, written in "
              f"{time.perf_counter() - t0:.1f}s")
        print(load_line())
        for name, d in (("1,000 rows", small), (f"{args.rows:,} rows", big)):
            dest = tmp / f"{d.name}.jsonl"
            dt, rss = run_export(d, dest)
            rows = sum(1 for _ in open(dest))
            print(f"export {name:>16}: {dt:7.1f}s, {rows / dt:10,.0f} lines/s, peak RSS {rss:6.1f} MiB, "
                  f"file {dest.stat().st_size / 2**20:8.1f} MiB")
        print(load_line())
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
