"""What a dedup claim costs (``dspine_batch.stages.claims``): a sharded stage's exact dedup makes one per kept row,
``dedup = "minhash"`` one per LSH band of a kept row (9 at the default threshold). Times ``--n`` claims (each a
create-only write of a fresh key) and ``--n`` claims that meet an existing one (a duplicate's read), on a local
directory and, with ``--url``, on an object store (an ``s3://`` / ``az://`` prefix, credentials from the
environment as for a job).

    python scripts/bench/bench_claims.py --n 2000
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python scripts/bench/bench_claims.py --url s3://bucket/claims
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from machine import cpu_line, load_line  # noqa: E402

from dspine_batch.stages.claims import Claims, Owner  # noqa: E402


def timed(claims: Claims, n: int, tag: str) -> tuple[float, float]:
    """(ms per new claim, ms per claim that finds another's)."""
    keys = [uuid.uuid4().hex[:24] for _ in range(n)]
    t0 = time.perf_counter()
    for k in keys:
        claims.claim(k, Owner(tag, k))
    t1 = time.perf_counter()
    for k in keys:
        claims.claim(k, Owner("other", k))
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e3, (t2 - t1) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--url", default=None, help="an object-store prefix to claim under as well")
    args = ap.parse_args()
    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    with tempfile.TemporaryDirectory(dir=str(REPO)) as d:
        new, dup = timed(Claims(SimpleNamespace(path=d, remote=False)), args.n, "bench")
        print(f"local directory ({d}): {new:.3f} ms a new claim, {dup:.3f} ms a duplicate's", flush=True)
    if args.url:
        from dspine_batch.outdir.output import open_output

        out = open_output(args.url)
        new, dup = timed(Claims(out), args.n, "bench")
        print(f"{out.display}: {new:.3f} ms a new claim, {dup:.3f} ms a duplicate's", flush=True)


if __name__ == "__main__":
    main()
