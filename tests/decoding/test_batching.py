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
    # grown to what the newcomers need, not doubled: the batch keeps that size for the rest of the job
    assert run.layers[0].capacity == 12


def test_decode_writes_still_grow_by_doubling():
    kv = KVCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    kv.write(torch.tensor([[8]]), torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert kv.capacity == 16 and torch.equal(kv.k[0, :, 8], torch.ones(2, 4))


def test_pending_verify_is_not_assigned():
    run, new = _cache(2, 8, 0), _cache(1, 8, 1)
    run.layers[1].pending = {"x": torch.zeros(2, 1)}
    assert not can_assign(run, new) and not assign_rows(run, [0], new)


def test_admit_reuses_slots_and_drops_a_wholly_finished_batch():
    from dspine.decoding.running import RunningBatch, admit

    run = RunningBatch(["a", "b", "c"], _cache(3, 8, 0), None, None)
    fresh = RunningBatch(["d"], _cache(1, 12, 1), None, None)
    batch, dead = admit(run, [1, 2], fresh)  # one newcomer into a freed slot, in place; one slot still free
    assert batch is run and dead == [2] and batch.rows == ["a", "d", "c"]
    assert batch.cache.layers[0].capacity == 12  # grown exactly to the newcomer's need
    assert torch.equal(batch.cache.layers[0].k[1], fresh.cache.layers[0].k[0])
    everyone_done = RunningBatch(["e", "f"], _cache(2, 8, 2), None, None)
    batch, dead = admit(everyone_done, [0, 1], fresh)  # nothing alive: the newcomers' cache is the batch
    assert batch is fresh and dead == []
