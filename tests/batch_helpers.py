"""Shared helpers for the dspine_batch tests: run the CLI in-process or as a subprocess on the scripted engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds

from dspine_batch.cli import main

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("latency_s", "attempt")  # differ between runs by design


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] | None = None) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines or []:
            f.write(line + b"\n")
    return path


def prompts(n: int, start: int = 0) -> list[dict]:
    kinds = ["Explain {i} in one line.", "def f{i}(x): return x *", "What is {i} + {i}?", "Tell a story #{i}"]
    return [{"id": f"r{i:05d}", "prompt": kinds[i % 4].format(i=i)} for i in range(start, start + n)]


def run_cli(args: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``dspine-batch`` in-process on the scripted engine; returns the exit code."""
    old = dict(os.environ)
    os.environ.update({"DSPINE_BATCH_TEST_ENGINE": "scripted", "DSPINE_BATCH_PROGRESS": "none", **(env or {})})
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return 0


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPINE_BATCH_")}
    env.update({"DSPINE_BATCH_TEST_ENGINE": "scripted", "DSPINE_BATCH_PROGRESS": "none",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")}, **extra)
    return env


def spawn(args: list[str], **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dspine_batch.cli", *args], env=subprocess_env(**extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)


def read_output(outdir: Path, drop: tuple[str, ...] = VOLATILE) -> list[dict]:
    t = ds.dataset(str(outdir), format="parquet").to_table()
    rows = [{k: v for k, v in r.items() if k not in drop} for r in t.to_pylist()]
    return sorted(rows, key=lambda r: (r["row_id"], r["sample_index"]))
