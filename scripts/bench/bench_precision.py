#!/usr/bin/env python
"""What the precision policies cost in quality against fp32 (issues 26, 34), on the embedded target.

Two measurements, both of the same weights (the embedded SmolLM2 GGUF) under ``dtype=float32`` and each of
``--policies``: ``bf16`` (``dtype=bfloat16``; on an AVX512-BF16/AMX CPU our bf16 family of linears, elsewhere torch's
bf16 modules) and ``q8`` (``quant=q8``: our integer dot products over the GGUF blocks, inputs quantised per block of
32 to int8):

- **next-token agreement on held-out text**: this repository's own prose and code (README.md, docs/design.md,
  BENCHMARKS.md, dspine/decoding/decode.py: written after SmolLM2 was trained, so held out), cut into windows of
  ``--window`` tokens and read teacher-forced (every position's logits, one forward per window). Reported: the
  fraction of positions whose argmax agrees, and the mean KL(p_fp32 || p_policy) in nats.
- **greedy agreement of whole outputs** on ``examples/prompts.jsonl`` (chat template, ``--max-new-tokens``,
  plain decoding, batch 8): how many outputs are token-for-token identical, and the mean fraction of each fp32
  output that the policy's output reproduces before its first differing token.

    python scripts/bench/bench_precision.py --policies bf16 q8
    python scripts/bench/bench_precision.py --windows 8 --max-new-tokens 64 --json out/precision.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from machine import cpu_line, load_line

REPO = Path(__file__).resolve().parents[2]
HELD_OUT = ["README.md", "docs/design.md", "BENCHMARKS.md", "dspine/decoding/decode.py"]


def windows(tok, n: int, width: int) -> list[list[int]]:
    """``n`` windows of ``width`` tokens, taken evenly from the held-out files (each file's own windows)."""
    per_file = [tok.encode((REPO / f).read_text()) for f in HELD_OUT]
    cuts = [ids[i: i + width] for ids in per_file for i in range(0, len(ids) - width + 1, width)]
    step = max(1, len(cuts) // n)
    return cuts[::step][:n]


def next_token(t32, t16, wins: list[list[int]]) -> dict:
    import torch

    agree = total = 0
    kl = 0.0
    with torch.no_grad():
        for ids in wins:
            x = torch.tensor([ids])
            lp32 = t32.score(x).float().log_softmax(-1)[0]  # [T, V]
            lp16 = t16.score(x).float().log_softmax(-1)[0]
            agree += int((lp32.argmax(-1) == lp16.argmax(-1)).sum())
            total += len(ids)
            kl += float((lp32.exp() * (lp32 - lp16)).sum(-1).sum())
    return {"positions": total, "top1_agreement": agree / total, "mean_kl_nats": kl / total}


def greedy(t32, t16, tok, max_new: int) -> dict:
    from dspine import generate

    rows = [json.loads(line) for line in (REPO / "examples/prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [tok.render_chat([{"role": "user", "content": r["prompt"]}]) for r in rows]
    stop = tok.eos_ids()
    outs = {}
    for name, t in (("fp32", t32), ("other", t16)):
        t0 = time.perf_counter()
        outs[name] = [o.token_ids for o in generate(t, None, prompts, max_new_tokens=max_new, stop_token_ids=stop,
                                                  batch_size=8)]
        outs[name + "_s"] = time.perf_counter() - t0
    same = sum(a == b for a, b in zip(outs["fp32"], outs["other"]))
    kept = []
    for a, b in zip(outs["fp32"], outs["other"]):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        kept.append(k / max(1, len(a)))
    return {"outputs": len(prompts), "identical": same, "mean_prefix_kept": sum(kept) / len(kept),
            "fp32_tokens": sum(map(len, outs["fp32"])), "fp32_s": outs["fp32_s"], "policy_s": outs["other_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512, help="tokens per held-out window")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policies", nargs="+", default=["bf16", "q8"], choices=list(POLICIES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from dspine import load_target
    from dspine_batch.engines.models import open_tokenizer, resolve_model

    path = resolve_model("embedded")
    t32 = load_target(path)
    tok = open_tokenizer(path)
    wins = windows(tok, args.windows, args.window)
    print(f"# {cpu_line()}, fp32 kernel {t32.kernel}, {load_line()}", flush=True)
    results = {}
    for name in args.policies:
        t = load_target(path, **POLICIES[name]())
        nt = next_token(t32, t, wins)
        print(f"{name} ({t.kernel}): next token, {nt['positions']} held-out positions: top-1 agreement "
              f"{nt['top1_agreement']:.4%}, mean KL(fp32 || {name}) {nt['mean_kl_nats']:.2e} nats", flush=True)
        gr = greedy(t32, t, tok, args.max_new_tokens)
        print(f"{name}: greedy, {gr['outputs']} prompts x <= {args.max_new_tokens} new tokens: {gr['identical']} "
              f"identical, mean prefix kept {gr['mean_prefix_kept']:.1%} (fp32 {gr['fp32_s']:.1f} s, {name} "
              f"{gr['policy_s']:.1f} s)", flush=True)
        results[name] = {"kernel": t.kernel, "next_token": nt, "greedy": gr}
    print(f"# after: {load_line()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_line(), "fp32_kernel": t32.kernel, "policies": results}, indent=1))


def _bf16() -> dict:
    import torch

    return {"dtype": torch.bfloat16}


POLICIES = {"bf16": _bf16, "q8": lambda: {"dtype": _bf16()["dtype"], "quant": "q8"}}


if __name__ == "__main__":
    main()
