"""The test suite's CLI children stay lean: ``tests/scripted_cli.py`` and ``tests/killpoint_cli.py`` start hundreds of
times in the default suite (kill -9, one-path and sharded tests), so they import what the production CLI imports for a
job on the scripted engine and nothing more (torch alone was ~1 s of a ~2.5 s start; BENCHMARKS.md, issue 53 seventh
session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("child", ["scripted_cli", "killpoint_cli"])
def test_a_cli_child_imports_no_torch(child):
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import {child}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=TESTS.parent)
    assert out.stdout.strip() == "False", out.stderr
