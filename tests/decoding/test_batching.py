"""Writing newcomers into freed batch rows equals rebuilding the batch (KV and Gated-DeltaNet caches)."""

from __future__ import annotations

import torch

from dspine.decoding.batching import assign_rows, can_assign, merge
from dspine.models.cache import KVCache, ModelCache, SSMState


def _cache(batch: int, cap: int, seed: int) -> ModelCache:
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(torch.randn(batch, 2, cap, 4, generator=g), torch.randn(batch, 2, cap, 4, generator=g))
    ssm = SSMState(torch.randn(batch, 6, 3, generator=g), torch.randn(batch, 2, 3, 3, generator=g))
    return ModelCache(torch.randint(1, cap, (batch,), generator=g), [kv, ssm])


def test_assign_rows_matches_select_and_concat():
    run, new = _cache(4, 8, 0), _cache(2, 12, 1)  # the newcomers need a longer cache: the batch grows
    want = merge(run, [0, 2], new)  # rows 0, 2, then the newcomers
    assert can_assign(run, new) and assign_rows(run, [1, 3], new)
    order = [0, 2, 1, 3]
    got = run.select(order)
    assert torch.equal(got.lengths, want.lengths)
    assert torch.equal(got.layers[0].k[:, :, :12], want.layers[0].k[:, :, :12])
    assert torch.equal(got.layers[0].v[:, :, :12], want.layers[0].v[:, :, :12])
    assert torch.equal(got.layers[1].conv, want.layers[1].conv) and torch.equal(got.layers[1].rec, want.layers[1].rec)


def test_pending_verify_is_not_assigned():
    run, new = _cache(2, 8, 0), _cache(1, 8, 1)
    run.layers[1].pending = {"x": torch.zeros(2, 1)}
    assert not can_assign(run, new) and not assign_rows(run, [0], new)
