"""Claims: a dedup key held by the first row that keeps it, for every shard of the job at once.

Each shard of a sharded job runs in its own process (a Slurm array task, a Kubernetes index) and knows only the
rows it committed; the set a shard dedups against (``rows.Judge.seen``) is its own. So that no two kept rows of the
whole job share a key, a row about to be kept claims its key with a create-only write under the stage's output
(``_dspine/<space>/<key>``: a hard link on a directory, ``If-None-Match: *`` on an object store — the primitives the
commit protocol rests on). The first claim wins; a row that finds another row's claim is a duplicate of it. A claim
names its row and shard, so a retry that finds its own write, or the same row generated again after a crash
(greedy, or seeded sampling on an engine that reproduces it), keeps its key.

A crash between a claim and the commit of its row leaves a claim whose row may come back with another text (an
engine that does not reproduce a sampled row). Its own shard knows such an exact-dedup claim for what it is — its
row, a key none of its committed or decided rows holds — and takes it over for the next of its rows with that key.
A row of another shard that met it meanwhile was dropped as a duplicate of a row that was not kept: the guarantee
that holds in every case is the one dedup is for (no two kept rows share a key); a unique text can be missed only
there, after a crash, on such an engine.

Exact dedup claims only when the job is sharded (one shard's own set sees every row). Near-duplicate dedup
(``near``) always keeps its index here, in claims of its LSH bands, so its memory does not grow with the job.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from dspine_batch.outdir.layout import CLAIM_SPACES, STATE

EXACT_SPACE, NEAR_SPACE = CLAIM_SPACES  # exact keys, minhash bands: each its own directory, wiped with the run


@dataclass(frozen=True)
class Owner:
    """The row holding a claim, and its shard's tag."""

    shard: str
    row: str


UNKNOWN = Owner("?", "?")  # a claim that cannot be read names no row: held by nobody we know, never kept twice
RELEASED = Owner("-", "-")  # a slot of a band's chain its row gave up (``near``): passed over, never claimed again


class Claims:
    """Create-only claims under one stage's output (a ``LocalOutput`` directory or an ``ObjectOutput``), in one
    namespace (``space``: ``dedup`` for exact keys, ``minhash`` for LSH bands)."""

    def __init__(self, output: Any, space: str = EXACT_SPACE):
        self.store = getattr(output, "store", None) if getattr(output, "remote", False) else None
        self.prefix = f"{STATE}/{space}"
        self.root = None if self.store is not None else os.path.join(output.path, STATE, space)

    def claim(self, key: str, me: Owner, note: str = "") -> tuple[Owner, str]:
        """Who holds ``key`` after this call, and the note they left: ``me`` when the claim is (or already was)
        ours. ``note`` travels with the claim (a near-duplicate claim carries its row's signature)."""
        body = json.dumps({"shard": me.shard, "row": me.row, "note": note}, sort_keys=True).encode()
        if self.store is not None:
            rel = f"{self.prefix}/{key}"  # flat on a store: no directory to grow
            if self.store.create(rel, body):
                return me, note
            return _held(self.store.get(rel))
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = _written(path, body)
        try:
            os.link(tmp, path)  # create-only and whole: the claim appears with its body or not at all
        except FileExistsError:
            with open(path, "rb") as f:
                return _held(f.read())
        finally:
            os.unlink(tmp)
        return me, note

    def take(self, key: str, me: Owner, note: str = "") -> Owner:
        """Overwrite ``key``'s claim with ``me``: only for a claim left by an earlier attempt of a row of this
        shard (the shard is held by this process, so nobody else takes it; readers see the old or the new)."""
        body = json.dumps({"shard": me.shard, "row": me.row, "note": note}, sort_keys=True).encode()
        if self.store is not None:
            self.store.put(f"{self.prefix}/{key}", body)
        else:
            path = self._path(key)
            os.replace(_written(path, body), path)
        return me

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)  # 256 sub-directories: no huge directory on a disk


def _held(data: bytes | None) -> tuple[Owner, str]:
    try:
        d = json.loads(data) if data is not None else None
        return Owner(str(d["shard"]), str(d["row"])), str(d.get("note") or "")
    except (ValueError, KeyError, TypeError):
        return UNKNOWN, ""


def _written(path: str, body: bytes) -> str:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())  # a claim must outlive a power cut as the committed row after it does
    return tmp
