"""Thread hygiene: the core count a process may use (affinity, cgroup quota, Slurm) and the OpenMP environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dspine import threads


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


def test_prepare_env_fills_only_unset_variables():
    env: dict[str, str] = {}
    assert threads.prepare_env(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.prepare_env(env) == {}
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "1000"}  # a user tuning libgomp's spinning directly keeps it
    assert threads.prepare_env(env) == {}


def test_cli_entry_sets_passive_waiting_before_torch_loads():
    """``dspine-batch`` sets the policy in its own process before anything imports torch."""
    code = ("import os, sys; from dspine_batch.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE False"


def test_threads_module_does_not_import_torch():
    code = "import sys; import dspine.threads as t; t.available_cpus(); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
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
