"""CPU thread hygiene: use the cores this process may use, and only the cores nobody else is using.

Why: a decode step is ~150 short parallel regions, each ending in a barrier of all threads. On a shared
machine (Slurm nodes, overlapping cron jobs) a thread that the OS has descheduled holds every barrier up, and
a decode collapses instead of slowing down in proportion (one decode took 323 s beside two CPU-bound
processes instead of ~10 s). Passive OpenMP waiting (``OMP_WAIT_POLICY=PASSIVE``) softens the collapse but
makes every region pay a thread wake-up: on a quiet 2-core EPYC it halved the decode speed (31.8 vs 59.9 tok/s
for the embedded model, `scripts/bench/bench_contention.py`), slower even than one thread. So the wait policy is
left at libgomp's default (a short spin, then sleep) and :class:`Governor` changes torch's thread count while
the job runs: as many threads as there are cores this process is actually getting or could get (its own CPU
use plus the idle time of its CPUs, read from ``/proc``), one when the machine is crowded, all again when it
frees up.

The thread count is the smallest of: the CPUs in this process's affinity mask, the cgroup CPU quota
(containers, systemd slices), and Slurm's ``SLURM_CPUS_PER_TASK``; torch's own default honours only the
first. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path


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
    global _configured
    _configured = threads
    return threads


_configured: int | None = None


def configured_threads() -> int:
    """The count :func:`configure_torch` chose (what a :class:`Governor` may go back up to), else torch's."""
    if _configured is not None:
        return _configured
    import torch

    return torch.get_num_threads()


def describe() -> dict[str, object]:
    """What a manifest should record about threading: the count in use and the OpenMP wait policy."""
    out: dict[str, object] = {"wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default"}
    if torch_loaded():
        import torch

        out["threads"] = torch.get_num_threads()
    return out


# -- the governor ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    """One reading: wall and process CPU seconds, and the busy/idle jiffies of the CPUs this process may use."""

    wall: float
    process: float
    busy: int
    idle: int


def read_cpu_stat(cpus: set[int] | None, stat: str | Path = "/proc/stat") -> tuple[int, int]:
    """(busy, idle) jiffies summed over ``cpus`` (all when None) from ``/proc/stat``; idle includes iowait,
    busy includes steal (time a hypervisor gave to someone else is not ours to use)."""
    busy = idle = 0
    for line in Path(stat).read_text().splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        f = [int(x) for x in rest.split()]
        idle_j = f[3] + (f[4] if len(f) > 4 else 0)
        busy += sum(f[:8]) - idle_j
        idle += idle_j
    return busy, idle


def cores_available(prev: CpuSample, cur: CpuSample, ncpus: int) -> float | None:
    """Cores this process could use over the interval: its own CPU use plus its CPUs' idle time."""
    dwall = cur.wall - prev.wall
    jiffies = (cur.busy - prev.busy) + (cur.idle - prev.idle)
    if dwall <= 0 or jiffies <= 0:
        return None
    own = (cur.process - prev.process) / dwall
    idle = ncpus * (cur.idle - prev.idle) / jiffies
    return own + idle


class Governor:
    """Keeps torch's intra-op thread count at the cores this process can actually get, between 1 and ``most``.

    ``tick()`` is cheap and meant to be called every decoding round; at most once per ``interval_s`` it samples
    ``/proc`` and, when the same new count is wanted twice running (hysteresis), sets it. Off Linux (no
    ``/proc/stat``) or with ``most`` 1 it does nothing.
    """

    def __init__(self, most: int | None = None, interval_s: float = 0.5, set_threads=None, sample=None):
        import torch

        self.most = int(most or configured_threads())
        self.interval_s = interval_s
        self._set = set_threads or torch.set_num_threads
        try:
            self.cpus: set[int] | None = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = None
        self.ncpus = len(self.cpus) if self.cpus else (os.cpu_count() or 1)
        self._sample = sample or self._read
        self.threads = torch.get_num_threads()
        self.changes = 0
        self._prev: CpuSample | None = None
        self._want: int | None = None
        self.enabled = self.most > 1 and (sample is not None or Path("/proc/stat").exists())
        if self.enabled and self.threads != self.most:
            self._set(self.most)
            self.threads = self.most
        self._next = 0.0

    def restore(self) -> None:
        """Back to ``most`` threads (the end of a decode: the next one starts from the full count)."""
        if self.threads != self.most and self.enabled:
            self._set(self.most)
            self.threads = self.most

    def _read(self) -> CpuSample:
        busy, idle = read_cpu_stat(self.cpus)
        return CpuSample(time.monotonic(), time.process_time(), busy, idle)

    def tick(self, now: float | None = None) -> int:
        """Sample when due and adjust; returns the thread count in use."""
        if not self.enabled:
            return self.threads
        now = time.monotonic() if now is None else now
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        try:
            cur = self._sample()
        except (OSError, ValueError):
            self.enabled = False
            return self.threads
        prev, self._prev = self._prev, cur
        if prev is None:
            return self.threads
        avail = cores_available(prev, cur, self.ncpus)
        if avail is None:
            return self.threads
        want = max(1, min(self.most, int(avail + 0.3)))
        if want != self.threads and want == self._want:
            self.threads = want
            self._set(want)
            self.changes += 1
            self._prev = None  # the next interval measures the new setting
        self._want = want if want != self.threads else None
        return self.threads
