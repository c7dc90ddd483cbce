"""The key log's blocks (``stages/keylog.py``): 64 entries in one read, the same entries as read one by one."""

from __future__ import annotations

import numpy as np
import pytest

from dspine_batch.outdir.core import Outdir
from dspine_batch.stages.keylog import BLOCK, Entry, KeyLog


def _entry(shard: str, n: int) -> Entry:
    rows = np.arange(n * 3, n * 3 + 3, dtype=np.uint64)
    return Entry(shard, rows, [f"{n:016x}{j:016x}" for j in range(3)])


def _fill(out: Outdir, count: int, shards: int = 3) -> list[Entry]:
    """``count`` entries appended by ``shards`` writers taking turns, each reading before it writes."""
    logs = [KeyLog(out) for _ in range(shards)]
    written = []
    for n in range(count):
        log = logs[n % shards]
        log.read_new()
        e = _entry(f"{n % shards:05d}-of-{shards:05d}", n)
        assert log.append(e)
        written.append(e)
    return written


def _same(got: list[Entry | None], want: list[Entry]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is not None and g.shard == w.shard and g.keys == w.keys and (g.rows == w.rows).all()


def test_a_reader_far_behind_writes_blocks_and_the_next_one_reads_them(tmp_path):
    out = Outdir(str(tmp_path))
    want = _fill(out, 3 * BLOCK + 8)
    first = KeyLog(out)
    _same(first.read_new(), want)
    assert first.requests["create"] == 3  # blocks 0, 1, 2: the last 8 entries are no whole block
    assert first.requests["get"] == len(want) + 1 + 4  # every entry, the end, and a block asked for at 0/64/128/192
    second = KeyLog(out)
    _same(second.read_new(), want)
    assert second.requests["get"] == 3 + 1 + 8 + 1 and second.requests["create"] == 0
    plain = KeyLog(out, blocks=False)
    _same(plain.read_new(), want)
    assert plain.requests["get"] == len(want) + 1


def test_a_block_that_does_not_read_is_ignored_and_a_bad_entry_stays_bad(tmp_path):
    out = Outdir(str(tmp_path))
    want = _fill(out, 2 * BLOCK)
    log = KeyLog(out)
    out.store.put(log.block_name(1), b"not a block")  # as if torn: its entries are read one by one
    bad = log.name(5)
    out.store.delete(bad)
    out.store.create(bad, b"garbage")  # an entry that does not read: None whether alone or in a block
    for reader in (KeyLog(out), KeyLog(out)):
        got = reader.read_new()
        assert got[5] is None
        _same(got[:5] + got[6:], want[:5] + want[6:])
    assert KeyLog(out).requests["get"] == 0


@pytest.mark.parametrize("start", [1, BLOCK - 1])
def test_a_reader_that_starts_inside_a_block_writes_none_of_it(tmp_path, start):
    out = Outdir(str(tmp_path))
    want = _fill(out, 2 * BLOCK)
    log = KeyLog(out, next=start)
    _same(log.read_new(), want[start:])
    assert log.requests["create"] == 1  # only block 1, read whole from its first position
    assert not out.store.head(log.block_name(0)) and out.store.head(log.block_name(1))
