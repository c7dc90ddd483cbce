#!/usr/bin/env python
"""Prompt reading (issue 26): prompt tokens/s of one target forward over each of 8 unique ~1,390-token chat prompts.

Columns, interleaved prompt by prompt in one process so they share the machine's load (each prompt alone, batch 1,
``torch.no_grad()``, the logits of the last position only, as prefill needs them):

- ``ours fp32``: the default engine's target (the embedded SmolLM2 GGUF, Q4_1/Q8_0 blocks, ``csrc/linear.cpp``);
- ``ours bf16``: ``dtype=bfloat16``, on an AVX512-BF16 CPU our bf16 family (``csrc/gemm_bf16.cpp``: bf16 weights
  and linear inputs, fp32 sums, over the GGUF blocks; a bf16 KV cache; norms and attention arithmetic fp32),
  elsewhere torch's bf16 modules; ``ours-bf16-kv32`` with an fp32 KV cache, ``ours-bf16-panels-kv32`` over bf16
  panels with an fp32 KV cache (the policy before the bf16 KV cache);
- ``HF fp32`` / ``HF bf16``: ``AutoModelForCausalLM`` from the same converted HF directory (``logits_to_keep=1``).

Then the GEMM roof on the model's widest shape, [1390 x 576] . [576 x 1536]: torch's fp32 and bf16 ``F.linear``
and our kernels (fp32 on the Q4_1 weight, the bf16 family), GFLOP/s, each as a fraction of torch's bf16 rate.
The CPU, threads and load average are printed with the numbers: the machines are shared, so only ratios within
one run mean much.

    python scripts/bench/bench_prefill.py
    python scripts/bench/bench_prefill.py --prompts 4 --threads 1 --json out/prefill.json
    python scripts/bench/bench_prefill.py --columns ours-fp32 --src ../main   # before a change (alternate)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from machine import cpu_line, load_line

REPO = Path(__file__).resolve().parents[2]
# --src DIR: import dspine from another checkout (the "before" of a change: run this script from the new tree with
# --src pointing at the old one, alternating with a run without it)
SRC = Path(sys.argv[sys.argv.index("--src") + 1]).resolve() if "--src" in sys.argv[:-1] else REPO
sys.path.insert(0, str(SRC))

TOPICS = ["rivers", "bridges", "libraries", "volcanoes", "orchards", "lighthouses", "railways", "glaciers"]


def prompts(tok, n: int, target_tokens: int) -> list[list[int]]:
    """``n`` unique chat-templated prompts of about ``target_tokens`` tokens: a user asks for a summary of a report."""
    out = []
    for k in range(n):
        parts, i = [], 0
        while True:
            t = TOPICS[(i + k) % len(TOPICS)]
            parts.append(f"Paragraph {i + 1} of report {k}: the survey of {t} in district {k * 7 + i} recorded "
                         f"{(k + 3) * (i + 5)} observations, {i % 4 + 1} of them unusual, and the team noted that the "
                         f"{t} changed most after the {['spring', 'summer', 'autumn', 'winter'][i % 4]} storms.")
            msgs = [{"role": "user", "content": "Summarise this report in three sentences.\n\n" + " ".join(parts)}]
            ids = tok.render_chat(msgs)
            if len(ids) >= target_tokens:
                out.append(list(ids))
                break
            i += 1
    return out


def ours(dtype, variant: str = ""):
    """``variant``: "" (as loaded), "kv32" (an fp32 KV cache), "panels-kv32" (bf16 panels instead of the GGUF blocks,
    fp32 KV: the bf16 policy before issue 26's bf16 KV cache and block formats)."""
    import torch

    from dspine import load_target
    from dspine_batch.engines.models import resolve_model

    if variant == "panels-kv32":
        from dspine.cpu.kernels import BF16DP

        target = load_target(resolve_model("embedded"), kernels=False).use_kernels(formats=(BF16DP,))
    elif variant == "kv32":
        target = load_target(resolve_model("embedded"), dtype=dtype, kv_dtype=torch.float32)
    else:
        target = load_target(resolve_model("embedded"), dtype=dtype)

    def run(ids: list[int]):
        x = torch.tensor([ids])
        cache = target.new_cache(1, len(ids))
        return target.logits(target.forward(x, cache).hidden[:, -1:])

    return target.kernel, run


def hf(dtype):
    import torch
    from transformers import AutoModelForCausalLM

    from dspine_batch.engines.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("embedded"), dtype=dtype).eval()

    def run(ids: list[int]):
        return model(torch.tensor([ids]), logits_to_keep=1, use_cache=True).logits

    return f"transformers {dtype}".replace("torch.", ""), run


def gemm_roof(reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from dspine.cpu import kernels

    M, K, N = 1390, 576, 1536
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 blocks span min..max
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.02).half().float()
    m = (torch.randn(N, K // 32, 1, generator=g) * 0.05).half().float()
    w = (d * q + m).reshape(N, K)  # a Q4_1-exact weight, as the model's are
    x = torch.randn(M, K, generator=g)
    wb, xb = w.bfloat16(), x.bfloat16()
    cols = {"torch fp32": lambda: F.linear(x, w), "torch bf16": lambda: F.linear(xb, wb)}
    if kernels.load():
        lin = kernels.PackedLinear(w)
        cols[f"ours fp32 ({lin.format})"] = lambda: lin(x)
        if getattr(kernels, "bf16dp_ok", lambda: False)():
            lbf = kernels.PackedLinear(w, formats=(kernels.BF16DP,))
            cols["ours bf16 (bf16dp)"] = lambda: lbf(x)
    best = {k: float("inf") for k in cols}
    for f in cols.values():
        f()
    for _ in range(reps):  # interleaved
        for k, f in cols.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    flops = 2 * M * N * K
    roof = flops / best["torch bf16"] / 1e9
    return [{"name": k, "gflops": flops / s / 1e9, "of_bf16_roof": flops / s / 1e9 / roof} for k, s in best.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1390, help="about this many tokens per prompt")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--columns", nargs="+", default=["ours-fp32", "ours-bf16", "hf-fp32", "hf-bf16"],
                    choices=["ours-fp32", "ours-bf16", "ours-bf16-kv32", "ours-bf16-panels-kv32", "hf-fp32", "hf-bf16"])
    ap.add_argument("--gemm-reps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--src", type=Path, default=REPO, help="the checkout whose dspine is measured (default: this one)")
    args = ap.parse_args()

    import torch

    from dspine_batch.engines.models import open_tokenizer, resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {cpu_line()}, torch threads {torch.get_num_threads()}, {load_line()}, dspine from {SRC}", flush=True)
    ids = prompts(open_tokenizer(resolve_model("embedded")), args.prompts, args.tokens)
    n_tokens = sum(len(p) for p in ids)
    print(f"# {len(ids)} prompts, {n_tokens} tokens ({min(map(len, ids))}-{max(map(len, ids))} each)", flush=True)
    makers = {"ours-fp32": lambda: ours(torch.float32), "ours-bf16": lambda: ours(torch.bfloat16),
              "ours-bf16-kv32": lambda: ours(torch.bfloat16, "kv32"),
              "ours-bf16-panels-kv32": lambda: ours(torch.bfloat16, "panels-kv32"),
              "hf-fp32": lambda: hf(torch.float32), "hf-bf16": lambda: hf(torch.bfloat16)}
    runs = {}
    for c in args.columns:
        label, fn = makers[c]()
        with torch.no_grad():
            fn(ids[0][:64])  # warm-up
        runs[c] = (label, fn, [0.0])
    with torch.no_grad():
        for p in ids:  # interleaved: each prompt through every column before the next prompt
            for _, fn, acc in runs.values():
                t0 = time.perf_counter()
                fn(p)
                acc[0] += time.perf_counter() - t0
    print(f"# after the prompts: {load_line()}")
    rows = [{"column": c, "what": label, "seconds": acc[0], "tok_s": n_tokens / acc[0]}
            for c, (label, _, acc) in runs.items()]
    print("\n| column | what | seconds | prompt tok/s | vs ours fp32 |\n|---|---|---:|---:|---:|")
    base = next((r["tok_s"] for r in rows if r["column"] == "ours-fp32"), None)
    for r in rows:
        rel = f"{r['tok_s'] / base:.2f}x" if base else "-"
        print(f"| {r['column']} | {r['what']} | {r['seconds']:.1f} | {r['tok_s']:.0f} | {rel} |")
    roof = gemm_roof(args.gemm_reps)
    print(f"\nGEMM [1390x576].[576x1536] ({load_line()}):\n\n| kernel | GFLOP/s | of torch bf16 |\n|---|---:|---:|")
    for r in roof:
        print(f"| {r['name']} | {r['gflops']:.0f} | {r['of_bf16_roof']:.0%} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_line(), "threads": torch.get_num_threads(), "prompts": rows,
                                         "gemm": roof}, indent=1))


if __name__ == "__main__":
    main()
