"""Near-duplicate dedup (``dedup = "minhash"``): MinHash signatures of word n-grams, banded for LSH.

A row's text is cut into word n-grams (case folded, punctuation dropped), hashed into a MinHash signature
(datasketch's, ``NUM_PERM`` permutations), and its signature split into the bands datasketch picks for the
threshold (``MinHashLSH``'s own choice of bands and rows, weighing false positives and negatives alike). Two texts
whose Jaccard similarity reaches the threshold share a band with high probability; a shared band makes them
candidates, and the row is a duplicate when its signature's estimate of the Jaccard similarity with the
candidate's reaches the threshold.

The band index does not live in memory: each band of a kept row is a create-only claim (``claims``) under the
stage's output, carrying the row's signature, so the index is shared by every shard and a stage's memory does not
grow with the job. A row claims its bands in one order (sorted band keys) and stops at the first band held by a
near-duplicate, giving up what it claimed: of two near-duplicates decided at the same moment on two shards, the
one that wins the first band they share is kept, the other finds it there. A band held by a row that is no near
duplicate (an LSH false positive) is a chain: the row takes the band's next free slot, so the band keeps every
row that shares it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from functools import cache

import numpy as np

from dspine_batch.errors import UsageError

NUM_PERM = 128
CHAIN = 64  # slots a band may take (``rows.Judge._near_claimed``): rows sharing it without being near duplicates
SEED = 1  # fixed: a signature must mean the same on every shard and every resume
_WORD = re.compile(r"\w+")


def need_datasketch() -> None:
    """Refuse ``dedup = "minhash"`` before the model loads when its library is missing."""
    try:
        import datasketch  # noqa: F401
    except ImportError:
        raise UsageError('dedup = "minhash" needs the datasketch package: pip install \'dspine-batch[minhash]\'') \
            from None


@dataclass(frozen=True)
class Bands:
    """How a signature is cut: ``count`` bands of ``rows`` values each."""

    count: int
    rows: int


@cache
def bands_for(threshold: float) -> Bands:
    """datasketch's choice of bands for ``threshold`` at ``NUM_PERM`` permutations."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
    return Bands(lsh.b, lsh.r)


def signature(text: str, ngram: int) -> np.ndarray:
    """The MinHash signature (uint32 values) of ``text``'s word n-grams (the whole text when it is shorter)."""
    from datasketch import MinHash

    words = _WORD.findall(text.casefold())
    grams = {" ".join(words[i:i + ngram]) for i in range(max(len(words) - ngram + 1, 1))}
    m = MinHash(num_perm=NUM_PERM, seed=SEED)
    m.update_batch([g.encode() for g in grams])
    return m.hashvalues.astype(np.uint32)


def band_keys(sig: np.ndarray, bands: Bands) -> list[str]:
    """One key per band (its index and values hashed), sorted: the order every row claims them in."""
    keys = []
    for b in range(bands.count):
        chunk = sig[b * bands.rows:(b + 1) * bands.rows]
        keys.append(hashlib.blake2b(bytes([b]) + chunk.tobytes(), digest_size=12).hexdigest())
    return sorted(keys)


def encode(sig: np.ndarray) -> str:
    return base64.b64encode(sig.astype("<u4").tobytes()).decode()


def decode(note: str) -> np.ndarray | None:
    try:
        sig = np.frombuffer(base64.b64decode(note, validate=True), dtype="<u4")
    except ValueError:
        return None
    return sig if sig.size == NUM_PERM else None


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The signatures' estimate of the two texts' Jaccard similarity."""
    return float(np.mean(a == b))


def digest(sig: np.ndarray) -> str:
    """A short name of a signature (the ``dedup_key`` column of a near-duplicate stage)."""
    return hashlib.blake2b(sig.astype("<u4").tobytes(), digest_size=12).hexdigest()
