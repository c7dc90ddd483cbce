#!/usr/bin/env python
"""Chunked prefill (issue 26): what ``--engine-arg prefill_chunk=N`` costs and buys on the embedded SmolLM2 pair.

Three measurements, each configuration in a fresh child process (so peak RSS is its own), on unique chat prompts
of ~1,400 tokens (a user asks for a summary of a report, as ``bench_prefill.py``), greedy, the reference engine's
defaults otherwise (the embedded draft, ``proposers=auto``, cost-aware verification; a warm-up job calibrates the
cost model once, it is cached on disk):

- ``prefill``: 8 prompts, 1 new token each, batch 8: nothing but prefill. Prompt tok/s and peak RSS per chunk size:
  what the default is chosen by (throughput lost to smaller forwards vs activation memory).
- ``job``: 16 prompts, 16 new tokens each, batch 8: the wall time of ``engine.run`` and the peak RSS, per chunk
  size; the outputs are compared with whole-prompt prefill (they must be identical).
- ``stall``: batch 2; a short row decoding 400 tokens while a ~1,400-token newcomer is prefilled (a row that
  finishes at its first token frees the slot). Reported: the tokens the running row commits between the
  newcomer's first prefill forward and its first token, and that row's longest gap between two commits.

    python scripts/bench/bench_chunked.py                                 # all three, chunks 0 128 256 512 1024
    python scripts/bench/bench_chunked.py --parts job --chunks 0 512 --json out/bench_chunked.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

PARTS = ("prefill", "job", "stall")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _engine(chunk: int, batch: int):
    from dspine_batch.engines.reference import ReferenceEngine

    return ReferenceEngine.load("embedded", "embedded", {"batch_size": str(batch), "prefill_chunk": str(chunk)})


def _requests(ids: list[list[int]], new: list[int]):
    from dspine_batch.engines.base import Request, SamplingParams

    return [Request(f"r{i:03d}", 0, p, SamplingParams(max_new_tokens=n, stop_token_ids=()))
            for i, (p, n) in enumerate(zip(ids, new))]


def _prompts(n: int, tokens: int, offset: int = 0) -> list[list[int]]:
    from bench_prefill import prompts

    from dspine_batch.engines.models import open_tokenizer, resolve_model

    tok = open_tokenizer(resolve_model("embedded"))
    return prompts(tok, n + offset, tokens)[offset:]


def child(spec: dict) -> dict:
    """One configuration: ``spec`` = {part, chunk, tokens}."""
    part, chunk = spec["part"], spec["chunk"]
    if part == "prefill":
        ids = _prompts(8, spec["tokens"])
        eng = _engine(chunk, 8)
        before = _rss_mb()
        t0 = time.perf_counter()
        out = list(eng.run(iter(_requests(ids, [1] * len(ids))), 8))
        wall = time.perf_counter() - t0
        n = sum(map(len, ids))
        return {"wall_s": wall, "prompt_tokens": n, "tok_s": n / wall, "rss_mb": _rss_mb(), "rss_before_mb": before,
                "digest": _digest(out)}
    if part == "job":
        ids = _prompts(16, spec["tokens"])
        eng = _engine(chunk, 8)
        before = _rss_mb()
        t0 = time.perf_counter()
        out = list(eng.run(iter(_requests(ids, [16] * len(ids))), 8))
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "prompt_tokens": sum(map(len, ids)), "rss_mb": _rss_mb(), "rss_before_mb": before,
                "completion_tokens": sum(len(r.token_ids) for r in out), "digest": _digest(out)}
    if part == "stall":
        from dspine.decoding import prefill, rows

        long = _prompts(1, spec["tokens"])[0]
        shorts = _prompts(2, 40, offset=1)
        shorts = [s[-40:] for s in shorts]  # two short prompts (the tail of a report request)
        eng = _engine(chunk, 2)
        events: list[tuple] = []
        push, forward, fill = rows.Row.push, eng.target.forward, prefill.fill
        filling = [False]

        def rec_push(row, new, logprobs=None):
            kept = push(row, new, logprobs)
            events.append(("push", row.index, kept, time.perf_counter()))
            return kept

        def rec_forward(x, cache, *a, **kw):
            events.append(("forward", filling[0], x.shape[1], time.perf_counter()))
            return forward(x, cache, *a, **kw)

        def rec_fill(*a, **kw):  # marks the forwards a prefill runs (a verify can hold as many tokens as a chunk)
            inner = fill(*a, **kw)
            while True:
                filling[0] = True
                try:
                    next(inner)
                except StopIteration as stop:
                    return stop.value
                finally:
                    filling[0] = False
                yield

        rows.Row.push, prefill.fill, eng.target.forward = rec_push, rec_fill, rec_forward
        t0 = time.perf_counter()
        out = list(eng.run(iter(_requests([shorts[0], shorts[1], long], [400, 1, 1])), 2))
        wall = time.perf_counter() - t0
        first_done = next(i for i, e in enumerate(events) if e[0] == "push" and e[1] == 1)
        start = next(i for i, e in enumerate(events) if i > first_done and e[0] == "forward" and e[1])
        end = next(i for i, e in enumerate(events) if e[0] == "push" and e[1] == 2)
        during = sum(e[2] for e in events[start:end] if e[0] == "push" and e[1] == 0)
        times = [e[3] for e in events if e[0] == "push" and e[1] == 0 and e[2]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        return {"wall_s": wall, "committed_during": during, "prefill_window_s": events[end][3] - events[start][3],
                "max_gap_s": max(gaps), "median_gap_s": sorted(gaps)[len(gaps) // 2],
                "prefill_forwards": sum(1 for e in events[start:end] if e[0] == "forward" and e[1]),
                "rss_mb": _rss_mb(), "digest": _digest(out)}
    raise ValueError(part)


def _digest(results) -> str:
    key = sorted((r.row_id, tuple(r.token_ids)) for r in results)
    return hashlib.sha256(repr(key).encode()).hexdigest()[:12]


def run_child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({spec}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_line() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--chunks", nargs="+", type=int, default=[0, 128, 256, 512, 1024])
    ap.add_argument("--tokens", type=int, default=1400, help="about this many tokens per long prompt")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    from bench_prefill import cpu_line

    print(f"# {cpu_line()}, {load_line()}", flush=True)
    run_child({"part": "job", "chunk": 0, "tokens": 64})  # warm-up: calibrates and caches the cost model
    results = []
    for part in a.parts:
        print(f"\n[{part}]", flush=True)
        base = None
        for c in a.chunks:
            r = run_child({"part": part, "chunk": c, "tokens": a.tokens})
            base = base or r["digest"]
            r.update(part=part, chunk=c, same=r["digest"] == base, load=os.getloadavg()[0])
            results.append(r)
            label = "whole" if c == 0 else str(c)
            if part == "prefill":
                print(f"  chunk {label:>5}: {r['prompt_tokens']} prompt tokens in {r['wall_s']:6.1f} s = "
                      f"{r['tok_s']:5.0f} tok/s  peak RSS {r['rss_mb']:5.0f} MB (after load {r['rss_before_mb']:.0f})"
                      f"  same tokens {r['same']}  {load_line()}", flush=True)
            elif part == "job":
                print(f"  chunk {label:>5}: wall {r['wall_s']:6.1f} s  peak RSS {r['rss_mb']:5.0f} MB (after load "
                      f"{r['rss_before_mb']:.0f})  {r['completion_tokens']} tokens  same tokens {r['same']}  "
                      f"{load_line()}", flush=True)
            else:
                print(f"  chunk {label:>5}: running row committed {r['committed_during']:3d} tokens during the "
                      f"newcomer's prefill ({r['prefill_forwards']} forwards, {r['prefill_window_s']:.1f} s); its "
                      f"longest gap {r['max_gap_s']:.2f} s (median {r['median_gap_s']:.3f} s)  same tokens "
                      f"{r['same']}  {load_line()}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"cpu": cpu_line(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
