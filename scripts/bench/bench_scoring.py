"""Scoring without decoding (issue 55) against generating a one-token verdict, on the same rows and engine.

  python scripts/bench/bench_scoring.py [--rows 48] [--repeats 3] [--json out.json]
  python scripts/bench/bench_scoring.py recipe [--limit 6] [--json out.json]
      jobs/recipes/best-of-n.toml on the embedded default, split by stage: a job of its first stage alone (the
      samples), then the whole recipe on the same OUTDIR (the samples resumed as committed: its time is the scoring
      and the select step), each a fresh process; wall seconds and the model load each logged.

The rows are the best-of-n recipe's scoring prompts (jobs/recipes/best-of-n.toml: a question, an answer, "Reply Yes
or No.") over examples/questions.jsonl with made-up answers of 20-60 words, on the embedded default (SmolLM2 + the
shipped draft). Two ways to judge each row, side by side in one run, alternating order, each repeat on a fresh
prefix cache (``machine.fresh_job``):
- score: ``engine.score`` with the labels Yes / No (one prefill of the prompt, both labels read at its last
  position), 16 rows at a time as the scheduler gathers them;
- verdict: ``engine.run`` with ``max_new_tokens = 1``, greedy (the prompt prefilled, one token decoded), the whole
  list in flight at once.
Rows per second of each; how often the verdict's token is a label at all, and of those how often it is the label
the score ranks first (a check that both read the same distribution).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_line, fresh_job, load_line, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the light scatters because air molecules are small compared with its wavelength so blue is bent more "
         "a compiler turns source code into machine code checking types and optimising loops before it runs "
         "spiders have eight legs and two body parts while insects have six legs water boils at one hundred "
         "degrees").split()


def prompts(engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    qs = [json.loads(line)["question"] for line in (ROOT / "examples" / "questions.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        text = f"Question: {qs[i % len(qs)]}\nAnswer: {answer}\n\nIs the answer correct and helpful? Reply Yes or No."
        out.append(engine.tokenizer.render_chat([{"role": "user", "content": text}]))
    return out


def recipe(limit: int) -> dict:
    """The best-of-n recipe's time by stage (module docstring)."""
    import re
    import subprocess
    import tempfile

    text = (ROOT / "jobs" / "recipes" / "best-of-n.toml").read_text()
    first = text[: text.index("[[stages]]", text.index("[[stages]]") + 1)]  # the job and its first stage only
    out: dict = {"cpu": cpu_line(), "load_before": load_line(), "limit": limit}
    with tempfile.TemporaryDirectory() as tmp:
        for name, body in (("samples", first), ("score_and_select", text)):
            job = Path(tmp) / f"{name}.toml"
            job.write_text(body)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "dspine_batch.cli", "generate", str(ROOT / "examples" /
                                "questions.jsonl"), "--config", str(job), "-o", f"{tmp}/out", "--limit", str(limit),
                                "--progress", "none"], capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t0
            assert p.returncode == 0, p.stderr[-2000:]
            load = re.search(r"model loaded in ([\d.]+)s", p.stderr)
            out[name] = {"wall_s": round(wall, 1), "model_load_s": float(load.group(1)) if load else None,
                         "lines": [ln for ln in p.stderr.splitlines() if "stage " in ln and "rows" in ln]}
    out["load_after"] = load_line()
    return out


def main() -> None:
    if sys.argv[1:2] == ["recipe"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("mode")
        ap.add_argument("--limit", type=int, default=6)
        ap.add_argument("--json")
        args = ap.parse_args()
        report = recipe(args.limit)
        print(json.dumps(report, indent=2))
        write_json(args.json, report)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    from dspine_batch.engines.base import Request, SamplingParams
    from dspine_batch.engines.reference import ReferenceEngine

    engine = ReferenceEngine.load("embedded", "embedded", {})
    raw = engine.tokenizer.tok
    labels = tuple(tuple(raw.encode(x, add_special_tokens=False).ids) for x in ("Yes", "No"))
    rows = prompts(engine, args.rows)
    stop = engine.tokenizer.stop_token_ids([])
    before = load_line()

    def score() -> list[str]:
        reqs = [Request(f"r{i}", 0, p, SamplingParams(), labels) for i, p in enumerate(rows)]
        out = []
        for j in range(0, len(reqs), 16):
            for r in engine.score(reqs[j:j + 16]):
                yes, no = (sum(lp) for lp in r.continuation_logprobs)
                out.append("Yes" if yes >= no else "No")
        return out

    def verdict() -> list[str]:
        reqs = [Request(f"r{i}", 0, p, SamplingParams(max_new_tokens=1, stop_token_ids=stop))
                for i, p in enumerate(rows)]
        got = {r.row_id: r.text for r in engine.run(iter(reqs), len(reqs))}
        return [got[f"r{i}"] for i in range(len(rows))]

    times: dict[str, list[float]] = {"score": [], "verdict": []}
    answers: dict[str, list[str]] = {}
    for rep in range(args.repeats + 1):  # the first round warms both paths (kernels, cost model), not timed
        order = [("score", score), ("verdict", verdict)]
        if rep % 2:
            order.reverse()
        for name, fn in order:
            fresh_job(engine)
            t0 = time.perf_counter()
            answers[name] = fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    said = [(a.strip(), b) for a, b in zip(answers["verdict"], answers["score"], strict=True)
            if a.strip() in ("Yes", "No")]  # rows whose one generated token is a label
    agree = sum(a == b for a, b in said)
    report = {"cpu": cpu_line(), "load_before": before, "load_after": load_line(), "rows": len(rows),
              "prompt_tokens_mean": sum(map(len, rows)) / len(rows),
              **{f"{k}_rows_per_s": [round(len(rows) / t, 2) for t in v] for k, v in times.items()},
              "speedup_median": round(sorted(v / s for v, s in zip(times["verdict"], times["score"], strict=True))
                                      [len(times["score"]) // 2], 2),
              "verdict_is_a_label": f"{len(said)} of {len(rows)}",
              "verdict_is_the_top_label": f"{agree} of {len(said)}"}
    print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
