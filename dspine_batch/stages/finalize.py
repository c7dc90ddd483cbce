"""``finalize`` of a staged OUTDIR: every stage audited in order, then ``OUTDIR/_SUCCESS``.

The first stage is audited against the job's inputs like any output. A later stage's expected rows are the
children of its parent stage's committed kept rows (across every shard), recomputed from those rows with the
stage's own ``explode`` as its manifest recorded it: each present exactly once, nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa

from dspine_batch.errors import EXIT_FATAL, EXIT_OK
from dspine_batch.log import log
from dspine_batch.ops.finalize import finalize
from dspine_batch.outdir.output import SUCCESS, committed_parts, open_output, read_part
from dspine_batch.stages.rows import child_ids, committed_parents
from dspine_batch.storage.objects import ObjectStore


def expected_children(parent_dir: str):
    """``finalize``'s expected ids for a stage whose parent stage is in ``parent_dir``."""
    parent = open_output(parent_dir).read_manifest() or {}
    samples = int((parent.get("config") or {}).get("num_samples", 1))

    def expected(manifest: dict) -> Iterator[pa.Array]:
        explode = (manifest["fingerprint_fields"].get("stage") or {}).get("explode")
        parents = committed_parents([p.path for p in committed_parts(parent_dir)], samples)
        yield pa.array([cid for p in parents for cid in child_ids(p, explode)], pa.string())

    return expected


def _root_success(outdir: str) -> None:
    """``OUTDIR/_SUCCESS`` of the whole staged job (on an object store: a create-only write)."""
    ObjectStore(outdir).create(SUCCESS, b"")  # a local directory is one more store (``storage.local``)


def shared_keys(stage_dir: str) -> list[tuple[str, str]]:
    """Pairs of kept rows of a dedup stage that share a dedup key, across every shard (there must be none)."""
    manifest = open_output(stage_dir).read_manifest() or {}
    if ((manifest.get("fingerprint_fields") or {}).get("stage") or {}).get("dedup") != "exact":
        return []  # near duplicates are claimed by band: no key to compare
    first: dict[str, str] = {}
    pairs = []
    for part in committed_parts(stage_dir):
        t = read_part(part.path, ["row_id", "kept", "dedup_key"])
        for rid, kept, key in zip(*(t.column(c).to_pylist() for c in ("row_id", "kept", "dedup_key")), strict=True):
            if kept and key:
                if key in first:
                    pairs.append((first[key], rid))
                else:
                    first[key] = rid
    return pairs


def finalize_stages(outdir: str, names: list[str], compact: bool, target_rows: int, on_damaged: str) -> int:
    for k, name in enumerate(names):
        path = os.path.join(outdir, name)
        log(f"stage {name}:")
        if open_output(path).read_manifest() is None:
            log(f"stage {name}: not started yet (none of its rows is committed); run the same generate command "
                "again to finish the job, then finalize")
            return EXIT_FATAL
        if k == 0:
            rc = finalize(path, compact, target_rows, on_damaged)
        else:
            rc = finalize(path, compact, target_rows, on_damaged,
                          expected_children(os.path.join(outdir, names[k - 1])))
        if rc != EXIT_OK:
            return rc
        if pairs := shared_keys(path):
            log(f"stage {name}: {len(pairs):,} kept rows duplicate another kept row's dedup key across shards "
                f"(row {pairs[0][1]!r} and row {pairs[0][0]!r}); _SUCCESS not written")
            return EXIT_FATAL
    _root_success(outdir)
    log(f"every stage complete ({' -> '.join(names)}); {outdir}/_SUCCESS written")
    return EXIT_OK
