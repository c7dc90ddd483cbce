"""A staged job (``[[stages]]``) against the same stages run as separate jobs, and how full it keeps the engine.

  python scripts/bench/bench_stages.py occupancy [--rows 200] [--max-in-flight 16] [--latency 0.3] [--commit-rows 32]
      the qa-from-docs shape (questions -> explode -> answers -> judge) on the scripted engine with latency: the
      engine's rows in flight over time, time-weighted, from the first stage-2 row admitted to the last stage-1
      row admitted (the body of the run), and over the whole run after that first admission (the tail included).
  python scripts/bench/bench_stages.py wall [--repeats 2] [--limit 6]
      jobs/recipes/qa-from-docs.toml on the embedded default as one job vs three separate jobs (each loading the
      model, the rows between stages built by hand as a user would), alternating order; wall seconds and model
      loads of each, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_line, load_line, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "jobs" / "recipes" / "qa-from-docs.toml"
DOCS = ROOT / "examples" / "docs.jsonl"


def occupancy(rows: int, max_in_flight: int, latency: float, commit_rows: int) -> dict:
    from dspine_batch.cli import main
    from dspine_batch.engines.registry import engines_replaced
    from dspine_batch.engines.scripted import ScriptedEngine

    samples: list[tuple[float, int, str]] = []  # (time, rows in flight after the event, stage of the row admitted)

    class Counting(ScriptedEngine):
        def run(self, requests, max_in_flight):  # noqa: ANN001
            live = {"n": 0}

            def pulled():
                for r in requests:
                    live["n"] += 1
                    samples.append((time.monotonic(), live["n"], r.row_id.split(":", 1)[0]))
                    yield r
            for res in super().run(pulled(), max_in_flight):
                live["n"] -= 1
                samples.append((time.monotonic(), live["n"], ""))
                yield res

    def loader(model, draft, args):  # noqa: ANN001
        return Counting(latency=latency)

    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "docs.jsonl"
        docs.write_text("".join(json.dumps({"doc_id": f"d{i:05d}", "text": f"Document {i} about tides {i % 7}."})
                                + "\n" for i in range(rows)))
        t0 = time.monotonic()
        with engines_replaced(loader):
            try:
                main(["generate", str(docs), "--config", str(RECIPE), "-o", str(Path(tmp) / "out"),
                      "--max-in-flight", str(max_in_flight), "--commit-rows", str(commit_rows), "--progress", "none"])
            except SystemExit as e:
                assert e.code in (0, 3, None), e.code
        wall = time.monotonic() - t0
    first2 = next(t for t, _, s in samples if s == "1")
    last1 = max(t for t, _, s in samples if s == "0")
    end = samples[-1][0]

    def full_share(a: float, b: float) -> float:
        full = total = 0.0
        for (t, n, _), (t2, _, _) in zip(samples, samples[1:]):
            lo, hi = max(t, a), min(t2, b)
            if hi > lo:
                total += hi - lo
                full += (hi - lo) if n >= max_in_flight else 0.0
        return full / total if total else 0.0

    return {"rows": rows, "max_in_flight": max_in_flight, "latency_s": latency, "commit_rows": commit_rows,
            "wall_s": round(wall, 2),
            "full_share_body": round(full_share(first2, last1), 3),
            "full_share_after_first_child": round(full_share(first2, end), 3),
            "first_child_at_s": round(first2 - samples[0][0], 2), "tail_s": round(end - last1, 2)}


def _run(cmd: list[str]) -> tuple[float, int]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DSPINE_BATCH_PROGRESS": "none"})
    if p.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)} -> {p.returncode}\n{p.stderr[-2000:]}")
    return time.monotonic() - t0, p.stderr.count("model loaded in")


def _three_jobs(tmp: Path, limit: int) -> tuple[float, int]:
    """The recipe's stages as three jobs by hand: the rows between them built from the outputs as a user would."""
    import tomllib

    import pyarrow.dataset as ds

    recipe = tomllib.loads(RECIPE.read_text())
    q, a, j = recipe["stages"]
    dsp = [sys.executable, "-m", "dspine_batch.cli", "generate"]
    common = ["--id-column", "id", "--max-new-tokens", str(recipe["max-new-tokens"])]
    docs = [json.loads(line) for line in DOCS.read_text().splitlines()][:limit]
    (tmp / "q.jsonl").write_text("".join(json.dumps({"id": d["doc_id"], "text": d["text"]}) + "\n" for d in docs))
    total, loads = 0.0, 0
    s, n = _run([*dsp, str(tmp / "q.jsonl"), "-o", str(tmp / "q"), *common, "--prompt-template", q["template"],
                 "--json-schema", json.dumps(q["json-schema"])])
    total, loads = total + s, loads + n
    rows = []
    for r in ds.dataset(str(tmp / "q"), format="parquet").to_table().to_pylist():
        if r["status"] == "ok":
            try:
                qs = json.loads(r["output"]).get("questions", [])
            except ValueError:
                continue
            text = next(d["text"] for d in docs if d["doc_id"] == r["row_id"])
            rows += [{"id": f"{r['row_id']}/{i}", "text": text, "questions": x} for i, x in enumerate(qs)]
    (tmp / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s, n = _run([*dsp, str(tmp / "a.jsonl"), "-o", str(tmp / "a"), *common, "--prompt-template", a["template"]])
    total, loads = total + s, loads + n
    answers = {r["row_id"]: r["output"] for r in ds.dataset(str(tmp / "a"), format="parquet").to_table().to_pylist()}
    (tmp / "j.jsonl").write_text("".join(json.dumps({**r, "output": answers.get(r["id"], "")}) + "\n" for r in rows))
    s, n = _run([*dsp, str(tmp / "j.jsonl"), "-o", str(tmp / "j"), *common, "--prompt-template", j["template"],
                 "--json-schema", json.dumps(j["json-schema"])])
    return total + s, loads + n


def wall(repeats: int, limit: int) -> dict:
    out: dict[str, list] = {"one_job_s": [], "three_jobs_s": [], "one_job_loads": [], "three_jobs_loads": []}
    for k in range(repeats):
        for which in (("one", "three") if k % 2 == 0 else ("three", "one")):
            with tempfile.TemporaryDirectory() as tmp:
                if which == "one":
                    s, n = _run([sys.executable, "-m", "dspine_batch.cli", "generate", str(DOCS), "--config",
                                 str(RECIPE), "-o", str(Path(tmp) / "qa"), "--limit", str(limit)])
                    out["one_job_s"].append(round(s, 1))
                    out["one_job_loads"].append(n)
                else:
                    s, n = _three_jobs(Path(tmp), limit)
                    out["three_jobs_s"].append(round(s, 1))
                    out["three_jobs_loads"].append(n)
            print(f"  {which}: {s:.1f}s, {n} model load(s)", flush=True)
    ratios = [t / o for o, t in zip(out["one_job_s"], out["three_jobs_s"])]
    return {**out, "three_over_one": [round(r, 2) for r in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["occupancy", "wall"])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-in-flight", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.3, help="seconds a scripted row takes (x0.5-1.5)")
    ap.add_argument("--commit-rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    print(f"# {cpu_line()}; {load_line()}")
    rep = occupancy(args.rows, args.max_in_flight, args.latency, args.commit_rows) if args.mode == "occupancy" else \
        wall(args.repeats, args.limit)
    print(json.dumps(rep, indent=2))
    print(f"# after: {load_line()}")
    write_json(args.json, rep)


if __name__ == "__main__":
    main()
