"""Where things live under an object-store OUTDIR prefix (``remote`` writes them, ``remote_supersede`` and
``remote_compact`` rewrite them): the names they all need, and how a commit record carries its row keys, so none
imports another's logic."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from dspine_batch.pipeline.sink import PART_PREFIX, keys_checksum

STATE = "_dspine"
STAGING = f"{STATE}/staging"
KEYS = f"{STATE}/keys"
DAMAGED = f"{STATE}/damaged"
SUCCESS = "_SUCCESS"


def stem(name: str) -> str:
    """``train-X.parquet`` -> ``X``."""
    return name.removeprefix(PART_PREFIX).removesuffix(".parquet")


def record_rel(name: str) -> str:
    """A part's commit record: ``_dspine/keys/commit-X.json``."""
    return f"{KEYS}/commit-{stem(name)}.json"


def keys_fields(keys: np.ndarray) -> dict[str, Any]:
    """A part's row-key hashes as its commit record carries them (one request fewer per part, one GET a part on
    resume): the little-endian bytes in base64 and their crc32."""
    keys = np.ascontiguousarray(keys, dtype="<u8")
    return {"keys_b64": base64.b64encode(keys.view(np.uint8)).decode(), "keys_crc32": keys_checksum(keys)}


def record_keys(record: dict[str, Any]) -> np.ndarray | None:
    """A commit record's row-key hashes when they check out (``rows`` of them, matching the recorded crc32), else
    None: then the part's row ids are read instead. A doubtful list is never trusted, nor blessed by a new record
    (a compaction's or a retry's), as ``sink.load_keys`` rules for a local key file."""
    if not isinstance(record.get("keys_b64"), str):
        return None
    try:
        keys = np.frombuffer(base64.b64decode(record["keys_b64"]), dtype="<u8")
    except ValueError:
        return None
    if len(keys) != record.get("rows") or keys_checksum(keys) != record.get("keys_crc32"):
        return None
    return keys
