"""``status``: where a run stands, from what is on disk (works while it runs, across all shards).

Done/failed come from the committed parts (the truth); the per-shard state files add timing and whether
a shard is running (its lock is held), finished, interrupted, or dead (its state file says running but
nobody holds its lock: the process was killed without a chance to say so).

Remaining rows are the job's input rows less the committed ones, whenever the inputs can be counted: the same
files as the manifest recorded (sizes unchanged), counted by ``totals.count_rows`` (metadata for Parquet and
datasets, the lines of a JSON Lines file), whatever the state of the shards.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dspine_batch.ops.cost import cost_line, job_cost
from dspine_batch.outdir.output import open_output
from dspine_batch.storage.fs import size as store_size


def read_status(outdir: str, verify: bool = False) -> dict[str, Any]:
    """Counts from the parts that pass their check: size against the commit record (cheap: status stays fast on big
    outputs; an old part's footer), plus the crc32 of every part's bytes with ``verify``. Damaged parts are only
    listed: status runs next to live writers without their lock, so it never moves files. Running = a held lock
    (the kernel drops it when the process dies, even kill -9) or a live lease."""
    out = open_output(outdir)
    manifest = out.read_manifest() or {}
    done = failed = outputs = 0
    checks = out.check_parts(None, checksum=verify)
    damaged = [{"path": c.path, "problem": c.problem} for c in checks if c.problem is not None]
    parts = [c for c in checks if c.problem is None]
    for part in list(parts):
        info = part.info or {}
        if "rows" in info:
            done, failed, outputs = done + info["rows"], failed + info.get("error_rows", 0), outputs + info["outputs"]
            continue
        try:
            t = out.read_table(part.name, columns=["row_id", "status"])
        except (pa.ArrowException, OSError, ValueError) as e:
            damaged.append({"path": part.path, "problem": f"unreadable ({str(e).strip()[:160]})"})
            parts.remove(part)
            continue
        outputs += t.num_rows
        done += len(pc.unique(t.column("row_id")))
        failed += len(pc.unique(pc.filter(t.column("row_id"), pc.equal(t.column("status"), "error"))))
    held = {h.removeprefix("lock-").removeprefix("lease-") for h in out.held_locks()}
    shards = []
    for tag, st in out.states():
        st["running"] = tag in held
        if st.get("state") == "running" and not st["running"]:
            st["state"] = "dead"  # it never wrote its end: killed, or its machine went away
        shards.append(st)
    total = sum(s.get("total_rows", 0) for s in shards if s.get("state") == "done")
    n_shards = int(manifest.get("num_shards", 1) or 1)
    all_done = bool(shards) and all(s.get("state") == "done" for s in shards) and len(shards) == n_shards
    inputs = total if all_done else input_rows(manifest)
    started = {s.get("shard") for s in shards}
    missing = [f"{i}/{n_shards}" for i in range(n_shards) if f"{i}/{n_shards}" not in started] if manifest else []
    last = max((s.get("last_commit_at") or 0 for s in shards), default=0)
    return {"outdir": out.display, "fingerprint": manifest.get("fingerprint"),
            "num_shards": manifest.get("num_shards"), "rows_done": done - failed, "rows_failed": failed,
            "output_rows": outputs, "parts": len(parts),
            "input_rows": inputs, "rows_remaining": max(inputs - done, 0) if inputs is not None else None,
            "complete": out.has_success() and not damaged,
            "last_commit_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) if last else None,
            "shards": shards, "shards_not_started": missing, "damaged_parts": damaged,
            "cost": job_cost(shards),  # every shard's starts: the whole job's machine time
            "parts_verified": sum(c.verified for c in parts) if verify else None}


def input_rows(manifest: dict[str, Any]) -> int | None:
    """The job's input rows, counted now, when its inputs are the files the manifest recorded (None otherwise)."""
    from dspine_batch.inputs.sources import resolve_inputs
    from dspine_batch.inputs.totals import count_rows

    config = manifest.get("config") or {}
    recorded = (manifest.get("fingerprint_fields") or {}).get("inputs") or []
    try:
        files = resolve_inputs(list(config.get("inputs") or []), config.get("split"))
        sizes = [sum(store_size(p) for p in f.content_files()) for f in files]  # URLs too
    except Exception:  # moved, deleted, unreadable: not knowable
        return None
    if not files or sizes != [x.get("size") for x in recorded]:
        return None
    return count_rows(files, config.get("limit"))


def format_status(st: dict[str, Any]) -> str:
    remaining = "unknown (the inputs are not where the manifest says, or changed)" if st["rows_remaining"] is None \
        else f"{st['rows_remaining']:,} of {st['input_rows']:,} input rows"
    lines = [f"{st['outdir']}  fingerprint {st['fingerprint']}",
             f"  done {st['rows_done']:,}  failed {st['rows_failed']:,}  remaining {remaining}",
             f"  {st['output_rows']:,} output rows in {st['parts']} parts; last commit {st['last_commit_at'] or '-'}"
             f"; {'complete (_SUCCESS)' if st['complete'] else 'not finalized'}"]
    for s in st["shards"]:
        what = "running" if s["running"] else s.get("state", "?")
        if what == "dead":
            what = f"dead (pid {s.get('pid')} ended without finishing; run the same command again to resume)"
        slurm = f", Slurm {s['slurm_job']} restart {s.get('attempt', 0)}" if s.get("slurm_job") else ""
        lines.append(f"  shard {s.get('shard')}: {what}, {s.get('rows_done', 0):,} rows, starts {s.get('starts')}"
                     f"{slurm}")
        if s.get("stalled") and what == "interrupted":  # the watchdog ended its last start (``watchdog``)
            lines.append(f"    {s['stalled']}")
    cost = st.get("cost")
    if cost and (cost["cpu_s"] or cost["cost"] is not None):
        lines.append(f"  cost {cost_line(cost)}")
    for d in st.get("damaged_parts") or ():
        lines.append(f"  damaged: {d['path']}: {d['problem']}; the next generate (or finalize) of this output moves "
                     "it aside and generates its rows again")
    if st.get("shards_not_started"):
        lines.append(f"  shards not started yet: {', '.join(st['shards_not_started'])}")
    return "\n".join(lines)
