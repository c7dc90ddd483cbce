"""Static sharding: ``--shard I/N`` owns the rows whose row-id hash is I modulo N.

Hashing the row id (not the position) keeps the partition stable when inputs are re-read, and a row and
all its samples always land in the same shard. Without ``--shard`` the shard comes from the array job that
started the process: Slurm (SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT), a Kubernetes Indexed Job
(JOB_COMPLETION_INDEX, which Kubernetes sets, over JOB_COMPLETIONS, which the manifest sets to the same number as
``completions``: Kubernetes does not expose the count) or an AWS Batch array job (AWS_BATCH_JOB_ARRAY_INDEX over
AWS_BATCH_JOB_ARRAY_SIZE, the array size given to the job as an environment variable). SLURM_RESTART_COUNT or
AWS_BATCH_JOB_ATTEMPT - 1 becomes the ``attempt`` column.
"""

from __future__ import annotations

import os
import re

from dspine_batch.errors import UsageError
from dspine_batch.outdir.layout import shard_tag


def parse_shard(spec: str | None, env: dict[str, str] | None = None) -> tuple[int, int]:
    env = dict(os.environ) if env is None else env
    if not spec:
        spec = _array_shard(env)
        if spec is None:
            return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m:
        raise UsageError(f"--shard {spec!r}: expected I/N, e.g. 0/8")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {spec!r}: need 0 <= I < N")
    return i, n


ARRAYS = (("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "Slurm"),
          ("JOB_COMPLETION_INDEX", "JOB_COMPLETIONS", "Kubernetes Indexed Job"),
          ("AWS_BATCH_JOB_ARRAY_INDEX", "AWS_BATCH_JOB_ARRAY_SIZE", "AWS Batch array job"))


def _array_shard(env: dict[str, str]) -> str | None:
    """``I/N`` from the first array-job environment found, None outside any. An index without its count is one
    line saying which variable to set (guessing N would split the rows wrongly)."""
    for index, count, what in ARRAYS:
        if index not in env or (what == "Slurm" and count not in env):  # Slurm: as before, both or neither
            continue
        if not env.get(count):
            raise UsageError(f"{index} is set ({what}) but {count} is not: set {count} to the number of array "
                             "tasks, or pass --shard I/N")
        try:
            i = int(env[index]) - (int(env.get("SLURM_ARRAY_TASK_MIN", "0") or 0) if index.startswith("SLURM") else 0)
        except ValueError:
            raise UsageError(f"{index}={env[index]!r}: not an integer") from None
        return f"{i}/{env[count]}"
    return None


def attempt_from_env(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    try:
        if env.get("SLURM_RESTART_COUNT"):
            return int(env["SLURM_RESTART_COUNT"])
        return max(0, int(env.get("AWS_BATCH_JOB_ATTEMPT", "1") or 1) - 1)
    except ValueError:
        return 0


__all__ = ["attempt_from_env", "parse_shard", "shard_tag"]
