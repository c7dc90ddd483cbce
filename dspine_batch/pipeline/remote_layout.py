"""Where things live under an object-store OUTDIR prefix (``remote`` writes them, ``remote_supersede`` rewrites
them): the names both need, so neither imports the other's logic."""

from __future__ import annotations

from dspine_batch.pipeline.sink import PART_PREFIX

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
