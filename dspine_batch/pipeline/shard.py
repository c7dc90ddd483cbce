"""Static sharding: ``--shard I/N`` owns the rows whose row-id hash is I modulo N.

Hashing the row id (not the position) keeps the partition stable when inputs are re-read, and a row and
all its samples always land in the same shard. Under a Slurm array the shard defaults to
SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT; SLURM_RESTART_COUNT becomes the ``attempt`` column.
"""

from __future__ import annotations

import os
import re

from dspine_batch.errors import UsageError


def parse_shard(spec: str | None, env: dict[str, str] | None = None) -> tuple[int, int]:
    env = dict(os.environ) if env is None else env
    if not spec:
        if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            base = int(env.get("SLURM_ARRAY_TASK_MIN", "0") or 0)
            spec = f"{int(env['SLURM_ARRAY_TASK_ID']) - base}/{env['SLURM_ARRAY_TASK_COUNT']}"
        else:
            return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m:
        raise UsageError(f"--shard {spec!r}: expected I/N, e.g. 0/8")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {spec!r}: need 0 <= I < N")
    return i, n


def shard_tag(i: int, n: int) -> str:
    return f"{i:05d}-of-{n:05d}"


def attempt_from_env(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0
