"""The done-set of a shard: the row keys of its committed parts, built from the records every start.

"The row's key is in a committed part" means "the row is done" (all samples of a row go into one part), so a resume
skips exactly the committed rows. Keys are 64-bit hashes (``keyset``), loaded from the records (one small read a
part, no row id read or hashed; only the parts above the watermarks, ``Outdir.keys_of``), each list checked against
its record's row count and crc32: a wrong hash would skip an unrelated row or redo a done one. A part whose list is
missing or doubtful (an old part: its key file, or its ``row_id`` column) is read instead; one whose ``row_id``
cannot be read is damaged (``check.handle_damage``). The advisory state file is never trusted for correctness: the
done-set is rebuilt from the parts every time. Rows below a shard's watermarks (``watermark``: positional ids only)
are done by position, not by key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dspine_batch.outdir import legacy, watermark
from dspine_batch.outdir.check import PartCheck, check_parts, checksum_parts, handle_damage, short, warn
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.keyset import KeySet, fallback_id_hashes, key_hashes
from dspine_batch.outdir.layout import seq_of
from dspine_batch.outdir.watermark import Mark

ENV_CRC = "DSPINE_BATCH_START_CRC_BYTES"
CRC_BUDGET = 4 << 30  # ~1-3 s of crc32 on 2 cores from the page cache; past it a start reads what it resumes from


def crc_budget() -> int:
    """The committed bytes of a local shard up to which a start checks every part's crc32 (``ENV_CRC``). Past it
    only the parts above the watermarks: a 100M-row shard of real outputs is hundreds of GB, minutes of reads at
    every start; the parts below are never read by the resume, and ``finalize`` (and ``status --verify``) checks
    every part."""
    try:
        return int(os.environ.get(ENV_CRC, CRC_BUDGET))
    except ValueError:
        return CRC_BUDGET


@dataclass
class DoneSet:
    keys: KeySet  # with ``marks``: only the keys of parts holding a row at or above a watermark
    rows: int  # distinct row ids committed
    error_rows: int
    outputs: int
    next_seq: int
    damaged: int = 0  # parts moved aside by this start (their rows are not in the done-set)
    marks: dict[str, Mark] = field(default_factory=dict)  # input name -> watermark (``watermark``)
    below_parts: int = 0  # parts wholly below the watermarks: their keys were not loaded


def load_done(out: Outdir, tag: str, id_column: bool = True, on_damaged: str = "repair",
              report: Callable[[str], None] = warn) -> DoneSet:
    """The done-set of one shard, from its checked parts (``id_column``: ids hash as strings, else as
    ``<file>:<index>``, like ``mapping.RowIds``). A damaged part is handled by ``handle_damage`` and left out.
    Without an id column (positional ids) the checked parts' spans give watermarks (``watermark``): the keys of
    parts wholly below them are not loaded, the resume never reads those rows again. With an id column every key
    stays: a later row repeating an earlier row's id is told apart only by having seen every id before it."""
    records = out.records(tag)
    checks = check_parts(out, tag, checksum=False)  # sizes and footers; the crc32 below, where the start reads
    seqs = [seq_of(c.name) for c in checks] + [seq_of(n) for n in records]
    keys = KeySet()
    rows = errors = outputs = damaged = 0
    good = []
    for check in checks:
        if check.problem is not None:
            handle_damage(out, check, on_damaged, report)
            damaged += 1
        else:
            good.append(check)
    spans = {}
    if not id_column and watermark.enabled():
        for check in good:
            rec = records.get(check.name)
            if rec is not None and check.info is not None and (got := watermark.record_spans(rec)) is not None:
                spans[check.name] = got
    marks, below = watermark.watermarks(spans)
    if out.verify_on_start:  # a local disk: every part's crc32, or past the budget those above the watermarks
        summed: set[str] = set()
        sizes = {n: int(rec["bytes"]) for n, rec in records.items() if rec is not None}
        every = sum(sizes.get(c.name, 0) for c in good if c.summable) <= crc_budget()
        if not every and below:
            left = sum(sizes.get(n, 0) for n in below)
            report(f"{out.display}: {len(below):,} parts below the inputs' watermarks ({left / 1e9:.1f} GB, over "
                   f"{ENV_CRC}={crc_budget():,}): their sizes checked, their crc32 left to finalize")
        while due := [c for c in good if c.summable and (every or c.name not in below) and c.name not in summed]:
            checksum_parts(out, due, records)
            summed.update(c.name for c in due)
            for check in [c for c in due if c.problem is not None]:
                handle_damage(out, check, on_damaged, report)
                damaged += 1
                good.remove(check)
                spans.pop(check.name, None)  # its spans no longer count: the watermarks may fall, and more be due
            marks, below = watermark.watermarks(spans)
    # the key lists of the parts above the watermarks only (records are held without them: ``Outdir.records``)
    listed = out.keys_of([c.name for c in good if c.name not in below and records.get(c.name) is not None
                          and "keys_crc32" in records[c.name]])  # type: ignore[operator]
    for check in good:
        info = check.info or {}
        if check.name in below:
            rows += int(info["rows"])
            errors += int(info.get("error_rows", 0))
            outputs += int(info["outputs"])
            continue
        rec = records.get(check.name)
        hashes = listed.get(check.name)
        if hashes is None:
            hashes = legacy.load_keys(out, check.name, info.get("rows"), rec)
        if hashes is not None:
            keys.add_many(hashes)
            rows += int(info["rows"])
            errors += int(info.get("error_rows", 0))
            outputs += int(info["outputs"])
            continue
        try:
            got = _from_row_ids(out, check, rec, id_column)
        except (pa.ArrowException, OSError, ValueError) as e:
            check.problem = f"unreadable ({short(e)})"
            handle_damage(out, check, on_damaged, report)
            damaged += 1
            if check.name in spans:  # its spans made the watermarks: made again without them (it is moved aside)
                again = load_done(out, tag, id_column, on_damaged, report)
                again.damaged += damaged
                return again
            continue
        keys.add_many(got[0])
        rows, errors, outputs = rows + got[1], errors + got[2], outputs + got[3]
    return DoneSet(keys, rows, errors, outputs, max(seqs) + 1 if seqs else 0, damaged, marks, len(below))


def _from_row_ids(out: Outdir, check: PartCheck, rec: dict | None, id_column: bool) -> tuple[np.ndarray, int, int,
                                                                                             int]:
    """(key hashes, rows, error rows, outputs) of a part read from its ``row_id`` and ``status`` columns (published,
    or still staged when its publish is pending)."""
    rel = check.name if rec is None or out.store.head(check.name) is not None else rec["staged"]
    t = out.read_table(rel, columns=["row_id", "status"])
    ids = pc.unique(t.column("row_id"))
    bad = pc.unique(pc.filter(t.column("row_id"), pc.equal(t.column("status"), "error")))
    hashes = (key_hashes if id_column else fallback_id_hashes)(ids.to_pylist())
    return hashes, len(ids), len(bad), t.num_rows
