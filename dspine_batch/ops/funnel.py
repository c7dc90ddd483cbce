"""A staged job's funnel (``dspine_batch.stages``): per stage, the rows it received (``in``: the input's rows, or
the kept rows of the stage before it), made from list items (``exploded``, a stage with ``explode``), answered, kept
for the next stage, and the rows not kept counted by why (``DROPS``: its ``where`` false, a field it reads missing, an
output cut by length before it held that field, a duplicate,
not selected (a select step), an error; they add up to the rows not kept), with its
tokens, throughput and tokens per verify step (``tau``, overall and by proposal source), read from the committed
parts (each stage's ``report.summarize``). ``report OUTDIR`` prints it for a staged OUTDIR, then the final stage's
own report."""

from __future__ import annotations

import os
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds

from dspine_batch.ops.report import summarize
from dspine_batch.outdir.manifest import stage_names
from dspine_batch.outdir.output import arrow_path, committed_parts, open_output
from dspine_batch.storage.urls import is_url

# why a row was not kept, by column ("not selected": a select step ranked it out of its group, ``stages.select``)
DROPS = ("where false", "no field", "cut by length", "duplicate", "not selected", "error")


def drop_reason(dropped_by: str | None, status: str, finish_reason: str | None, where: str | None) -> str | None:
    """Why a row was not kept, as one of ``DROPS`` (None: kept), from its ``dropped_by`` (``stages.rows.Judge``),
    status and finish reason. A row its ``where`` could not read (a field missing, a value of the wrong type) whose
    output reached its token limit was cut by length, also where it was written before ``dropped_by`` said so."""
    if status != "ok" or dropped_by == "error":
        return "error"
    if not dropped_by:
        return None
    if dropped_by.startswith("dedup"):
        return "duplicate"
    if dropped_by.startswith("select:"):
        return "not selected"
    if dropped_by == f"where {where}" or (where is None and ": " not in dropped_by):
        return "where false"
    if "cut by length" in dropped_by or finish_reason == "length":
        return "cut by length"
    return "no field"


def funnel(outdir: str) -> list[dict[str, Any]] | None:
    """One dict per stage in order; None when OUTDIR is not a staged job."""
    names = stage_names(outdir)
    if names is None:
        return None
    out = []
    for name in names:
        path = f"{outdir.rstrip('/')}/{name}" if is_url(outdir) else os.path.join(outdir, name)
        row = {"stage": name, "in": out[-1]["kept"] if out else 0, "exploded": 0, "rows": 0, "ok": 0, "errors": 0,
               "filtered": 0, "duplicates": 0, "kept": 0, "dropped": dict.fromkeys(DROPS, 0), "completion_tokens": 0,
               "tokens_per_s": None, "tau": None, "tau_by_source": {}}
        files = [p.path for p in committed_parts(path)] if is_url(path) or os.path.isdir(path) else []
        if files:
            s = summarize(path)
            row.update(tokens_per_s=s["tokens_per_s"], tau=s["tau_token_weighted"],
                       tau_by_source={k: v["tau"] for k, v in s["by_source"].items() if v["tau"] is not None})
            if not out:
                row["in"] = s["input_rows"]
            fs = arrow_path(files[0]).get("filesystem")
            paths = [arrow_path(f)["source"] for f in files]
            t = ds.dataset(paths, format="parquet", filesystem=fs).to_table(
                columns=["row_id", "status", "kept", "dropped_by", "finish_reason", "completion_tokens"])
            stage = ((open_output(path).read_manifest() or {}).get("fingerprint_fields") or {}).get("stage") or {}
            if stage.get("explode"):  # rows made from its parents' list items (one per item, ids <parent>/<i>)
                row["exploded"] = len(pc.unique(t.column("row_id")))
            for kept, why, status, finish in zip(*(t.column(c).to_pylist() for c in ("kept", "dropped_by", "status",
                                                                                     "finish_reason")), strict=True):
                if not kept:
                    row["dropped"][drop_reason(why, status, finish, stage.get("where")) or "error"] += 1
            drops = row["dropped"]
            row.update(rows=t.num_rows, ok=int(pc.sum(pc.equal(t.column("status"), "ok")).as_py() or 0),
                       errors=int(pc.sum(pc.equal(t.column("status"), "error")).as_py() or 0),
                       filtered=drops["where false"] + drops["no field"] + drops["cut by length"],
                       duplicates=drops["duplicate"],
                       kept=int(pc.sum(pc.fill_null(t.column("kept"), False)).as_py() or 0),
                       completion_tokens=int(pc.sum(t.column("completion_tokens")).as_py() or 0))
        out.append(row)
    return out


HEADS = {"where false": "where-false", "no field": "no-field", "cut by length": "cut-length", "duplicate": "duplicate",
         "not selected": "unselected", "error": "error"}  # DROPS as one-word column heads


def format_funnel(rows: list[dict[str, Any]]) -> str:
    """The funnel as a table: each column says its unit (rows, tokens, tokens a second, tokens a verify step); the
    rows not kept by why, one column each, adding up to rows - kept."""
    drops = " ".join(f"{HEADS[d]:>11}" for d in DROPS)
    head = f"{'stage':<16} {'in':>7} {'exploded':>8} {'rows':>7} {'ok':>7} {'kept':>7} {drops} " \
           f"{'tokens':>9} {'tok/s':>7} {'tau':>6}  tau by source"
    lines = ["stages (rows; `in`: what the stage received, `exploded`: rows made from their list items; kept rows go "
             "on to the next stage, the last stage's are the dataset; the rest by why: `where` false, a field it reads "
             "missing or mistyped, the output cut by length before it held that field, a duplicate, not selected, an "
             "error):", head]
    for r in rows:
        speed = f"{r['tokens_per_s']:>7.1f}" if r["tokens_per_s"] is not None else f"{'-':>7}"
        tau = f"{r['tau']:>6.2f}" if r["tau"] is not None else f"{'-':>6}"
        by = ", ".join(f"{k} {v:.2f}" for k, v in r["tau_by_source"].items()) or "-"
        counts = " ".join(f"{r['dropped'][d]:>11,}" for d in DROPS)
        lines.append(f"{r['stage']:<16} {r['in']:>7,} {r['exploded']:>8,} {r['rows']:>7,} {r['ok']:>7,} "
                     f"{r['kept']:>7,} {counts} {r['completion_tokens']:>9,} {speed} {tau}  {by}")
    return "\n".join(lines)


def plot_funnel(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """The funnel as a PNG: per stage, its rows split into kept, filtered, duplicates and errors (a count axis with
    integer ticks), titled with the job."""
    from dspine_batch.errors import UsageError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from e
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4))
    names = [r["stage"] for r in rows]
    bottom = [0] * len(rows)
    for key, label in [("kept", "kept (go on)"), *((d, d) for d in DROPS)]:
        values = [r[key] if key == "kept" else r["dropped"][key] for r in rows]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("rows")
    ax.set_title(f"stages of {title}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
