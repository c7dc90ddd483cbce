"""What every benchmark prints beside its numbers: the processor (model name, widest ISA) and the load average.

Imported by the scripts beside it (``python scripts/bench/x.py`` puts this folder on ``sys.path``)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    isa = ("amx" if "amx_bf16" in info else "avx512_bf16" if "avx512_bf16" in info else "avx512" if "avx512f" in info
           else "avx2" if "avx2" in info else "?")
    return f"{name} ({isa}), {os.cpu_count()} cores"


def load_line() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def write_json(path: str | None, report: dict) -> None:
    """A benchmark's report as JSON at ``path`` (folders made), when one is asked for."""
    import json

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2))


def fresh_job(engine) -> None:
    """Put a reference engine in the state a fresh job's generation starts from, before a timed run of it: the
    prefix cache empty (it outlives runs, and a run of another variant empties it: a run after a switch paid every
    prefill, one after the same variant none) and the draft not loaded (the engine's ``LazyDraft`` reads it when a
    stream first keeps it, inside generation, as a job does; a stream that retires it before its first prefill never
    reads it)."""
    if getattr(engine, "prefix", None) is not None:
        engine.prefix.clear()
    if callable(release := getattr(getattr(engine, "draft", None), "release", None)):
        release()
