"""Kept for test files not yet moved to ``tests/helpers.py``: re-exports its dspine_batch helpers."""

from helpers import ROOT, VOLATILE, prompts, read_output, run_cli, spawn, subprocess_env, write_jsonl

__all__ = ["ROOT", "VOLATILE", "prompts", "read_output", "run_cli", "spawn", "subprocess_env", "write_jsonl"]
