"""What a dedup decision costs across shards (``dspine_batch.stages.keylog``): one entry a committed part, holding
the part's kept keys (exact) or their MinHash signatures (minhash), appended to the stage's key log, then read by
another shard. Times ``--parts`` entries of ``--rows`` kept rows each, written by one shard and read by another,
on a local directory and, with ``--url``, on an object store (an ``s3://`` / ``az://`` prefix, credentials from
the environment as for a job). Before the key log, each kept row was one create-only claim object (nine for a
minhash row): see BENCHMARKS.md, issue 56.

    python scripts/bench/bench_claims.py --parts 20 --rows 1000
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python scripts/bench/bench_claims.py --url s3://bucket/claims
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from machine import cpu_line, load_line  # noqa: E402

from dspine_batch.outdir.output import open_output  # noqa: E402
from dspine_batch.stages.keylog import EXACT_SPACE, NEAR_SPACE, Entry, KeyLog  # noqa: E402


def timed(where: str, space: str, parts: int, rows: int) -> tuple[float, float, int]:
    """(ms to append one entry, ms to read one, bytes of one) for entries of ``rows`` kept rows."""
    rng = np.random.default_rng(0)
    entries = [Entry("00000-of-00002", rng.integers(0, 2**63, rows, dtype=np.uint64),
                     [uuid.uuid4().hex[:24] for _ in range(rows)],
                     rng.integers(0, 2**32, (rows, 128), dtype=np.uint32) if space == NEAR_SPACE else None)
               for _ in range(parts)]
    writer, reader = KeyLog(open_output(where), space), KeyLog(open_output(where), space)
    t0 = time.perf_counter()
    for e in entries:
        assert writer.append(e)
    t1 = time.perf_counter()
    got = reader.read_new()
    t2 = time.perf_counter()
    assert len(got) == parts
    return (t1 - t0) / parts * 1e3, (t2 - t1) / parts * 1e3, len(entries[0].encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1000, help="kept rows a part")
    ap.add_argument("--url", default=None, help="an object-store prefix to write the log under as well")
    args = ap.parse_args()
    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    for space in (EXACT_SPACE, NEAR_SPACE):
        with tempfile.TemporaryDirectory(dir=str(REPO)) as d:
            wheres = [d] + ([f"{args.url.rstrip('/')}/{uuid.uuid4().hex[:8]}"] if args.url else [])
            for where in wheres:
                put, get, size = timed(where, space, args.parts, args.rows)
                print(f"{space} on {open_output(where).display}: {put:.2f} ms to append a part's entry "
                      f"({args.rows} kept rows, {size:,} bytes), {get:.2f} ms to read one", flush=True)


if __name__ == "__main__":
    main()
