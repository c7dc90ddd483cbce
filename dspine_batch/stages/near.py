"""Near-duplicate dedup (``dedup = "minhash"``): MinHash signatures of word n-grams, banded for LSH.

A row's text is cut into word n-grams (case folded, punctuation dropped), hashed into a MinHash signature
(datasketch's, ``NUM_PERM`` permutations), and its signature split into the bands datasketch picks for the
threshold (``MinHashLSH``'s own choice of bands and rows, weighing false positives and negatives alike). Two texts
whose Jaccard similarity reaches the threshold share a band with high probability; a shared band makes them
candidates, and the row is a duplicate when its signature's estimate of the Jaccard similarity with the
candidate's reaches the threshold.

The band index is the job's, not the shard's: each part's kept rows go into the stage's key log (``keylog``) with
their signatures, every shard reads the others' entries, and a row is decided against every row kept before it in
the log's order (``rows.Judge``): a row is a duplicate when it shares a band with an earlier kept row whose
signature estimates their Jaccard similarity at the threshold or more. A band shared by rows that are no near
duplicates (an LSH false positive) keeps every one of them, so a third row near the second still finds it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache

import numpy as np

from dspine_batch.errors import UsageError

NUM_PERM = 128
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


def band_hashes(sig: np.ndarray, bands: Bands) -> list[int]:
    """One 64-bit hash per band (its index and values): rows sharing one are LSH candidates of each other."""
    out = []
    for b in range(bands.count):
        chunk = sig[b * bands.rows:(b + 1) * bands.rows]
        out.append(int.from_bytes(hashlib.blake2b(bytes([b]) + chunk.tobytes(), digest_size=8).digest(), "little"))
    return out


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The signatures' estimate of the two texts' Jaccard similarity."""
    return float(np.mean(a == b))


def digest(sig: np.ndarray) -> str:
    """A short name of a signature (the ``dedup_key`` column of a near-duplicate stage)."""
    return hashlib.blake2b(sig.astype("<u4").tobytes(), digest_size=12).hexdigest()
