"""What an interrupted commit leaves, settled: publishes finished, uncommitted staged bytes removed.

After a crash between a part's record and its publish, the part is committed but not yet visible to readers: its
staged bytes are published now (``commit``'s step 3, again). Staged bytes that no record names (a crash before the
record, or a commit that lost the race for its number) were never committed and are deleted, as are a store's
staged copies of parts already published (the batched delete a crash cut short). On a local disk written by an
older version, its staging files are swept the way that version did (``legacy``). Run with the shard's lock or
lease held, after the journals (``recovery``).
"""

from __future__ import annotations

from dspine_batch.outdir import legacy
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.layout import STAGING, shard_of, staged_part


def sweep(out: Outdir, tag: str | None = None) -> int:
    """Finish every interrupted publish of one shard (all with None) and delete its uncommitted staged bytes;
    returns how many uncommitted parts were discarded."""
    records = out.records(tag)
    tokens = {r.get("token") for r in records.values() if r is not None}
    staged = out.store.list(STAGING)
    top = out.store.list("")
    for name, rec in records.items():
        if rec is None or name in top or not rec.get("staged"):
            continue
        if (key := rec["staged"].rsplit("/", 1)[-1]) in staged:  # committed, publish interrupted: finish it
            out.publish(rec)
            top[name] = staged[key]
            if out.store.renames:
                del staged[key]
    orphans, unknown = [], 0
    for n in staged:
        part, token = staged_part(n)
        sh = shard_of(part) if part else None
        if part and sh and (tag is None or sh == tag):
            rec = records.get(part)
            if token not in tokens or (rec is not None and part in top and rec.get("token") == token):
                orphans.append(f"{STAGING}/{n}")
                unknown += token not in tokens  # uncommitted; the others are copies of published parts
    out.store.delete_many(orphans)
    if orphans:
        out.forget_records()
    return unknown + legacy.sweep(out, tag, top)
