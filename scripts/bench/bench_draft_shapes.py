"""What a draft's shape costs per speculative round, and the τ each shape needs to break even with plain decoding.

End-to-end speed of the pair is τ × (plain cost per token) ÷ (cost of a round). τ needs a trained draft per
shape (an hour or more of CPU each); the cost of a round does not depend on the weights, so it can be measured
on randomly initialised drafts of every shape in one process. This script does that: for each shape (layers,
draft vocabulary, transfer rank; block fixed at ``--block-size``) it builds a random draft of the shipped
draft's other dimensions, packs it for the CPU kernels as the engine does, and times, interleaved per batch
with plain decoding of the same prompts:

- ``ms_propose``: one ``draft.propose`` (backbone + transition + walk), the shape-dependent part;
- ``ms_round``: a whole speculative round (propose, verify of ``block_size`` tokens, the draft's context
  upkeep, acceptance), i.e. speculative wall time ÷ verify rounds, with fixed (not cost-aware) verification;
  both wall times include the prefill, which slightly flatters short runs toward 1;
- ``tau_break_even`` = ms_round ÷ (plain wall time per token): the committed tokens per round a trained draft
  of that shape must reach for the pair to equal plain decoding at that concurrency.

A random draft accepts almost nothing, so each round commits ~1 token; that does not change what a round
costs. Prompts are random token ids (cost only, no text needed).

Example (about 3 minutes on 2 cores)::

    python scripts/bench/bench_draft_shapes.py --threads 2 --concurrency 1 8 --json shapes.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# (layers, draft vocabulary size or None for the full 49,152, transfer rank); the first is the shipped shape
SHAPES = [(2, 8192, 192), (1, 8192, 192), (3, 8192, 192), (2, 4096, 192), (2, 16384, 192), (2, None, 192),
          (2, 8192, 96), (2, 8192, 384)]  # fmt: skip


def shape_name(layers: int, vocab: int | None, rank: int) -> str:
    return f"layers {layers}, vocab {vocab or 'full'}, rank {rank}"


def build_draft(target, layers: int, vocab: int | None, rank: int, block_size: int):
    """A random draft with the shipped draft's widths (Qwen3 layers of 9/3 heads, MLP 1536, message 256, top-k 8)."""
    from dspine import init_draft

    return init_draft(
        target, num_layers=layers, block_size=block_size, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, sliding_window=2048, transfer_rank=rank, message_size=256, top_k=8,
        draft_vocab=None if vocab is None else torch.arange(vocab),
    ).use_kernels()  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=3, help="verify block (the shipped decode.json: 3)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per concurrency (batches of C)")
    ap.add_argument("--prompt-tokens", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from bench_acceptance import Clock, ms  # scripts/bench/ is on sys.path when this runs as a script

    from dspine import generate, load_target
    from dspine.embedded.smollm2 import embedded_target_path

    target = load_target(embedded_target_path())
    drafts = {shape_name(*s): build_draft(target, *s, block_size=max(args.block_size, 2)) for s in SHAPES}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    M = args.max_new_tokens
    generate(target, None, prompts[:1], max_new_tokens=4)  # warm-up: kernels built, caches paged in
    for d in drafts.values():
        generate(target, d, prompts[:1], max_new_tokens=4, block_size=args.block_size)

    res: dict = {"block_size": args.block_size, "threads": args.threads, "max_new_tokens": M, "shapes": {}}
    for c in args.concurrency:
        batches = [prompts[i : i + c] for i in range(0, len(prompts), c)]
        plain_t = plain_n = 0.0
        acc = {n: {"t": 0.0, "rounds": 0, "propose": []} for n in drafts}
        for b in batches:  # plain and every shape alternate per batch, so load drift hits all alike
            t0 = time.perf_counter()
            outs = generate(target, None, b, max_new_tokens=M)
            plain_t += time.perf_counter() - t0
            plain_n += max(len(o.token_ids) for o in outs)  # plain steps of this batch
            for name, d in drafts.items():
                clock = Clock(d, "propose")
                t0 = time.perf_counter()
                outs = generate(target, d, b, max_new_tokens=M, block_size=args.block_size)
                acc[name]["t"] += time.perf_counter() - t0
                acc[name]["propose"] += clock.close()
                acc[name]["rounds"] += max(o.stats.verify_steps for o in outs)  # rounds of this batch
        ms_plain_token = 1000 * plain_t / max(1.0, plain_n)  # a plain step at batch c (prefill included)
        for name, a in acc.items():
            ms_round = 1000 * a["t"] / max(1, a["rounds"])
            r = res["shapes"].setdefault(name, {"params": sum(p.numel() for p in drafts[name].parameters())})
            r[f"c{c}"] = {
                "ms_plain_step": round(ms_plain_token, 2),
                "ms_propose": ms(a["propose"]),
                "ms_round": round(ms_round, 2),
                "tau_break_even": round(ms_round / ms_plain_token, 3),
            }
        print(json.dumps({"concurrency": c, **{n: v[f"c{c}"] for n, v in res["shapes"].items()}}), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
