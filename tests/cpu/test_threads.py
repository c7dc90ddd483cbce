"""Thread hygiene: the core count a process may use (affinity, cgroup quota, Slurm) and the OpenMP environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspine.cpu import threads


def test_cpu_max_parsing():
    assert threads.parse_cpu_max("max 100000\n") is None
    assert threads.parse_cpu_max("200000 100000\n") == 2.0
    assert threads.parse_cpu_max("150000 100000") == 1.5
    assert threads.parse_cpu_max("50000") == 0.5  # period defaults to 100 ms
    assert threads.parse_cfs("-1\n", "100000\n") is None
    assert threads.parse_cfs("300000\n", "100000\n") == 3.0


def test_available_cpus_is_the_tightest_limit():
    assert threads.available_cpus(8, None, None, probe=False) == 8
    assert threads.available_cpus(8, 2.0, None, probe=False) == 2
    assert threads.available_cpus(8, 1.5, None, probe=False) == 2  # a fractional quota rounds up
    assert threads.available_cpus(8, 0.25, None, probe=False) == 1
    assert threads.available_cpus(8, 6.0, 3, probe=False) == 3
    assert threads.available_cpus(2, None, 16, probe=False) == 2  # affinity is tighter than Slurm's count
    assert threads.available_cpus(None, None, None, probe=False) == 1


def test_slurm_cpus_per_task():
    assert threads.slurm_cpus({"SLURM_CPUS_PER_TASK": "4"}) == 4
    assert threads.slurm_cpus({}) is None
    assert threads.slurm_cpus({"SLURM_CPUS_PER_TASK": "junk"}) is None
    assert threads.slurm_cpus({"SLURM_CPUS_PER_TASK": "0"}) is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_own_group_and_ancestors(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/system.slice/job.scope\n")
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "system.slice" / "cpu.max", "400000 100000\n")
    _write(root / "system.slice" / "job.scope" / "cpu.max", "max 100000\n")
    assert threads.cgroup_cpus(root, proc) == 4.0  # the parent slice's quota bounds the job's group
    _write(root / "system.slice" / "job.scope" / "cpu.max", "150000 100000\n")
    assert threads.cgroup_cpus(root, proc) == 1.5


def test_cgroup_v1_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    root = tmp_path / "cg"
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "200000\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_cpus(root, proc) == 2.0


def test_cgroup_without_limits_or_files(tmp_path):
    assert threads.cgroup_cpus(tmp_path / "missing", tmp_path / "missing_proc") is None
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/\n")
    _write(tmp_path / "cg" / "cpu.max", "garbage here\n")  # unreadable quota: ignored, not fatal
    assert threads.cgroup_cpus(tmp_path / "cg", proc) is None


def test_cli_leaves_openmp_waiting_at_its_default():
    """No passive waiting forced on the process (it halves a quiet machine's decode speed; contention is the
    Governor's job), and a user's own policy is left alone."""
    code = ("import os, sys; from dspine_batch.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    for policy in (None, "ACTIVE"):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip().splitlines()[-1] == f"{policy} False"


def test_threads_module_does_not_import_torch():
    code = "import sys; import dspine.cpu.threads as t; t.available_cpus(); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_configure_torch_sets_the_count():
    import torch

    before = torch.get_num_threads()
    try:
        assert threads.configure_torch(1) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


STAT = """cpu  {tb} 0 0 {ti} 0 0 0 0 0 0
cpu0 {b0} 0 0 {i0} 5 0 0 2 0 0
cpu1 {b1} 0 0 {i1} 0 0 0 0 0 0
intr 1 2 3
"""


def test_read_cpu_stat_sums_the_allowed_cpus(tmp_path):
    f = tmp_path / "stat"
    f.write_text(STAT.format(tb=999, ti=999, b0=100, i0=50, b1=30, i1=70))
    assert threads.read_cpu_stat(None, f) == (100 + 2 + 30, 50 + 5 + 70)  # steal counts as busy, iowait as idle
    assert threads.read_cpu_stat({1}, f) == (30, 70)


def test_cores_available_is_own_use_plus_idle():
    a = threads.CpuSample(wall=0.0, process=0.0, busy=0, idle=0)
    crowded = threads.CpuSample(wall=1.0, process=1.0, busy=200, idle=0)  # we got one core, nothing idle
    assert threads.cores_available(a, crowded, ncpus=2) == pytest.approx(1.0)
    quiet = threads.CpuSample(wall=1.0, process=1.0, busy=100, idle=100)  # one core ours, one idle
    assert threads.cores_available(a, quiet, ncpus=2) == pytest.approx(2.0)
    assert threads.cores_available(a, a, ncpus=2) is None


def test_governor_drops_to_what_the_machine_gives_and_comes_back():
    """Crowded for two intervals -> 1 thread (hysteresis: not after one); free again -> back to 2; restore()."""
    samples = []
    calls: list[int] = []

    def feed(*steps):
        t = samples[-1] if samples else threads.CpuSample(0.0, 0.0, 0, 0)
        for own, idle_cores in steps:
            t = threads.CpuSample(t.wall + 1.0, t.process + own, t.busy + int(100 * (2 - idle_cores)),
                                  t.idle + int(100 * idle_cores))
            samples.append(t)

    feed((2.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0))
    it = iter(samples)
    gov = threads.Governor(most=2, interval_s=0.0, set_threads=calls.append, sample=lambda: next(it))
    gov.threads = 2
    seen = [gov.tick(now=float(i)) for i in range(len(samples))]
    assert seen[:3] == [2, 2, 1] and seen[-1] == 2  # one crowded interval is not enough, two are
    assert calls[-2:] == [1, 2] and gov.changes == 2
    gov.threads = 1
    gov.restore()
    assert calls[-1] == 2 and gov.threads == 2


def test_governor_is_inert_with_one_thread():
    gov = threads.Governor(most=1, sample=lambda: (_ for _ in ()).throw(AssertionError("sampled")))
    assert gov.tick(now=0.0) == gov.threads
