"""A JSON-schema job side by side: plain decoding vs the defaults under the same schemas, and what the grammar
itself costs, in one run, in an order that cannot flatter.

The job (reference engine, embedded SmolLM2 pair, chat template, greedy): synthetic-data shapes of our own —
``extract`` (fill a nested person record from a paragraph), ``classify`` (a label from an enum with a short
reason), ``list`` (a list of objects: the items a paragraph names, with quantities). Variants per (c):
  plain       ``--draft none`` with no grammar (what a grammar costs is measured against this)
  none        ``--draft none`` under the schemas (the baseline)
  auto        the defaults under the schemas (draft, suffix matches, grammar-forced tokens; live prices)
Each cell repeats ``--repeats`` times, the variants' order alternating; min and median wall seconds, tok/s, the
ratio to ``none`` (wall, and process CPU seconds: with ``--threads 1`` the one that holds on a shared
machine), whether ``auto``'s outputs equal ``none``'s token for token, forced/suffix/draft tokens
accepted, and the share of rows that end with ``stop`` whose output validates against its schema (``jsonschema``,
not our code). Grammar cost: CPU ms per generated token of ``none`` minus ``plain`` over ``plain``'s ms per token.

    python scripts/bench/bench_structured.py --repeats 3 --concurrency 1 8
    python scripts/bench/bench_structured.py --cli --repeats 3 --concurrency 1 8   # whole jobs, set-up included

Each in-process run starts as a fresh job's generation does (``machine.fresh_job``: prefix cache empty, draft
not loaded yet: a stream that keeps it reads it inside its generation, as a job does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from machine import cpu_line, fresh_job, load_line, write_json  # noqa: E402

PEOPLE = [("Alice Martin", 34, "Lyon", "France", ["python", "cooking"]),
          ("Bob Stone", 51, "Denver", "USA", ["carpentry", "fishing"]),
          ("Chen Wei", 28, "Shanghai", "China", ["piano", "chess"]),
          ("Dana Ortiz", 45, "Madrid", "Spain", ["running"]),
          ("Emeka Obi", 39, "Lagos", "Nigeria", ["football", "writing", "music"]),
          ("Freya Lind", 23, "Oslo", "Norway", ["skiing"]),
          ("Gus Patel", 62, "Leeds", "England", ["gardening", "history"]),
          ("Hana Sato", 31, "Osaka", "Japan", ["drawing", "tennis"])]
PERSON = {"type": "object", "required": ["name", "age", "home", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "home": {"type": "object", "required": ["city", "country"],
                                  "properties": {"city": {"type": "string"}, "country": {"type": "string"}}},
                         "hobbies": {"type": "array", "items": {"type": "string"}}}}
REVIEWS = ["The battery died after two days and support never answered.", "Fast delivery, works exactly as shown.",
           "It is fine. Nothing special, nothing wrong.", "Broke the first time I used it; I want a refund.",
           "Lovely colour and the size fits perfectly.", "Arrived late but the product itself is good.",
           "Terrible smell, cheap plastic, returned it.", "Best purchase this year, I bought two more."]
LABEL = {"type": "object", "required": ["label", "reason"],
         "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                        "reason": {"type": "string", "maxLength": 80}}}
ORDERS = ["three apples, two pears and a melon", "one loaf of bread and four eggs", "two coffees and a croissant",
          "five pencils, one ruler and two notebooks", "a kilo of rice and three onions",
          "two tickets and one programme", "six bottles of water", "one hammer, twenty nails and a saw"]
ITEMS = {"type": "object", "required": ["items"],
         "properties": {"items": {"type": "array", "items": {
             "type": "object", "required": ["item", "quantity"],
             "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}}}}}}


def job() -> list[tuple[str, str, dict]]:
    """(id, user message, schema) rows of the three shapes."""
    rows = []
    for i, (name, age, city, country, hobbies) in enumerate(PEOPLE):
        first = name.split()[0]
        text = f"{name} is {age} years old and lives in {city}, {country}. {first} likes {', '.join(hobbies)}."
        rows.append((f"extract-{i}", f"Extract the person described below as JSON.\n\n{text}", PERSON))
    for i, review in enumerate(REVIEWS):
        rows.append((f"classify-{i}", f"Classify the sentiment of this review as JSON with a label and a reason.\n\n"
                                      f"Review: {review}", LABEL))
    for i, order in enumerate(ORDERS):
        rows.append((f"list-{i}", f"List the items of this order as JSON, each with its quantity.\n\nOrder: {order}",
                     ITEMS))
    return rows


def requests(tok, rows, with_schema: bool, max_new: int):
    from dspine_batch.engines.base import Request, SamplingParams, Structure

    out = []
    for rid, msg, schema in rows:
        ids = tok.render_chat([{"role": "user", "content": msg}])
        st = Structure("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":"))) if with_schema \
            else None
        out.append(Request(rid, 0, ids, SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(tok.eos_ids()),
                                                        structure=st)))
    return out


def run_once(engine, variant: str, reqs, c: int) -> dict:
    engine.proposers = None if variant in ("none", "plain") else ("suffix" if variant == "suffix" else "auto")
    engine.batch_size = c
    engine._cost(c)  # calibrated (or read from the cache) outside the timing
    fresh_job(engine)  # as a fresh job's generation starts (``machine.fresh_job``)
    t0, c0 = time.perf_counter(), time.process_time()
    res = list(engine.run(iter(reqs), c))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    acc = {k: sum(getattr(r, f"{k}_tokens_accepted") or 0 for r in res) for k in ("dspine", "suffix", "forced")}
    return {"wall": wall, "cpu": cpu, "tokens": sum(r.completion_tokens for r in res), "accepted": acc,
            "outputs": {r.row_id: r.token_ids for r in res}, "results": res, "load": os.getloadavg()[0]}


def validates(results, rows) -> tuple[int, int]:
    from jsonschema import ValidationError, validate

    schema = {rid: s for rid, _, s in rows}
    ok = n = 0
    for r in results:
        if r.finish_reason != "stop":
            continue
        n += 1
        try:
            validate(json.loads(r.text), schema[r.row_id])
            ok += 1
        except (ValueError, ValidationError):
            pass
    return ok, n


def run_cli(variant: str, src: Path, c: int, out: Path, max_new: int) -> dict:
    """The whole job as a user runs it (``dspine-batch generate``, a fresh process: imports, model and draft load,
    schema checks, grammar set-up, generation, the output written); wall seconds from start to exit."""
    import shutil
    import subprocess

    import pyarrow.dataset as ds

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", str(src), "-o", str(out), "--engine", "reference",
           "--engine-arg", f"batch_size={c}", "--max-in-flight", str(c)] + (["--draft", "none"] if variant == "none"
                                                                            else [])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{variant}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    cols = ["row_id", "output", "completion_tokens"]
    parts = [str(p) for p in sorted(out.glob("*.parquet"))]
    table = ds.dataset(parts, format="parquet").to_table(columns=cols).to_pylist()
    return {"wall": wall, "outputs": {r["row_id"]: r["output"] for r in table},
            "tokens": sum(r["completion_tokens"] or 0 for r in table), "load": os.getloadavg()[0]}


def main_cli(args) -> None:
    """``--cli``: defaults vs ``--draft none`` as whole jobs (set-up included), alternating, medians."""
    import tempfile

    rows = job()
    tmp = Path(tempfile.mkdtemp(prefix="bench_structured_"))
    src = tmp / "schema_job.jsonl"
    with src.open("w") as f:
        for rid, msg, schema in rows:
            f.write(json.dumps({"custom_id": rid, "method": "POST", "url": "/v1/chat/completions", "body": {
                "model": "embedded", "messages": [{"role": "user", "content": msg}], "max_tokens": args.max_new_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": rid.split("-")[0],
                                                                           "schema": schema}}}}) + "\n")
    print(f"cpu: {cpu_line()}, {load_line()}; {len(rows)} rows, whole CLI jobs", flush=True)
    report = {"cpu": cpu_line(), "cells": []}
    variants = ["none", "auto"]
    for c in args.concurrency:
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(args.repeats):
            for v in (variants if rep % 2 == 0 else variants[::-1]):
                runs[v].append(run_cli(v, src, c, tmp / f"out_{v}", args.max_new_tokens))
        med = {v: statistics.median(r["wall"] for r in rs) for v, rs in runs.items()}
        pairs = [n["wall"] / a["wall"] for n, a in zip(runs["none"], runs["auto"])]
        same = all(r["outputs"] == runs["none"][0]["outputs"] for rs in runs.values() for r in rs)
        cell = {"concurrency": c, "none_s": [round(r["wall"], 2) for r in runs["none"]],
                "auto_s": [round(r["wall"], 2) for r in runs["auto"]], "vs_none": round(med["none"] / med["auto"], 3),
                "pairs": [round(p, 3) for p in pairs], "identical": same, "tokens": runs["none"][0]["tokens"],
                "loads": [round(r["load"], 2) for rs in runs.values() for r in rs]}
        report["cells"].append(cell)
        print(f"c={c:<3} whole job: none median {med['none']:.2f} s, defaults {med['auto']:.2f} s: "
              f"x{cell['vs_none']:.3f} (pairs {cell['pairs']})  identical={same}  loads {cell['loads']}", flush=True)
    write_json(args.json, report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--variants", nargs="+", default=["plain", "none", "auto"])
    ap.add_argument("--threads", type=int, default=None, help="the engine's threads (1: CPU seconds hold under load)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cli", action="store_true", help="whole CLI jobs (set-up included): defaults vs --draft none")
    args = ap.parse_args()
    if args.cli:
        return main_cli(args)

    from dspine_batch.engines.reference import ReferenceEngine

    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    engine = ReferenceEngine.load("embedded", "embedded", {} if args.threads is None else
                                  {"threads": str(args.threads)})
    print(f"engine: dtype {engine.identity()['dtype']}, kernel {engine.target.kernel}", flush=True)
    rows = job()
    reqs = {v: requests(engine.tokenizer, rows, v != "plain", args.max_new_tokens) for v in args.variants}
    report = {"cpu": cpu_line(), "cells": []}
    for c in args.concurrency:
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for rep in range(args.repeats):
            for v in (args.variants if rep % 2 == 0 else list(reversed(args.variants))):
                runs[v].append(run_once(engine, v, reqs[v], c))
        med = {v: statistics.median(r["wall"] for r in rs) for v, rs in runs.items()}
        cpu = {v: statistics.median(r["cpu"] for r in rs) for v, rs in runs.items()}
        for v, rs in runs.items():
            first = rs[0]
            ok, n = validates(first["results"], rows)
            same = all(r["outputs"] == runs["none"][0]["outputs"] for r in rs) if "none" in runs and v != "plain" \
                else None
            cell = {"concurrency": c, "variant": v, "min_s": round(min(r["wall"] for r in rs), 3),
                    "median_s": round(med[v], 3), "tokens": first["tokens"],
                    "tok_s": round(first["tokens"] / med[v], 1),
                    "vs_none": round(med["none"] / med[v], 3) if "none" in med else None,
                    "cpu_median_s": round(cpu[v], 3),
                    "cpu_vs_none": round(cpu["none"] / cpu[v], 3) if "none" in cpu else None,
                    "identical_to_none": same, "accepted": first["accepted"], "stop_rows_valid": f"{ok}/{n}",
                    "loads": [round(r["load"], 2) for r in rs]}
            report["cells"].append(cell)
            print(f"c={c:<3} {v:<6} min {cell['min_s']:6.2f} s  median {cell['median_s']:6.2f} s  "
                  f"{cell['tokens']:5d} tok {cell['tok_s']:7.1f} tok/s  x{cell['vs_none'] or 0:.3f} vs none "
                  f"(cpu x{cell['cpu_vs_none'] or 0:.3f})  "
                  f"identical={same}  accepted {first['accepted']}  valid {ok}/{n}  loads {cell['loads']}",
                  flush=True)
        if "plain" in runs and "none" in runs:
            ms = {v: 1e3 * cpu[v] / runs[v][0]["tokens"] for v in ("plain", "none")}
            cost = (ms["none"] - ms["plain"]) / ms["plain"]
            report["cells"].append({"concurrency": c, "grammar_cost_per_token": round(cost, 4)})
            print(f"c={c:<3} grammar bookkeeping: {ms['none']:.2f} vs {ms['plain']:.2f} CPU ms a token "
                  f"({100 * cost:+.1f} %)", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
