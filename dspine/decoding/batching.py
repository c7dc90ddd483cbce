"""Moving requests in and out of a running batch: cache rows written in place, or cut down and merged.

Continuous batching replaces a finished row by the next waiting request. Rebuilding the whole batch cache with
``ModelCache.concat`` copies every row's keys and values for each request that joins; writing the newcomer's
rows into the freed slots copies only the newcomer. ``assign_rows`` does that for the cache kinds it knows
(``KVCache``, ``SSMState``) and reports False otherwise, so the caller falls back to select + concat.
"""

from __future__ import annotations

import torch

from dspine.models.cache import KVCache, ModelCache, SSMState


def can_assign(dst: ModelCache, src: ModelCache) -> bool:
    """Whether ``assign_rows`` knows every layer of these caches (and no speculative verify is pending)."""
    return len(dst.layers) == len(src.layers) and all(
        (isinstance(d, KVCache) and isinstance(s, KVCache))
        or (isinstance(d, SSMState) and isinstance(s, SSMState) and d.pending is None and s.pending is None)
        for d, s in zip(dst.layers, src.layers)
    )


def assign_rows(dst: ModelCache, slots: list[int], src: ModelCache) -> bool:
    """Overwrite rows ``slots`` of ``dst`` with the rows of ``src`` (same order); False (nothing written) when
    ``can_assign`` is not true."""
    if not can_assign(dst, src):
        return False
    idx = torch.as_tensor(slots, dtype=torch.long, device=dst.lengths.device)
    for d, s in zip(dst.layers, src.layers):
        if isinstance(d, KVCache):
            d.ensure(s.capacity, exact=True)  # the newcomer's capacity covers its prompt and budget
            d.k[idx, :, : s.capacity] = s.k.to(d.k.dtype)
            d.v[idx, :, : s.capacity] = s.v.to(d.v.dtype)
        else:
            d.conv[idx] = s.conv.to(d.conv.dtype)
            d.rec[idx] = s.rec.to(d.rec.dtype)
    dst.lengths[idx] = src.lengths.to(dst.lengths)
    return True


def merge(dst: ModelCache, keep: list[int], src: ModelCache) -> ModelCache:
    """The fallback: ``dst`` cut to rows ``keep``, then ``src``'s rows appended (copies the whole batch)."""
    return ModelCache.concat([dst.select(keep), src]) if keep else src
