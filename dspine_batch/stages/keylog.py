"""The key log: the dedup keys every shard of a job has kept, one object per committed part, in one total order.

Each shard of a sharded job runs in its own process and knows only the rows it committed, so that no two kept rows
of the whole job share a key (or, for ``dedup = "minhash"``, are near duplicates) the shards must hear of each
other's kept keys. Before, a row about to be kept claimed its key with a create-only object of its own (nine for a
near-duplicate row's LSH bands): one request per kept row. Here a *part* is the unit: just before a part is
committed, its shard appends one **entry** (the part's kept rows: row-id hashes, dedup keys, and for minhash their
signatures) to the stage's log, ``_dspine/<space>/log-<n>``, with a create-only write of the next free position
``n`` (``If-None-Match: *`` on an object store, a hard link on a disk: the commit protocol's own primitive). A
position is taken by exactly one writer, and a writer only takes ``n`` after reading every entry before it, so the
log is a total order of decisions with no holes, and each decision was taken knowing every decision before it.

A part's rows are decided against everything the log holds before its entry (``rows.Judge.settle``): a row whose
key an earlier entry (or an earlier row of its shard) holds is a duplicate. Losing the race for position ``n``
(another shard appended first) means reading that entry, deciding the part again and trying ``n + 1``: optimistic
concurrency, so the requests a part costs are one write, plus one read for each entry other shards appended
since this shard last looked and one that finds the end (and one failed write when it lost a race: a shard that
sees others appending reads before it writes). They grow with parts, not rows.

**Blocks.** A shard reads every entry the others appended, one GET each: at 1000 shards that is ~1,000 GETs a
part, and a requeued shard starts by reading the whole log. So whoever reads the 64 entries of an aligned block
``[64k, 64k + 64)`` one by one in one pass (they all exist: positions are taken without holes) writes them, byte
for byte, as ``block-<k>`` with a create-only write (every writer's copy is the same bytes, so which one lands does
not matter), and a reader at an aligned position asks for the block first: one GET for 64 entries. Entries are
never changed, so a block is the entries; one that does not read as a block is ignored (its entries are read one
by one). Where shards keep up with each other (2-8 shards, a few entries a part) no one reads 64 at once and the
cost is one GET that finds no block every 64 positions. ``DSPINE_BATCH_KEYLOG_BLOCKS=0`` reads entries only (the
benchmark compares both).

A crash between a part's entry and its commit record leaves an entry whose part never committed. Other shards
cannot tell, and take its keys as held (a row of theirs with such a key is dropped: the guarantee that holds in
every case is the one dedup is for, no two kept rows share a key; a unique text can be missed there, after a
crash, on an engine that does not reproduce a sampled row). Its own shard knows: it reads its own entries only
for rows it has committed as kept (row id and key as its parts hold them), so the rows it generates again decide
as if the dead attempt had never been.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspine_batch.outdir.layout import CLAIM_SPACES, STATE

EXACT_SPACE, NEAR_SPACE = CLAIM_SPACES  # exact keys, minhash bands: each its own log, wiped with the run
BLOCK = 64  # entries a block holds (``block-<k>``: positions [64k, 64k + 64))


def blocks_enabled() -> bool:
    return os.environ.get("DSPINE_BATCH_KEYLOG_BLOCKS", "1") != "0"


def encode_block(raws: list[bytes]) -> bytes:
    """A block: its entries' bytes as they are, one ``.npy`` member each (``e00``..``e63``)."""
    buf = io.BytesIO()
    np.savez(buf, **{f"e{i:02d}": np.frombuffer(raw, dtype=np.uint8) for i, raw in enumerate(raws)})
    return buf.getvalue()


def decode_block(data: bytes) -> list[Entry | None] | None:
    """A block's entries (None for one that does not read as an entry, as when read alone), or None when the
    bytes are not a whole block."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            raws = [z[f"e{i:02d}"].tobytes() for i in range(BLOCK)]
    except (ValueError, KeyError, TypeError, OSError, EOFError):
        return None
    return [decode(raw) for raw in raws]


@dataclass
class Entry:
    """The kept rows of one part: their row-id hashes (``keyset.key_hash``), dedup keys (hex), and for minhash
    their signatures (``near.signature``, one row each)."""

    shard: str
    rows: np.ndarray  # uint64
    keys: list[str]
    sigs: np.ndarray | None = None  # (rows, near.NUM_PERM) uint32

    def encode(self) -> bytes:
        """numpy's ``.npz`` (a zip of ``.npy`` arrays: shape and dtype travel with the bytes, nothing pickled)."""
        arrays = {"meta": np.frombuffer(json.dumps({"shard": self.shard}).encode(), dtype=np.uint8),
                  "rows": self.rows.astype("<u8"),
                  "keys": np.frombuffer(b"".join(bytes.fromhex(k) for k in self.keys), dtype=np.uint8)}
        if self.sigs is not None:
            arrays["sigs"] = self.sigs.astype("<u4")
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()


def decode(data: bytes) -> Entry | None:
    """An entry's bytes, None when they do not read as one (held by nobody we know: never trusted as ours)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            shard = str(json.loads(z["meta"].tobytes())["shard"])
            rows = z["rows"].astype(np.uint64)
            raw = z["keys"].tobytes()
            sigs = z["sigs"].astype(np.uint32) if "sigs" in z.files else None
    except (ValueError, KeyError, TypeError, OSError, EOFError):
        return None
    width = len(raw) // max(len(rows), 1)
    keys = [raw[i * width:(i + 1) * width].hex() for i in range(len(rows))]
    return Entry(shard, rows, keys, sigs)


@dataclass
class KeyLog:
    """One stage's log under its output (any ``Output``: a disk is one more store), read from ``next`` on."""

    output: Any
    space: str = EXACT_SPACE
    next: int = 0  # the first position this shard has not read (nor written)
    # read before writing next time: at the start (the log may hold anything), and while other shards are seen
    # appending (then a blind write would mostly lose its race and upload its entry for nothing); a shard that
    # found nothing new writes first: one request a part
    busy: bool = True
    requests: dict[str, int] = field(default_factory=lambda: {"get": 0, "create": 0})
    blocks: bool = field(default_factory=blocks_enabled)

    def name(self, n: int) -> str:
        return f"{STATE}/{self.space}/log-{n:010d}"

    def block_name(self, k: int) -> str:
        return f"{STATE}/{self.space}/block-{k:08d}"

    def read_new(self) -> list[Entry | None]:
        """Every entry appended since this shard last looked (None for one that does not read), in log order: a
        whole block in one read where one is there; a block read entry by entry in this pass is written."""
        got: list[Entry | None] = []
        raws: list[bytes] = []  # the entries of the block being read one by one, from its first position
        while True:
            if self.blocks and self.next % BLOCK == 0:
                self.requests["get"] += 1
                data = self.output.store.get(self.block_name(self.next // BLOCK))
                block = decode_block(data) if data is not None else None
                if block is not None:
                    got.extend(block)
                    self.next += BLOCK
                    continue
                raws = []
            self.requests["get"] += 1
            data = self.output.store.get(self.name(self.next))
            if data is None:
                self.busy = bool(got)
                return got
            got.append(decode(data))
            self.next += 1
            if self.blocks and len(raws) == (self.next - 1) % BLOCK:  # every entry of this block so far read here
                raws.append(data)
                if len(raws) == BLOCK:
                    self.requests["create"] += 1
                    self.output.store.create(self.block_name(self.next // BLOCK - 1), encode_block(raws))
                    raws = []

    def append(self, entry: Entry) -> bool:
        """``entry`` at the next position: True when it is there, False when another shard took the position first
        (then ``read_new`` reads that entry, and the part is decided again)."""
        self.requests["create"] += 1
        if self.output.store.create(self.name(self.next), entry.encode()):
            self.next += 1
            return True
        self.busy = True
        return False
