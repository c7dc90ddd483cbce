"""The round cost model: bilinear grid, calibration on a tiny pair, the on-disk cache."""

from __future__ import annotations

import json

import pytest

from dspine.decoding import cost as cost_mod
from dspine.decoding.cost import CostModel, Grid


def test_grid_is_exact_at_corners_and_linear_between():
    g = Grid((1, 9), (1, 5), ((1.0, 2.0), (3.0, 8.0)))
    assert [g(1, 1), g(1, 5), g(9, 1), g(9, 5)] == [1.0, 2.0, 3.0, 8.0]
    assert g(5, 1) == pytest.approx(2.0) and g(1, 3) == pytest.approx(1.5)
    assert g(17, 1) == pytest.approx(5.0)  # extrapolated linearly in rows
    m = CostModel.from_json(json.loads(json.dumps(CostModel(g, None).to_json())))
    assert m.target_s(5, 3) == g(5, 3) and m.draft_s(4, 4) == 0.0


@pytest.fixture(scope="module")
def pair(llama_target):
    from dspine import init_draft

    return llama_target, init_draft(llama_target, num_layers=1, block_size=4, intermediate_size=64)


def test_calibration_measures_every_corner(pair):
    target, draft = pair
    m = cost_mod.calibrate(target, draft, max_rows=4, block_size=4, reps=1)
    assert m.target.rows == (1, 4) and m.target.tokens == (1, 4) and m.draft.tokens == (2, 4)
    assert all(s > 0 for row in m.target.s + m.draft.s for s in row)
    assert cost_mod.calibrate(target, None, 1, 4, reps=1).draft is None


def test_calibration_is_cached_per_identity(pair, tmp_path, monkeypatch):
    target, draft = pair
    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_mod, "_busy", lambda: False)  # kept whatever else runs on the machine
    ident = {"model": "tiny", "draft": "d"}
    first = cost_mod.load_or_calibrate(target, draft, 2, 4, ident)
    assert len(list((tmp_path / "cost").glob("*.json"))) == 1

    def boom(*a, **k):
        raise AssertionError("recalibrated")

    monkeypatch.setattr(cost_mod, "calibrate", boom)
    assert cost_mod.load_or_calibrate(target, draft, 2, 4, ident) == first
    with pytest.raises(AssertionError, match="recalibrated"):  # another model identity is another entry
        cost_mod.load_or_calibrate(target, draft, 2, 4, {"model": "other"})


def test_disturbed_timings_are_made_monotone():
    """A corner timed during someone else's burst must not make a wider or taller shape look cheaper."""
    from dspine.decoding.cost import Grid, _monotone

    g = _monotone(Grid((1, 8), (1, 4, 17), ((0.052, 0.0007, 0.0008), (0.001, 0.021, 0.145))))
    assert g.s == ((0.052, 0.052, 0.052), (0.052, 0.052, 0.145))
    assert g(8, 17) >= g(8, 4) >= g(1, 4) and g(1, 17) >= g(1, 1)


def test_three_width_grid_is_piecewise_linear_in_tokens():
    from dspine.decoding.cost import CostModel, Grid

    g = Grid((1, 2), (1, 3, 17), ((1.0, 1.2, 2.6), (1.0, 1.2, 2.6)))
    assert g(1, 2) == pytest.approx(1.1) and g(1, 10) == pytest.approx(1.9) and g(1, 21) == pytest.approx(3.0)
    back = CostModel.from_json(CostModel(g, None).to_json())
    assert back.target == g


def test_busy_calibration_is_used_but_not_cached(tmp_path, monkeypatch, llama_target):
    from dspine.decoding import cost as cost_mod

    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_mod, "calibrate", lambda *a, **k: cost_mod.CostModel.flat())
    monkeypatch.setattr(cost_mod.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    assert cost_mod.load_or_calibrate(llama_target, None, 2, 2, {"m": 1}) == cost_mod.CostModel.flat()
    assert not list(tmp_path.rglob("*.json"))
    monkeypatch.setattr(cost_mod.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    cost_mod.load_or_calibrate(llama_target, None, 2, 2, {"m": 1})
    assert len(list(tmp_path.rglob("*.json"))) == 1


CALIBRATE = """
import json, os, sys, time
from types import SimpleNamespace
from dspine.cpu import disk_cache
from dspine.decoding import cost
mode = sys.argv[1]
cost._busy = lambda: False  # kept whatever else runs on the machine
# the write path is under test, not the timing: a measurement per mode that tells the entries apart
cost.calibrate = lambda *a, **k: cost.CostModel.flat(target_s=1.0 + len(mode))
target = SimpleNamespace(dtype="torch.float32", device="cpu", kernel="torch")  # what the cache key reads
if mode.startswith("half"):  # killed by the test half-way through writing the calibration
    def half(fd, data):
        os.write(fd, data[: len(data) // 2])
        print("HALF", flush=True)
        time.sleep(600)
    disk_cache._write_all = half
if mode == "half-over":  # an entry exists: calibrate and write again over it
    cost.CostModel.from_json = staticmethod(lambda d: (_ for _ in ()).throw(ValueError("stale")))
if mode == "cached":
    cost.calibrate = lambda *a, **k: (_ for _ in ()).throw(AssertionError("recalibrated"))
m = cost.load_or_calibrate(target, None, 2, 2, {"model": "tiny"})
print(json.dumps(m.to_json()), flush=True)
"""


def test_a_killed_calibration_writer_leaves_a_usable_cache(tmp_path):
    """kill -9 while the calibration is being written, on an empty cache and over an entry: the cache holds no
    torn file, the next run calibrates or reads a whole one, and the dead writer's temporary is cleaned up."""
    import signal
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    env = subprocess_env(DSPINE_CACHE_DIR=str(tmp_path))

    def run(mode: str, kill: bool = False) -> str:
        p = subprocess.Popen([sys.executable, "-c", CALIBRATE, mode], env=env, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if kill:
            assert p.stdout.readline().strip() == "HALF", p.communicate()[1][-2000:]
            p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=600)
        assert p.returncode == (-signal.SIGKILL if kill else 0), err[-2000:]
        return out.strip()

    entries = lambda: sorted(p.name for p in (tmp_path / "cost").iterdir())  # noqa: E731
    run("half", kill=True)
    assert all(name.startswith(".") for name in entries())  # only the dead writer's temporary, no torn entry
    first = run("fresh")
    (entry,) = [n for n in entries() if not n.startswith(".")]
    assert entries() == [entry]  # the temporary is gone
    assert json.loads((tmp_path / "cost" / entry).read_text()) == json.loads(first)
    run("half-over", kill=True)
    assert json.loads((tmp_path / "cost" / entry).read_text()) == json.loads(first)  # the old entry, whole
    assert run("cached") == first  # read, not recalibrated


def test_every_kernel_source_and_step_module_is_in_the_code_version(tmp_path, monkeypatch):
    """A cached calibration is keyed by the code a forward runs: editing any kernel source (the fused layer, the vector
    helpers, not only the linears) or a step module must change the key; an unrelated file must not. The kernel sources
    are the ones the build is named by (``kernels.SOURCES`` / ``HEADERS``), which must be every file in ``csrc/``."""
    from dspine.cpu import kernels

    assert {p.name for p in kernels.SOURCES + kernels.HEADERS} == {p.name for p in kernels.CSRC.iterdir()}
    root = tmp_path / "dspine"
    csrc = root / "cpu" / "csrc"
    csrc.mkdir(parents=True)
    for name in ("layer.cpp", "linear.cpp", "vec.h"):
        (csrc / name).write_text(f"// {name}\n")
    monkeypatch.setattr(kernels, "SOURCES", [csrc / "layer.cpp", csrc / "linear.cpp"])
    monkeypatch.setattr(kernels, "HEADERS", [csrc / "vec.h"])
    for name in cost_mod.CODE_MODULES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    (root / "unrelated.py").write_text("# docs\n")
    before = cost_mod._code_version(root)
    changed = []
    for path in [csrc / "layer.cpp", csrc / "vec.h", root / "models" / "llama.py"]:
        text = path.read_text()
        path.write_text(text + "// faster\n")
        changed.append(cost_mod._code_version(root))
        path.write_text(text)
    assert all(v != before for v in changed) and len(set(changed)) == 3
    (csrc / "attend_items.h").write_text("// a new kernel header\n")
    monkeypatch.setattr(kernels, "HEADERS", [csrc / "vec.h", csrc / "attend_items.h"])
    assert cost_mod._code_version(root) != before
    (csrc / "attend_items.h").unlink()
    monkeypatch.setattr(kernels, "HEADERS", [csrc / "vec.h"])
    (root / "unrelated.py").write_text("# docs, edited\n")
    assert cost_mod._code_version(root) == before
