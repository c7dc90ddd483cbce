#!/usr/bin/env python
"""Requests the dedup key log costs at many shards, with and without blocks (``stages/keylog.py``).

A simulation of the protocol itself (``KeyLog``'s own code) over an in-memory store with an object store's
create-only semantics (a local disk at 256 shards is ~500k small files read: minutes, for the same counts):
``--shards`` writers take turns, each
reading what the others appended since its last part and then appending its part's entry (the steady state of a
wide job, every shard busy), ``--parts`` each; then a requeued shard reads the whole log from the start. It counts
the store requests (GETs and create-only writes) a part costs and the requeued start's, with blocks (the default)
and with ``blocks=False`` (entries only, as before blocks). Counts, not times: they are what an object store bills.

Usage:
    python scripts/bench/bench_keylog.py --shards 8 64 256 --parts 8
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspine_batch.stages.keylog import Entry, KeyLog  # noqa: E402


@dataclass
class MemoryStore:
    """Objects in a dict: ``get`` (None when absent) and ``create`` (False when the name is taken)."""

    objects: dict[str, bytes] = field(default_factory=dict)

    def get(self, name: str) -> bytes | None:
        return self.objects.get(name)

    def create(self, name: str, data: bytes) -> bool:
        if name in self.objects:
            return False
        self.objects[name] = data
        return True


@dataclass
class MemoryOutput:
    store: MemoryStore = field(default_factory=MemoryStore)


def simulate(shards: int, parts: int, blocks: bool) -> dict:
    out = MemoryOutput()
    logs = [KeyLog(out, blocks=blocks) for _ in range(shards)]
    for n in range(shards * parts):
        log = logs[n % shards]
        log.read_new()
        assert log.append(Entry(f"{n % shards}", np.arange(3, dtype=np.uint64) + 3 * n,
                                [f"{n:016x}{j:016x}" for j in range(3)]))
    steady = sum(sum(log.requests.values()) for log in logs)
    requeued = KeyLog(out, blocks=blocks)
    got = requeued.read_new()
    assert len(got) == shards * parts and all(e is not None for e in got)
    return {"requests_per_part": round(steady / (shards * parts), 1),
            "requeued_start_requests": sum(requeued.requests.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--parts", type=int, default=8, help="parts each shard commits")
    a = ap.parse_args()
    rows = []
    for shards in a.shards:
        row = {"shards": shards, "entries": shards * a.parts}
        for label, blocks in (("entries only", False), ("blocks", True)):
            row[label] = simulate(shards, a.parts, blocks)
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
