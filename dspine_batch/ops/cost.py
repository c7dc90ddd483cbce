"""What a job cost: machine-hours, CPU-seconds (GPU-seconds where it had GPUs) and, with ``--price-per-hour``, money
and the cost per million generated tokens, from the shards' state files (``run.state.ShardState``: each start adds
its elapsed and CPU time to the starts' before it, so a resumed shard counts all of its starts).

One function (``job_cost``) for everyone who says it: the run's last log line, ``report`` (and ``report --json``),
``status`` (an array's shards summed: the whole job) and the run's metrics. A shard is a machine: machine-hours are
the shards' elapsed times added, and the price is per machine-hour, as clouds and clusters bill.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def job_cost(states: Iterable[dict[str, Any]], generated_tokens: int | None = None) -> dict[str, Any]:
    """The cost of the shards whose state files are ``states``; ``generated_tokens`` (default: the states' own
    tallies) is what the cost per million tokens divides by. Money is None where no shard had a price."""
    states = list(states)
    elapsed = sum(float(s.get("elapsed_s") or 0.0) for s in states)
    cpu = sum(float(s.get("cpu_s") or 0.0) for s in states)
    gpu = sum(float(s.get("elapsed_s") or 0.0) * int(s.get("gpus") or 0) for s in states)
    priced = [s for s in states if s.get("price_per_hour") is not None]
    money = sum(float(s.get("elapsed_s") or 0.0) / 3600 * float(s["price_per_hour"]) for s in priced) \
        if priced else None
    if generated_tokens is None:
        generated_tokens = sum(int((s.get("totals") or {}).get("completion_tokens") or 0) for s in states)
    per_million = money / generated_tokens * 1e6 if money is not None and generated_tokens else None
    prices = sorted({float(s["price_per_hour"]) for s in priced})
    return {"machine_hours": round(elapsed / 3600, 6), "cpu_s": round(cpu, 3), "gpu_s": round(gpu, 3) if gpu else None,
            "price_per_hour": prices[0] if len(prices) == 1 else None, "cost": _r(money),
            "cost_per_million_tokens": _r(per_million), "generated_tokens": generated_tokens}


def cost_line(c: dict[str, Any]) -> str:
    """``0.0012 machine-hours, 3.9 CPU-seconds; $0.0001 at $0.10 an hour, $0.04 per million generated tokens``."""
    gpu = f", {c['gpu_s']:,.1f} GPU-seconds" if c.get("gpu_s") else ""
    out = f"{c['machine_hours']:.4g} machine-hours, {c['cpu_s']:,.1f} CPU-seconds{gpu}"
    if c.get("cost") is not None:
        at = f" at {c['price_per_hour']:g} an hour" if c.get("price_per_hour") is not None else ""
        per = f", {c['cost_per_million_tokens']:,.4g} per million generated tokens" \
            if c.get("cost_per_million_tokens") is not None else ""
        out += f"; cost {c['cost']:,.4g}{at}{per}"
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
