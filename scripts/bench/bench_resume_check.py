#!/usr/bin/env python
"""What checking committed parts costs a resume (issue 24), and which checksum to use.

1. Checksum candidates over a 256 MiB buffer on one core: zlib.crc32 (the one used), zlib.adler32,
   hashlib.blake2b, hashlib.sha256; and what one 1,000-row commit (the default --commit-rows) costs, in CPU
   and wall milliseconds, here and in the ``--before`` checkout.
2. An OUTDIR of ``--rows`` committed rows (default 10M) in parts of ``--part-rows`` rows, written by the real
   commit path (``sink.write_part_atomically``: part, key file, commit record), with an ``output`` of about
   ``--output-chars`` characters of word-like text per row. Then, best of ``--repeat``:
   - ``footers``: stat + footer of every part against its record (``check_parts(checksum=False)``, what
     ``status`` does without ``--verify``);
   - ``full check``: the same plus the crc32 of every part's bytes (``check_parts()``);
   - ``load_done``: what a resume does before streaming (full check + key files -> done-set), this tree;
   - ``load_done --before ROOT``: the same call in another checkout (e.g. the code before this change, which
     reads footers and key files only), in a subprocess with ``PYTHONPATH=ROOT``.
   The parts were just written, so their pages are cached: that is the CPU cost. ``--drop-caches`` (root)
   empties the page cache before each timing, which adds reading them from disk.

The pipeline numbers (rows/s, resume start-up at 1M committed rows) come from ``scripts/bench/bench_pipeline.py``.

Usage:
    python scripts/bench/bench_resume_check.py                                  # 10M rows (~5 min, ~5 GB in /tmp)
    python scripts/bench/bench_resume_check.py --rows 1000000 --before /tmp/before
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dspine_batch.outdir.layout import part_name  # noqa: E402
from dspine_batch.outdir.output import open_output  # noqa: E402


def check_parts(outdir: str, tag: str, checksum: bool = True) -> list:
    return open_output(outdir).check_parts(tag, checksum)


def load_done(outdir: str, tag: str):  # noqa: ANN201
    return open_output(outdir).load_done(tag)


def write_part_atomically(outdir: str, name: str, table: pa.Table, keys: np.ndarray, rows: int) -> dict:
    return open_output(outdir).commit_part(name, table, keys, rows)

TAG = "00000-of-00001"
def vocabulary(size: int = 5000, seed: int = 1) -> np.ndarray:
    """Random lowercase words of 2-9 letters: ~12 bits a word, so zstd shrinks the outputs about as much as
    real model text (~3x), not 20x as a handful of repeated words would."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    return np.array(["".join(letters[rng.integers(0, 12 if i % 3 else 26, rng.integers(2, 10))]) for i in range(size)])


def checksum_speeds(mib: int = 256) -> dict[str, float]:
    """GiB/s of each candidate on one core, over random bytes (all four are data-independent in speed)."""
    data = os.urandom(mib << 20)
    out = {}
    for name, fn in (("crc32", zlib.crc32), ("adler32", zlib.adler32),
                     ("blake2b", lambda b: hashlib.blake2b(b).digest()),
                     ("sha256", lambda b: hashlib.sha256(b).digest())):
        best = min(_timed(fn, data) for _ in range(3))
        out[name] = round(mib / 1024 / best, 2)
    return out


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def part_table(rows: int, chars: int, seed: int = 0) -> pa.Table:
    """A part-shaped table: row ids, one sample each, word-like outputs (compress like text, ~3x with zstd)."""
    rng = np.random.default_rng(seed)
    n_words = max(1, chars // 6)
    vocab = vocabulary()
    words = vocab[rng.integers(0, len(vocab), size=(rows, n_words))]
    outputs = [" ".join(w) for w in words]
    t = pa.table({"row_id": [f"r{i:09d}" for i in range(rows)], "sample_index": pa.array([0] * rows, pa.int32()),
                  "output": outputs, "status": ["ok"] * rows,
                  "completion_tokens": pa.array(rng.integers(1, 2 * n_words, rows), pa.int32())})
    meta = {b"dspine_batch.part": json.dumps({"rows": rows, "error_rows": 0}).encode()}
    return t.replace_schema_metadata(meta)


def build(outdir: str, rows: int, part_rows: int, chars: int) -> tuple[int, float]:
    """Commit ``rows`` rows as parts through the real commit path; returns (bytes on disk, seconds)."""
    os.makedirs(outdir, exist_ok=True)
    table = part_table(part_rows, chars)
    t0 = time.perf_counter()
    size = 0
    for seq, start in enumerate(range(0, rows, part_rows)):
        n = min(part_rows, rows - start)
        t = table if n == part_rows else table.slice(0, n)
        keys = np.arange(start, start + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        size += write_part_atomically(outdir, part_name(TAG, seq), t, keys, rows=n)["bytes"]
    return size, time.perf_counter() - t0


COMMIT_COST = """
import json, os, sys, tempfile, time
import numpy as np, pyarrow as pa
try:
    from dspine_batch.outdir.output import open_output
    sink = None
except ImportError:  # a checkout from before the one protocol
    try:
        from dspine_batch.run import sink
    except ImportError:  # a checkout from before the package layout
        from dspine_batch import sink
t = pa.table({"row_id": [f"r{i}" for i in range(1000)], "output": ["word " * 40] * 1000, "n": list(range(1000))})
keys = np.arange(1000, dtype=np.uint64)
d = tempfile.mkdtemp(dir=sys.argv[1])
os.makedirs(os.path.join(d, "_dspine", "keys"))
wall, cpu0 = [], time.process_time()
for i in range(300):
    name = f"train-00000-of-00001-{i:06d}.parquet"
    t0 = time.perf_counter()
    if sink is None:
        open_output(d).commit_part(name, t, keys, 1000)
    elif hasattr(sink, "stage_part"):  # with commit records
        sink.write_part_atomically(d, name, t, keys, rows=1000)
    else:  # before them: key file, then the part
        sink.write_keys(d, name, keys)
        sink.write_part_atomically(d, name, t)
    wall.append(time.perf_counter() - t0)
print(json.dumps({"cpu_ms": (time.process_time() - cpu0) / 300 * 1000, "wall_ms_median": sorted(wall)[150] * 1000}))
"""


def commit_cost(root: str, tmp: Path) -> dict[str, float]:
    """CPU and median wall milliseconds of one 1,000-row commit (part + key file [+ record]), 300 commits, with
    ``dspine_batch`` imported from ``root`` (fsync waits are in the wall time, not the CPU time)."""
    out = subprocess.run([sys.executable, "-c", COMMIT_COST, str(tmp)], env=dict(os.environ, PYTHONPATH=root),
                         capture_output=True, text=True, check=True)
    return {k: round(v, 2) for k, v in json.loads(out.stdout).items()}


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def best_of(repeat: int, cold: bool, fn) -> float:
    times = []
    for _ in range(repeat):
        if cold:
            drop_caches()
        times.append(_timed(fn))
    return round(min(times), 3)


def load_done_elsewhere(root: str, outdir: str, repeat: int, cold: bool) -> float:
    """``load_done`` timed in a subprocess that imports dspine_batch from ``root``."""
    code = ("import importlib, sys, time\n"
            "try:\n    out = importlib.import_module('dspine_batch.outdir.output').open_output\n"
            "    load_done = lambda d, tag: out(d).load_done(tag)\n"
            "except ImportError:  # a checkout from before the one protocol\n"
            "    load_done = importlib.import_module('dspine_batch.pipeline.resume').load_done\n"
            f"t = time.perf_counter(); d = load_done({outdir!r}, {TAG!r}); print(time.perf_counter() - t, d.rows)")
    env = dict(os.environ, PYTHONPATH=root)
    times = []
    for _ in range(repeat):
        if cold:
            drop_caches()
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seconds, rows = out.stdout.split()
        times.append(float(seconds))
    return round(min(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--part-rows", type=int, default=100_000)
    ap.add_argument("--output-chars", type=int, default=1000, help="~250 tokens of output a row")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", help="another checkout whose load_done to time on the same OUTDIR")
    ap.add_argument("--drop-caches", action="store_true", help="cold page cache before each timing (root)")
    ap.add_argument("--tmp", default=None, help="work dir (default: a temp dir, deleted afterwards)")
    a = ap.parse_args()
    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="bench_resume_check_"))
    res: dict = {"rows": a.rows, "part_rows": a.part_rows, "output_chars": a.output_chars, "cpus": os.cpu_count(),
                 "cold_cache": a.drop_caches}
    try:
        res["checksum_gib_per_s_one_core"] = checksum_speeds()
        res["commit_1000_rows"] = commit_cost(str(ROOT), tmp)
        if a.before:
            res["commit_1000_rows_before"] = commit_cost(a.before, tmp)
        out = str(tmp / "out")
        size, secs = build(out, a.rows, a.part_rows, a.output_chars)
        res["parts"] = -(-a.rows // a.part_rows)
        res["output_bytes"] = size
        res["write_s"] = round(secs, 1)
        res["footers_s"] = best_of(a.repeat, a.drop_caches, lambda: check_parts(out, TAG, checksum=False))
        res["full_check_s"] = best_of(a.repeat, a.drop_caches, lambda: check_parts(out, TAG))
        res["full_check_gib_per_s"] = round(size / 2**30 / res["full_check_s"], 2)
        res["load_done_s"] = best_of(a.repeat, a.drop_caches, lambda: load_done(out, TAG))
        assert load_done(out, TAG).rows == a.rows
        if a.before:
            res["load_done_before_s"] = load_done_elsewhere(a.before, out, a.repeat, a.drop_caches)
        res["load_average_1min"] = round(os.getloadavg()[0], 2)
    finally:
        if not a.tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
