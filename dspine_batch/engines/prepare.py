"""The per-machine work an engine does at its first start, done ahead: the steps of ``dspine-batch prepare``.

A job's first start on a machine (or on a cluster's shared cache) builds the CPU kernels (~40 s), converts the
embedded model, packs its weights and calibrates the cost model; ``prepare`` runs the same code paths once, before
an array or a cron job needs them, so every task finds the caches filled (``dspine.cpu.disk_cache``: one process
fills an entry while the others wait, and a killed one leaves nothing half-written). Each step returns one line
saying what it found or did; ``dspine_batch.ops.prepare`` times and prints them.
"""

from __future__ import annotations

import os

from dspine_batch.engines.models import resolve_draft, resolve_model


def kernels() -> str:
    """Build (first time) and load the CPU kernels for this machine's instruction set."""
    from dspine.cpu import kernels as k
    from dspine.cpu.disk_cache import cache_root

    if k.disabled():
        return f"off ({k.ENV}={os.environ.get(k.ENV)}): the engine uses torch's kernels"
    isa = k.wanted_isa()
    published = (cache_root() / "kernels" / k.build_name(isa)).is_dir()
    got = k.load()
    if got is None:
        return f"unavailable, the engine uses torch's ({k.unavailable_reason()})"
    where = cache_root() / "kernels" / k.build_name(got)
    return f"{got}: {'already built' if published else 'built'} in {where}"


def models(model: str, draft: str) -> str:
    """Resolve ``--model`` / ``--draft``: converts the embedded model into the cache on its first use."""
    target = resolve_model(model)
    drafter = resolve_draft(draft, model)
    return f"target {target}" + (f", draft {drafter}" if drafter else ", no draft")
