"""The kernel cache as a cluster meets it (issue 36): a build killed half-way never wedges the next run, many
processes on an empty cache build once, and two checkouts of the same sources share one build.

Real builds (~40 s each on a quiet 2-core box) into a temporary ``DSPINE_CACHE_DIR`` shared by this module's
tests, so the whole file builds once: the killed build and the four processes that follow it, then the checkouts
load what those built (run alone, the checkout test builds on its first run only)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, subprocess_env

from dspine.cpu import disk_cache, kernels

pytestmark = pytest.mark.skipif(kernels.disabled() or kernels.load() is None,
                                reason="the CPU kernels are off or cannot be built here")

LOAD = """
import json
from dspine.cpu import disk_cache, kernels
print(json.dumps({"isa": kernels.load(), "module": kernels.__file__}))
"""
BUILDING = "dspine: building the CPU kernels"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dspine-cache")


def _start(cache: Path, checkout: Path = ROOT, **kw) -> subprocess.Popen:
    env = subprocess_env(DSPINE_CACHE_DIR=str(cache), PYTHONPATH=str(checkout))
    return subprocess.Popen([sys.executable, "-c", LOAD], env=env, cwd=checkout, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def _finish(p: subprocess.Popen) -> tuple[dict, str]:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _temporaries(cache: Path) -> list[str]:
    return [p.name for p in (cache / "kernels").iterdir() if ".tmp-" in p.name]


def test_a_build_killed_half_way_does_not_wedge_and_four_processes_build_once(cache):
    killed = _start(cache, start_new_session=True)  # its own process group: the compilers die with it
    deadline = time.monotonic() + 600
    while not any((cache / "kernels").glob(".*.tmp-*/build.ninja")):  # the compilers are running
        assert killed.poll() is None and time.monotonic() < deadline, killed.stderr.read()[-2000:]
        time.sleep(0.2)
    time.sleep(3)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    lock = next((cache / "kernels").glob("*.lock"))
    assert json.loads(lock.read_text())["pid"] == killed.pid  # the dead builder's record, its lock released
    assert _temporaries(cache)

    procs = [_start(cache) for _ in range(4)]
    results = [_finish(p) for p in procs]
    assert {r["isa"] for r, _ in results} == {kernels.wanted_isa()}  # all load
    builders = [err for _, err in results if BUILDING in err]
    assert len(builders) == 1, [err for _, err in results]  # one builds
    assert f"the build by pid {killed.pid} on " in builders[0] and "did not finish" in builders[0]
    builder = procs[[BUILDING in err for _, err in results].index(True)]
    waited = [err for _, err in results if f"waiting for pid {builder.pid} on " in err]
    assert waited and all("are ready" in err for err in waited)
    assert not _temporaries(cache) and lock.read_text() == ""


def test_two_checkouts_alternating_share_one_build(cache, tmp_path):
    clone = tmp_path / "clone"  # a second checkout (or virtualenv) of the same sources, elsewhere on disk
    shutil.copytree(ROOT / "dspine", clone / "dspine", ignore=shutil.ignore_patterns("__pycache__"))
    runs = [_finish(_start(cache, checkout)) for checkout in (ROOT, clone, ROOT, clone)]
    assert Path(runs[1][0]["module"]).is_relative_to(clone) and Path(runs[0][0]["module"]).is_relative_to(ROOT)
    assert all(r["isa"] == kernels.wanted_isa() for r, _ in runs)
    assert [BUILDING in err for _, err in runs[1:]] == [False, False, False], [err for _, err in runs]
    assert len([p for p in (cache / "kernels").iterdir() if p.is_dir()]) == 1


def test_a_build_says_what_changed(tmp_path, monkeypatch):
    """The reason a build gives, against the newest build of the same instruction set in the cache."""
    isa = kernels.wanted_isa()
    held = disk_cache.Held()
    assert kernels._why_build(tmp_path, "x", isa, held) == f"no {isa} build in this cache yet"
    old = dict(kernels.build_key(isa), torch="2.0.0", sources="0" * 16, built_at=1.0)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / kernels.KEY_FILE).write_text(json.dumps(old))
    why = kernels._why_build(tmp_path, "x", isa, held)
    assert "the sources changed" in why and f"torch 2.0.0 -> {kernels.torch.__version__}" in why
    assert "compiler flags" not in why
    dead = disk_cache.Holder(4242, "node7", time.time() - 12, "building")
    why = kernels._why_build(tmp_path, "x", isa, disk_cache.Held(died=dead))
    assert why.startswith("the build by pid 4242 on node7 did not finish")
