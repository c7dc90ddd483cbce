"""scripts/bench/bench_draft_shapes.py: the drafts it times have the shape asked for, and they are real drafts (the pair
they make is still lossless), so the costs it reports are those of that shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_draft_shapes as bds  # noqa: E402


def test_shapes_cover_each_axis_around_the_shipped_one():
    base = bds.SHAPES[0]
    assert base == (2, 8192, 192)  # the shipped draft (dspine/embedded/assets/smollm2-dspine/config.json)
    for axis in range(3):  # every other shape changes exactly one of layers / vocab / rank
        assert any(s[axis] != base[axis] for s in bds.SHAPES[1:])
    assert all(sum(a != b for a, b in zip(s, base)) == 1 for s in bds.SHAPES[1:])
    assert bds.shape_name(2, None, 96) == "layers 2, vocab full, rank 96"


@pytest.mark.parametrize("layers,vocab,rank", [(1, 16, 8), (3, None, 4)])
def test_build_draft_has_the_shape_and_stays_lossless(llama_target, layers, vocab, rank):
    from dspine import generate

    d = bds.build_draft(llama_target, layers, vocab, rank, block_size=3)
    assert len(d.layers) == layers and d.block_size == 3 and d.transfer_rank == rank
    assert (d.draft_vocab is None) if vocab is None else len(d.draft_vocab) == vocab
    prompts = [[5, 9, 2, 7], [3, 3, 8]]
    plain = generate(llama_target, None, prompts, max_new_tokens=10)
    spec = generate(llama_target, d, prompts, max_new_tokens=10, block_size=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
