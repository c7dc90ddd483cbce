"""Committed parts checked against their records, and damage moved aside: one rule for every store.

Each committed part is checked against its commit record, cheapest test first: its size (from one listing: catches
truncation and appends), then, with ``checksum``, the crc32 of all its bytes (bit rot that still decodes). A
record whose part is gone, with no staged bytes to publish it from, means a committed part was lost. A part that is
**missing, truncated, unreadable or altered** is reported in one line naming it and what is wrong, and moved aside
with its record to ``_dspine/damaged/`` under a name with neither ``train`` nor ``.parquet`` (readers and
``datasets``' split patterns must not pick it up): nothing is ever deleted, and a stale ``_SUCCESS`` goes. Its rows
are then not in the done-set, so they are generated again. With ``--on-damaged-part fail`` the start refuses
instead, leaving the part where it is.

Parts without a record (written before records existed; or one whose record a power cut tore) are trusted by row
count, as before: their footer must read. ``check_parts`` only reads, so ``status`` may run it next to a live
writer.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dspine_batch.errors import FatalError
from dspine_batch.outdir import legacy
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.layout import DAMAGED, PART_RE, STAGING, SUCCESS, record_rel, stem
from dspine_batch.outdir.records import CHECKSUM, crc_of

ON_DAMAGED = ("repair", "fail")


@dataclass
class PartCheck:
    """One committed part (or one commit record whose part is gone), checked against its commit record."""

    path: str  # OUTDIR/train-....parquet (a URL on an object store)
    problem: str | None = None  # "missing", "truncated (...)", "unreadable (...)", "altered (...)"; None: good
    info: dict[str, Any] | None = None  # rows, error_rows, outputs of a good part
    verified: bool = False  # checked against a record (False: an old part, trusted by its row count)
    summable: bool = False  # published, with a record whose size it has: its crc32 can be checked (``checksum_parts``)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def warn(msg: str) -> None:
    print(f"dspine-batch: {msg}", file=sys.stderr, flush=True)


def short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


def record_info(rec: dict[str, Any]) -> dict[str, Any] | None:
    """rows, outputs, error_rows as a record states them (None for a record from before it carried them all)."""
    if "error_rows" not in rec or "rows" not in rec:
        return None
    return {"rows": int(rec["rows"]), "outputs": int(rec["outputs"]), "error_rows": int(rec["error_rows"])}


def footer_info(out: Outdir, name: str) -> dict[str, Any]:
    """The part's own bookkeeping (rows, error_rows, ...) from its footer, without reading data."""
    md = out.read_footer(name)
    info = json.loads((md.metadata or {}).get(b"dspine_batch.part", b"{}"))
    info["outputs"] = md.num_rows
    return info


def check_parts(out: Outdir, tag: str | None = None, checksum: bool | None = None) -> list[PartCheck]:
    """Check every committed part of one shard (all when ``tag`` is None), plus a "missing" entry for each record
    whose part is gone. ``checksum`` None: the store's default (``Outdir.verify_on_start``). Listed in the order
    records, staged, published, so a commit or publish landing in between is never taken for a loss."""
    checksum = out.verify_on_start if checksum is None else checksum
    records = out.records(tag)
    staged = out.store.list(STAGING)
    top = out.store.list("")
    parts = {n: e.size for n, e in top.items() if (m := PART_RE.match(n)) and (tag is None or m.group(1) == tag)}
    checks: list[PartCheck] = []
    need_footer: list[PartCheck] = []
    hashed: list[PartCheck] = []
    for name in sorted(set(records) | set(parts)):
        rec, url = records.get(name), out.store.url_of(name)
        if name not in parts:
            if rec is not None and str(rec.get("staged", "")).rsplit("/", 1)[-1] in staged:
                checks.append(PartCheck(url, None, record_info(rec), verified=True))  # committed, publish pending
            elif not legacy.uncommitted(name, top):  # (an old commit's staging file explains it: swept, not lost)
                checks.append(PartCheck(url, "missing"))
            continue
        check = PartCheck(url, None, record_info(rec) if rec else None, verified=rec is not None)
        checks.append(check)
        if rec is not None:
            size, want = parts[name], int(rec["bytes"])
            if size < want:
                check.problem = f"truncated ({size:,} of {want:,} bytes)"
            elif size > want:
                check.problem = f"altered ({size:,} bytes, {want:,} committed)"
            else:
                check.summable = True
                if checksum:
                    hashed.append(check)
        if check.problem is None and check.info is None:
            need_footer.append(check)
    checksum_parts(out, hashed, records)
    for check in need_footer:
        if check.problem is not None:
            continue
        try:
            info = footer_info(out, check.name)
        except (pa.ArrowException, OSError, ValueError) as e:
            check.problem = f"unreadable ({short(e)})"
            continue
        rec = records.get(check.name)
        if rec is not None and info["outputs"] != int(rec["outputs"]):
            check.problem = f"altered ({info['outputs']:,} rows, {int(rec['outputs']):,} committed)"
        else:
            check.info = info
    return checks


def checksum_parts(out: Outdir, checks: list[PartCheck], records: dict[str, Any]) -> None:
    """The crc32 of each of these parts' bytes (``summable`` ones) against its record's; a mismatch or a read that
    fails sets the check's ``problem``. Four threads: zlib releases the GIL, so they scale with the disk."""
    if not checks:
        return
    with ThreadPoolExecutor(min(4, len(checks))) as pool:
        for check, crc in zip(checks, pool.map(lambda c: _crc(out, c.name), checks), strict=True):
            want = int(records[check.name][CHECKSUM])
            if isinstance(crc, BaseException):
                check.problem = f"unreadable ({short(crc)})"
            elif crc != want:
                check.problem = f"altered ({CHECKSUM} {crc:08x}, {want:08x} committed)"


def _crc(out: Outdir, name: str) -> int | BaseException:
    try:
        with out.store.open(name) as f:
            return crc_of(f)
    except OSError as e:
        return e


def handle_damage(out: Outdir, check: PartCheck, on_damaged: str = "repair", report: Callable[[str], None] = warn) \
        -> None:
    """``repair``: report the part in one line and move it (and its record) aside, so its rows are generated again;
    ``fail``: refuse, saying how to continue. Never deletes anything. The part goes first: once it is gone it is no
    longer visible, and a record without its part reads as lost until it follows."""
    assert check.problem is not None
    if on_damaged == "fail":
        raise FatalError(f"{check.path}: committed part is {check.problem}; stopped (--on-damaged-part fail): rerun "
                         "with --on-damaged-part repair to move it aside and regenerate its rows")
    name = check.name
    out.forget_records()
    dest = f"{DAMAGED}/part-{stem(name)}{time.strftime('.%Y%m%dT%H%M%S')}.{uuid.uuid4().hex[:6]}"
    moved = None
    for src, suffix in ((name, ".damaged"), (legacy.keys_rel(name), ".keys.npy"), (record_rel(name), ".commit.json")):
        if (src != legacy.keys_rel(name) or out.store.local) and out.store.head(src) is not None:
            out.store.move(src, dest + suffix)
            moved = moved or dest + suffix
    out.store.delete(SUCCESS)  # no longer true; a marker, not data: generate or finalize writes it again
    where = f"its commit record moved aside to {out.store.url_of(DAMAGED)}/" if check.problem == "missing" \
        else f"moved aside to {out.store.url_of(moved or DAMAGED)}"
    report(f"{check.path}: committed part is {check.problem}; {where}, its rows will be generated again")


def verify_parts(out: Outdir, tag: str | None = None, on_damaged: str = "repair", report: Callable[[str], None] = warn,
                 checksum: bool = True) -> list[PartCheck]:
    """``check_parts`` (with the crc32) and ``handle_damage`` for each damaged one; returns the good parts' checks.
    Call with the shard's lock held (``generate``) or every lock (``finalize``): it moves files."""
    good = []
    for check in check_parts(out, tag, checksum):
        if check.problem is None:
            good.append(check)
        else:
            handle_damage(out, check, on_damaged, report)
    return good
