""""first token N s after this process started": the clock starts when dspine-batch's process starts running
Python, not when the shell that exec'd it was forked (``bash -c 'setup && dspine-batch ...'`` once reported 564 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import os
from pathlib import Path
from dspine_batch.run.state import since_start
ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
kernel = float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
print(since_start(), kernel)
"""


def _probe(shell: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "-c", shell.format(py=sys.executable)], input=PROBE, capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    return float(out[0]), float(out[1])


def test_a_shell_that_ran_something_first_does_not_count():
    # the shell sleeps 3 s, then becomes Python (exec: the same process, so the kernel's start is the shell's)
    since, kernel = _probe("sleep 3 && exec {py} -")
    assert kernel >= 3.0
    assert since <= kernel - 2.9  # the 3 s before Python ran are not this process's


def test_a_plain_start_counts_python_start_up():
    since, kernel = _probe("exec {py} -")
    assert 0 < since <= kernel + 0.05  # the kernel's figure: Python's start-up before the import included
    assert kernel - since < 0.05
