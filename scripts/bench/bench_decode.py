#!/usr/bin/env python
"""AR vs speculative decoding on the same target and prompts, in one run (issue: dspine core, "Measure").

Reports end-to-end tokens/s and τ at each concurrency, and the cost of the parts of a round measured
directly with a warm ~100-token context: one AR step, one verify forward of a block, one draft proposal.
With an untrained draft τ ≈ 1 is expected; the point is the overhead of a round relative to an AR step.

    python scripts/bench/bench_decode.py --model embedded --draft random --concurrency 1 8
    python scripts/bench/bench_decode.py --model random  # a small random Llama (no files needed)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

from dspine import generate, init_draft, load_draft, load_target


def _random_llama(tmp: str, layers: int, hidden: int, vocab: int) -> str:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 192),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp)
    return tmp


def _resolve_model(spec: str, tmp: str) -> str:
    if spec == "embedded":
        from dspine.embedded.smollm2 import embedded_target_path

        return str(embedded_target_path())
    if spec == "random":
        return _random_llama(tmp, layers=30, hidden=576, vocab=49152)
    return spec


def _prompts(n: int, vocab: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _timeit(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@torch.no_grad()
def component_costs(target, draft, batch: int, ctx: int, bs: int, reps: int) -> dict:
    """Median seconds for an AR step, a verify forward of ``bs`` tokens, and a draft proposal.

    The proposal is ``draft.propose`` exactly as ``generate`` calls it (backbone, transition cache, sampled
    path; greedy rows), so ``draft_s`` is the draft's share of an end-to-end round.
    """
    prompts = torch.randint(0, target.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(1))
    taps = tuple(draft.target_layer_ids)
    cache = target.new_cache(batch, ctx + 4 * bs)
    out = target.forward(prompts, cache, taps=taps)
    dcache = draft.new_cache(batch, ctx + 4 * bs)
    draft.extend_context(dcache, out.taps, torch.full((batch,), ctx))
    one = torch.randint(0, target.vocab_size, (batch, 1))
    block = torch.randint(0, target.vocab_size, (batch, bs))
    temps = torch.zeros(batch)

    def ar_step():
        target.logits(target.forward(one, cache, speculative=True).hidden)

    def verify():
        o = target.forward(block, cache, speculative=True, taps=taps)
        target.logits(o.hidden)

    def propose():
        draft.propose(dcache, one[:, 0], target, temps, [None] * batch, block_size=bs)

    res = {"ar_step_s": _timeit(ar_step, reps), "verify_s": _timeit(verify, reps), "draft_s": _timeit(propose, reps)}
    res["verify_over_ar"] = res["verify_s"] / res["ar_step_s"]
    res["draft_over_ar"] = res["draft_s"] / res["ar_step_s"]
    res["round_over_ar"] = (res["verify_s"] + res["draft_s"]) / res["ar_step_s"]
    return res


def end_to_end(target, draft, concurrency: int, n_prompts: int, prompt_len: int, new_tokens: int, bs: int) -> dict:
    prompts = _prompts(n_prompts, target.vocab_size, prompt_len)
    res = {}
    for name, d in (("ar", None), ("spec", draft)):
        t0 = time.perf_counter()
        toks, outs_all = 0, []
        for i in range(0, n_prompts, concurrency):
            outs = generate(target, d, prompts[i : i + concurrency], max_new_tokens=new_tokens, block_size=bs)
            toks += sum(len(o.token_ids) for o in outs)
            outs_all += outs
        dt = time.perf_counter() - t0
        res[name] = {"tok_per_s": toks / dt, "seconds": dt, "tokens": toks}
        if d is not None:
            steps = sum(o.stats.verify_steps for o in outs_all)
            res[name]["tau_micro"] = sum(o.stats.round_tokens for o in outs_all) / max(steps, 1)
            res[name]["tau_macro"] = statistics.mean(o.stats.accept_length for o in outs_all)
        else:
            ar_ids = [o.token_ids for o in outs_all]
    res["speedup"] = res["spec"]["tok_per_s"] / res["ar"]["tok_per_s"]
    res["spec_equals_ar"] = ar_ids == [o.token_ids for o in outs_all]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="HF model dir, 'embedded' (SmolLM2) or 'random'")
    ap.add_argument("--draft", default="random", help="DSpine draft dir or 'random' (untrained, init_draft)")
    ap.add_argument("--block-size", type=int, default=None, help="default: the draft's (16 for 'random')")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--components-only", action="store_true", help="skip the end-to-end runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(_resolve_model(args.model, tmp))
    draft = (
        init_draft(target, num_layers=5, block_size=args.block_size or 16).use_kernels()
        if args.draft == "random"
        else load_draft(args.draft).use_kernels()  # packed, as the engine runs it
    )
    args.block_size = args.block_size or draft.block_size
    report = {
        "model": args.model,
        "draft": args.draft,
        "block_size": args.block_size,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "components": {},
        "end_to_end": {},
    }
    for c in args.concurrency:
        report["components"][f"batch{c}"] = component_costs(
            target, draft, c, args.prompt_len, args.block_size, args.reps
        )
        if not args.components_only:
            report["end_to_end"][f"concurrency{c}"] = end_to_end(
                target, draft, c, max(args.prompts, c), args.prompt_len, args.new_tokens, args.block_size
            )
        print(
            json.dumps(
                {f"concurrency{c}": [report["components"][f"batch{c}"], report["end_to_end"].get(f"concurrency{c}")]}
            )
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
