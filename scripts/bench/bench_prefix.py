"""The prefix cache, end to end: `dspine-batch generate` with sharing on (the default) and off, side by side.

Workloads (the embedded SmolLM2 pair, chat template, default engine settings but ``prefix_cache_mb``):
  system   64 rows behind one ~1,500-token system prompt (``--system-prompt``), greedy
  samples  4 prompts of ~800 tokens, ``--num-samples 8`` at T = 0.8
  examples examples/prompts.jsonl as shipped (the SmolLM2 template's short default system prompt is all they share)
Each (workload, variant) is one whole CLI job in a fresh process (model load included), variants interleaved over
``--repeats``; a warm-up job first calibrates the cost model both variants share. Reported per job: wall seconds,
prompt tokens in total, prompt tokens computed (Σ prompt − cached_prompt_tokens, from the output Parquet) against
the unique prompt tokens (distinct prefixes of the rendered prompts), generated tok/s, peak RSS of the process and
the prefix tree's own peak, the ratio of wall time off/on, and whether the outputs are identical. The CPU model
and load average are printed first.

    python scripts/bench/bench_prefix.py                          # everything (~15 min on 2 cores)
    python scripts/bench/bench_prefix.py --workloads samples --repeats 2
    python scripts/bench/bench_prefix.py --json out/bench_prefix.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

WORKLOADS = ("system", "samples", "examples")
TOPICS = ["rivers", "bridges", "libraries", "volcanoes", "orchards", "lighthouses", "railways", "glaciers"]


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    isa = "amx" if "amx_bf16" in info else "avx512" if "avx512f" in info else "avx2" if "avx2" in info else "?"
    return f"{name} ({isa}), {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"


def _style_guide(tok, target_tokens: int) -> str:
    """A long, plausible system prompt: numbered house-style rules until ``target_tokens`` tokens."""
    rules, i = [], 0
    while len(tok.encode(" ".join(rules))) < target_tokens:
        t = TOPICS[i % len(TOPICS)]
        rules.append(f"Rule {i + 1}: when the question concerns {t}, first name the most relevant fact about {t}, "
                     f"then give one concrete example, keep sentences under twenty words, avoid jargon unless the "
                     f"reader used it first, and end with a single practical suggestion.")
        i += 1
    return "You are the house writer of a small museum. Follow these rules.\n" + "\n".join(rules)


def _document(tok, k: int, target_tokens: int) -> str:
    """A ~``target_tokens``-token document to summarise (different for each ``k``)."""
    parts, i = [], 0
    while len(tok.encode(" ".join(parts))) < target_tokens:
        t = TOPICS[(i + k) % len(TOPICS)]
        parts.append(f"Paragraph {i + 1} of report {k}: the survey of {t} in district {k * 7 + i} recorded "
                     f"{(k + 3) * (i + 5)} observations, {i % 4 + 1} of them unusual, and the team noted that "
                     f"the {t} changed most after the {['spring', 'summer', 'autumn', 'winter'][i % 4]} storms.")
        i += 1
    return "Summarise the following report in three sentences.\n\n" + " ".join(parts)


def build(workdir: Path, workloads: list[str], limit_system: int) -> dict[str, dict]:
    """Write each workload's JSONL and return {name: {"input", "args", "prompts" (rendered ids)}}."""
    from dspine_batch.engines.models import open_tokenizer, resolve_model

    tok = open_tokenizer(resolve_model("embedded"))
    user = [json.loads(x) for x in (REPO / "examples/prompts.jsonl").read_text().splitlines() if x.strip()]
    out = {}
    if "system" in workloads:
        system = _style_guide(tok, 1500)
        rows = [{"id": f"s{i:02d}", "prompt": f"{user[i % len(user)]['prompt']} (question {i})"}
                for i in range(limit_system)]
        out["system"] = {"rows": rows, "args": ["--system-prompt", system, "--max-new-tokens", "32"],
                         "render": lambda r, s=system: tok.render_chat([{"role": "system", "content": s},
                                                                        {"role": "user", "content": r["prompt"]}]),
                         "samples": 1}
    if "samples" in workloads:
        rows = [{"id": f"d{k}", "prompt": _document(tok, k, 800)} for k in range(4)]
        out["samples"] = {"rows": rows, "args": ["--num-samples", "8", "--temperature", "0.8",
                                                 "--max-new-tokens", "32"],
                          "render": lambda r: tok.render_chat([{"role": "user", "content": r["prompt"]}]),
                          "samples": 8}
    if "examples" in workloads:
        out["examples"] = {"rows": user, "args": [], "samples": 1,
                           "render": lambda r: tok.render_chat([{"role": "user", "content": r["prompt"]}])}
    for name, w in out.items():
        path = workdir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in w["rows"]))
        w["input"] = str(path)
        ids = [w["render"](r) for r in w["rows"] for _ in range(w["samples"])]
        w["total"] = sum(map(len, ids))
        w["unique"] = len({tuple(p[: i + 1]) for p in ids for i in range(len(p))})
    return out


def child(spec: dict) -> dict:
    """One CLI job in this process: wall, peak RSS and the output's token counts."""
    import pyarrow.parquet as pq

    from dspine.decoding import prefix
    from dspine_batch.cli import main

    trees = []
    init = prefix.PrefixCache.__init__

    def keep(tree, *a, **kw):  # the engine's tree, for its peak size
        init(tree, *a, **kw)
        trees.append(tree)

    prefix.PrefixCache.__init__ = keep
    t0 = time.perf_counter()
    try:
        main(["generate", spec["input"], "-o", spec["output"], "--progress", "none", *spec["args"]])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    wall = time.perf_counter() - t0
    parts = sorted(p for p in Path(spec["output"]).rglob("*.parquet") if "_dspine" not in p.parts)
    t = pq.ParquetDataset(parts).read().to_pydict()
    cached = t.get("cached_prompt_tokens") or [0] * len(t["prompt_tokens"])
    outputs = sorted(zip(t["row_id"], t["sample_index"], t["output"]))
    return {"wall_s": wall, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tree_peak_mb": max((t.peak_bytes for t in trees), default=0) / 2**20,
            "prompt_tokens": sum(t["prompt_tokens"]), "cached": sum(c or 0 for c in cached),
            "completion_tokens": sum(t["completion_tokens"]), "rows": len(t["prompt_tokens"]),
            "errors": sum(s != "ok" for s in t["status"]), "outputs": outputs}


def run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({spec['input']}, {spec['args'][-4:]}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--system-rows", type=int, default=64)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    print(cpu_line(), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        loads = build(work, a.workloads, a.system_rows)
        warm = work / "warm.jsonl"
        warm.write_text(json.dumps({"id": "w", "prompt": "Hello"}) + "\n")
        run_child({"input": str(warm), "output": str(work / "warm-out"), "args": ["--max-new-tokens", "4"]})
        for name, w in loads.items():
            print(f"\n[{name}] {len(w['rows'])} rows x {w['samples']} samples, prompt tokens {w['total']}, "
                  f"unique {w['unique']}", flush=True)
            for rep in range(a.repeats):
                got = {}
                for variant, mb in (("off", "0"), ("on", "512")):
                    spec = {"input": w["input"], "output": str(work / f"{name}-{variant}-{rep}"),
                            "args": [*w["args"], "--engine-arg", f"prefix_cache_mb={mb}"]}
                    r = run_child(spec)
                    got[variant] = r
                    computed = r["prompt_tokens"] - r["cached"]
                    print(f"  {variant:3s} wall {r['wall_s']:7.1f} s  computed {computed:6d} / {r['prompt_tokens']:6d}"
                          f"  gen {r['completion_tokens'] / r['wall_s']:6.1f} tok/s  peak RSS {r['rss_mb']:6.0f} MB"
                          f" (tree {r['tree_peak_mb']:.0f} MB)  errors {r['errors']}  load {os.getloadavg()[0]:.2f}",
                          flush=True)
                    results.append({"workload": name, "variant": variant, "repeat": rep, "unique": w["unique"],
                                    **{k: v for k, v in r.items() if k != "outputs"}})
                same = got["on"]["outputs"] == got["off"]["outputs"]
                exact = got["on"]["prompt_tokens"] - got["on"]["cached"] == w["unique"]
                print(f"  off/on wall ratio {got['off']['wall_s'] / got['on']['wall_s']:.2f}x  outputs identical: "
                      f"{same}  computed on = unique: {exact}", flush=True)
                results[-1]["identical"] = same
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"cpu": cpu_line(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
