"""``prepare``: fill this machine's caches (or a cluster's shared cache) before a job needs them.

What a job's first start does once per machine, done ahead and timed: build the CPU kernels, convert the
embedded model, load it (its packed weights are cached), and calibrate the cost model for the batch shape the job
will run (``dspine_batch.engines.prepare``; the reference engine's ``prepare``). Idempotent: a second run finds
everything and says so in seconds. Slurm: run it once before the array (docs/slurm.md, "Preparing a shared
cache"); the tasks then start without a build or a calibration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dspine_batch.engines import prepare as steps
from dspine_batch.engines.registry import open_engine, resolve_name


def prepare(engine: str, model: str, draft: str, engine_args: dict[str, str], max_in_flight: int,
            echo: Callable[[str], None]) -> float:
    """Run the steps for this engine and these settings, one line each as it finishes; the seconds in all."""
    t_all = time.monotonic()
    name = resolve_name(engine)
    echo(f"preparing for the {name} engine, model {model}, draft {draft}")

    def step(what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        out = fn()
        text = out if isinstance(out, str) else "done"  # the load step returns the engine
        echo(f"  {what:<12} {text} ({time.monotonic() - t0:.1f} s)")
        return out

    if name == "reference":
        step("CPU kernels", steps.kernels)
    step("models", lambda: steps.models(model, draft))
    if name == "sglang":
        echo("  (SGLang keeps its own caches; nothing else to prepare for it)")
    else:
        eng = step("load", lambda: open_engine(name, model, draft, engine_args))
        try:
            warm = getattr(eng, "prepare", None)
            step("cost model", (lambda: warm(max_in_flight)) if warm else (lambda: "not used by this engine"))
        finally:
            eng.close()
    total = time.monotonic() - t_all
    echo(f"ready in {total:.1f} s")
    return total
