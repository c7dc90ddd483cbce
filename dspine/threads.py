"""CPU thread hygiene: use the cores this process may use, and never spin against other processes.

Why: torch's OpenMP runtime (GNU libgomp in the CPU wheels) busy-waits between parallel regions by default.
On a shared machine (Slurm nodes, overlapping cron jobs) those spinning threads compete with the other
processes for the same cores and a decode collapses instead of slowing down in proportion: one decode took
323 s with the default policy and 48 s with ``OMP_WAIT_POLICY=PASSIVE`` beside two CPU-bound processes.
libgomp reads the policy once, when it is loaded (at ``import torch``), so :func:`prepare_env` must run
before that; it only fills in variables the user did not set.

The thread count is the smallest of: the CPUs in this process's affinity mask, the cgroup CPU quota
(containers, systemd slices), and Slurm's ``SLURM_CPUS_PER_TASK``; torch's own default honours only the
first. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

WAIT_POLICY = "PASSIVE"


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, Slurm's binding), else the machine's CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") -> CPUs allowed, None when unlimited."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    quota = int(parts[0])
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` -> CPUs allowed, None when unlimited (-1)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup directory and its ancestors up to ``root`` (a quota anywhere above applies)."""
    rels: list[str] = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            fields = line.split(":", 2)
            if len(fields) == 3 and (fields[0] == "0" or "cpu" in fields[1].split(",")):
                rels.append(fields[2].strip("/"))
    except OSError:
        pass
    dirs: list[Path] = []
    for rel in rels:
        parts = [p for p in rel.split("/") if p]
        for i in range(len(parts), -1, -1):
            for base in (root, root / "cpu", root / "cpu,cpuacct"):
                d = base.joinpath(*parts[:i])
                if d not in dirs:
                    dirs.append(d)
    for base in (root, root / "cpu", root / "cpu,cpuacct"):
        if base not in dirs:
            dirs.append(base)
    return dirs


def cgroup_cpus(root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota of this process's cgroup and its ancestors (v2 or v1), None when there is none."""
    limits: list[float] = []
    for d in _cgroup_dirs(Path(root), Path(proc_cgroup)):
        try:
            if (d / "cpu.max").is_file():
                lim = parse_cpu_max((d / "cpu.max").read_text())
            elif (d / "cpu.cfs_quota_us").is_file():
                lim = parse_cfs((d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text())
            else:
                continue
        except (OSError, ValueError):
            continue
        if lim is not None:
            limits.append(lim)
    return min(limits) if limits else None


def slurm_cpus(environ: MutableMapping[str, str] | None = None) -> int | None:
    """``SLURM_CPUS_PER_TASK`` when this runs inside a Slurm allocation that sets it, else None."""
    env = os.environ if environ is None else environ
    value = env.get("SLURM_CPUS_PER_TASK", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def available_cpus(
    affinity: int | None = None,
    cgroup: float | None = None,
    slurm: int | None = None,
    *,
    probe: bool = True,
) -> int:
    """Cores this process may use: min(affinity, ceil(cgroup quota), Slurm's cpus-per-task), at least 1.

    With ``probe`` (the default) the missing inputs are read from this machine; tests pass them explicitly
    with ``probe=False``.
    """
    if probe:
        affinity = affinity_cpus() if affinity is None else affinity
        cgroup = cgroup_cpus() if cgroup is None else cgroup
        slurm = slurm_cpus() if slurm is None else slurm
    limits = [n for n in (affinity, slurm) if n]
    if cgroup:
        limits.append(max(1, math.ceil(cgroup - 1e-9)))
    return max(1, min(limits)) if limits else 1


def prepare_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Fill in ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy (or tuned ``GOMP_SPINCOUNT``).

    Call before torch is imported: its OpenMP runtime reads the policy once, at load (:func:`torch_loaded` says
    whether it is too late in this process). The thread count is not put in the environment, where it would
    also bind engines that manage their own worker processes (SGLang); :func:`configure_torch` sets it.
    Returns what it set.
    """
    env = os.environ if environ is None else environ
    changed: dict[str, str] = {}
    if not env.get("OMP_WAIT_POLICY") and not env.get("GOMP_SPINCOUNT"):
        changed["OMP_WAIT_POLICY"] = WAIT_POLICY
    env.update(changed)
    return changed


def torch_loaded() -> bool:
    return "torch" in sys.modules


def configure_torch(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads`` (default: :func:`available_cpus`); returns the count used.

    An explicit ``OMP_NUM_THREADS`` from the user wins over the default, as torch itself would do.
    """
    import torch

    if threads is None:
        user = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(user) if user.isdigit() and int(user) > 0 else available_cpus()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def describe() -> dict[str, object]:
    """What a manifest should record about threading: the count in use and the OpenMP wait policy."""
    out: dict[str, object] = {"wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default"}
    if torch_loaded():
        import torch

        out["threads"] = torch.get_num_threads()
    return out
