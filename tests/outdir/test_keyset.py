"""The compact hash set behind the done-set and the duplicate-id check."""

from __future__ import annotations

import numpy as np

from dspine_batch.outdir.keyset import KeySet, key_hash, key_hashes


def test_membership_single_and_batched():
    ks = KeySet()
    keys = [f"row-{i}" for i in range(200_000)]
    hashes = key_hashes(keys)
    ks.add_many(hashes[:100_000])
    for h in hashes[100_000:150_000].tolist():
        ks.add(int(h))
    assert len(ks) == 150_000
    found = ks.contains_many(hashes)
    assert found[:150_000].all() and not found[150_000:].any()
    assert key_hash("row-5") in ks and key_hash("row-199999") not in ks


def test_hash_is_stable_across_processes():
    # pinned: row ids, shards and seeds must not change between versions or runs
    assert key_hash("prompts.jsonl:0") == 0xFDA6012A27589AC1
    assert key_hashes(["a", "b"]).dtype == np.uint64
    assert int(key_hashes(["a"])[0]) == key_hash("a")


def test_fallback_ids_hash_by_index():
    from dspine_batch.outdir.keyset import fallback_id_hashes, index_hashes

    h = index_hashes("data/in.jsonl", np.arange(100_000))
    assert len(np.unique(h)) == 100_000  # a bijection per file: no collisions
    assert (fallback_id_hashes([f"data/in.jsonl:{i}" for i in (0, 7, 99_999)]) == h[[0, 7, 99_999]]).all()
    assert not np.isin(index_hashes("other.jsonl", np.arange(1000)), h).any()
