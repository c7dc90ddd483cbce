"""A compact set of 64-bit row-key hashes: the done-set on resume and the seen-set for duplicate ids.

Python sets of strings cost ~100 bytes a key, which breaks "memory bounded by in-flight work" on inputs with
tens of millions of rows. This keeps sorted numpy runs (8 bytes a key, log-structured merges) and answers
membership for a whole batch at once. A 64-bit collision among 10M keys has probability ~3e-6; ``finalize``
checks coverage on the exact strings, so a collision can never pass silently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

_RUN = 1 << 16


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def index_hashes(name: str, indices: Iterable[int] | np.ndarray) -> np.ndarray:
    """Hashes of the fallback row ids ``<name>:<index>`` without building the strings: splitmix64 of the
    index mixed with the file's hash, vectorized (resume skips millions of committed rows at numpy speed).
    A bijection per file, so ids of one file never collide. Used when the run has no id column."""
    idx = np.asarray(indices, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(key_hash(name)) ^ (idx * _GOLDEN)
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def fallback_id_hashes(row_ids: Iterable[str]) -> np.ndarray:
    """``index_hashes`` for already-built ``<name>:<index>`` strings (resume without key files)."""
    out = []
    for rid in row_ids:
        name, _, index = rid.rpartition(":")
        out.append(int(index_hashes(name, [int(index)])[0]))
    return np.array(out, dtype=np.uint64)


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def key_hashes(keys: Iterable[str]) -> np.ndarray:
    b2 = hashlib.blake2b
    digests = b"".join([b2(k.encode("utf-8", "surrogatepass"), digest_size=8).digest() for k in keys])
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique without numpy 2's hash path (several times slower for 1M uint64 here)."""
    a = np.sort(a)
    if len(a) < 2:
        return a
    keep = np.empty(len(a), dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


class KeySet:
    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []  # sorted, unique, sizes roughly decreasing
        self._pending: set[int] = set()

    def __len__(self) -> int:
        return sum(len(r) for r in self._runs) + len(self._pending)

    def add(self, h: int) -> None:
        self._pending.add(h)
        if len(self._pending) >= _RUN:
            self._flush()

    def add_many(self, hashes: np.ndarray) -> None:
        if len(hashes):
            self._push(_sorted_unique(hashes.astype(np.uint64)))

    def __contains__(self, h: int) -> bool:
        if h in self._pending:
            return True
        x = np.uint64(h)
        for run in self._runs:
            i = int(np.searchsorted(run, x))
            if i < len(run) and run[i] == x:
                return True
        return False

    def contains_many(self, hashes: np.ndarray) -> np.ndarray:
        hashes = hashes.astype(np.uint64)
        found = np.zeros(len(hashes), dtype=bool)
        for run in self._runs:
            idx = np.searchsorted(run, hashes)
            idx[idx == len(run)] = 0
            found |= run[idx] == hashes if len(run) else False
        if self._pending:
            found |= np.fromiter((int(h) in self._pending for h in hashes), dtype=bool, count=len(hashes))
        return found

    def _flush(self) -> None:
        if self._pending:
            run = np.fromiter(self._pending, dtype=np.uint64, count=len(self._pending))
            self._pending = set()
            self._push(np.sort(run))

    def _push(self, run: np.ndarray) -> None:
        self._runs.append(run)
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            b = self._runs.pop()
            a = self._runs.pop()
            self._runs.append(_sorted_unique(np.concatenate([a, b])))
