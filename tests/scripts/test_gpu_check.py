"""scripts/gpu/gpu_check.sh runs its CPU-size path end to end (the GPU run itself: `bash scripts/gpu/gpu_check.sh`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import transformers  # noqa: F401  (the test extra: missing, the file must fail, not skip)

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_tiny_path():
    r = subprocess.run(["bash", "scripts/gpu/gpu_check.sh", "--device", "cpu", "--tiny", "--batches", "1", "2",
                        "--reps", "1", "--new-tokens", "8"], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["device"] == "cpu"
    p = summary["parity"]["qwen35_hybrid_tiny"]
    assert p["greedy_spec_equals_ar"] and p["batch1_equals_batched"] and p["sampled_completed"]
    for b in ("batch1", "batch2"):
        t = summary["timing"][b]
        assert t["ar_step_ms"] > 0 and t["verify_round_ms"] > 0 and t["draft_forward_ms"] > 0
    assert summary["timing"]["model"]["layers"] == 8
