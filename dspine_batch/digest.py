"""Content digests of files: what a run's identity records of its inputs and of the model it loaded.

Its own module because both sides of the pipeline need it (``run.fingerprint`` for input files,
``engines.models`` for model directories) and neither may import the other.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

_SAMPLE = 1 << 20  # bytes hashed at the head and tail of each file
_MIDDLE_BLOCKS, _BLOCK = 16, 64 * 1024


def content_digest(path: str, opener: Callable[[str, str], Any] = open, size: int | None = None) -> str:
    """Hash of size + head + tail + evenly spaced blocks: catches edits, truncation and appends in O(1 MB)
    per file, so a resume check stays fast on 100 GB inputs. (Full hashing would make resume O(input).)
    ``opener``/``size``: how to read a file that is not local (an object-store URL: ranged reads)."""
    size = os.path.getsize(path) if size is None else size
    h = hashlib.sha256(str(size).encode())
    with opener(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            for i in range(1, _MIDDLE_BLOCKS + 1):
                f.seek(size * i // (_MIDDLE_BLOCKS + 1))
                h.update(f.read(_BLOCK))
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()[:32]
