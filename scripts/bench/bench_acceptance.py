"""Acceptance length and wall-clock speedup of the embedded pair (SmolLM2-135M-Instruct + shipped DSpine draft).

Two measurements, in one process, on the held-out prompts (``embedded_data.eval_prompts``: MT-Bench chat,
HumanEval code, gsm_symbolic math; never used in training):

1. **τ** per dataset, greedy and T=1 (as docs/design.md defines it): per-request mean (macro: mean over requests of each
   request's committed-tokens-per-verify-round) and per-round mean (micro: all committed tokens ÷ all
   verify rounds). The bonus/correction token counts; the prefill token does not. Batched (``--batch``).
2. **Speedup**: the same prompts decoded plainly and speculatively, alternating, at concurrency 1 (one
   request at a time) and concurrency C (one batch of C); end-to-end tokens/s including prefill. The
   greedy outputs of both are compared token for token (lossless check). ``--variants`` times several
   speculative settings (block size, confidence threshold) against the same plain runs, interleaved per batch.

Example::

    python scripts/bench/bench_acceptance.py --eval out/embedded/eval.jsonl --max-new-tokens 96 --json out/bench.json
    python scripts/bench/bench_acceptance.py --skip-tau --variants 8 4 8@0.3 --speed-prompts 8 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # embedded_data


def load_prompts(eval_file: str | None, per_dataset: int, model_dir: Path) -> dict[str, list[list[int]]]:
    """dataset -> prompt token ids: from a regenerated ``eval.jsonl``, else rendered from the sources."""
    out: dict[str, list[list[int]]] = {}
    if eval_file and Path(eval_file).is_file():
        for line in Path(eval_file).read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["dataset"], []).append(rec["prompt_ids"])
    else:
        import embedded_data as ed

        tok = ed.load_tokenizer(model_dir)
        for p in ed.eval_prompts(per_dataset):
            out.setdefault(p.dataset, []).append(ed.render(tok, p.text))
    return {d: v[:per_dataset] for d, v in sorted(out.items())}


def tau(outs) -> dict:
    rounds = sum(o.stats.verify_steps for o in outs)
    toks = sum(o.stats.round_tokens for o in outs)
    per_req = [o.stats.accept_length for o in outs if o.stats.verify_steps]
    hist = [sum(h) for h in zip(*(o.stats.accept_histogram for o in outs))]
    return {
        "requests": len(outs),
        "tokens": sum(len(o.token_ids) for o in outs),
        "verify_rounds": rounds,
        "tau_macro": round(statistics.mean(per_req), 3) if per_req else None,
        "tau_micro": round(toks / rounds, 3) if rounds else None,
        "accept_histogram": hist,
    }


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class Clock:
    """Wraps a bound method and records each call's wall time (where a round's time goes)."""

    def __init__(self, obj, name: str):
        self.obj, self.name, orig = obj, name, getattr(obj, name)
        self.times: list[float] = []

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.times.append(time.perf_counter() - t0)

        setattr(obj, name, wrapped)

    def close(self) -> list[float]:
        delattr(self.obj, self.name)  # drop the instance attribute: the class method shows through again
        return self.times


def ms(times: list[float]) -> float | None:
    return round(1000 * statistics.mean(times), 2) if times else None


def _variant(text: str) -> tuple[int, float | None, str]:
    """"8" -> (8, None, "fixed"); "8@0.3" -> (8, 0.3, "fixed"); "4:cost" -> (4, None, "cost")."""
    text, _, verify = text.partition(":")
    bs, _, thr = text.partition("@")
    return int(bs), (float(thr) if thr else None), verify or "fixed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="draft dir (default: the shipped embedded draft)")
    ap.add_argument("--eval", default=None, help="eval.jsonl from train_embedded.py (default: render the sources)")
    ap.add_argument("--per-dataset", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16, help="batch size of the τ runs")
    ap.add_argument("--block-size", type=int, default=None, help="verify block (default: the draft's)")
    ap.add_argument("--dynamic-threshold", type=float, default=None, help="confidence stop (needs a fitted head)")
    ap.add_argument(
        "--variants", nargs="*", default=None, metavar="BS[@THRESHOLD][:cost]",
        help="speed runs: speculative settings timed against the same plain runs, e.g. 8 4 8@0.3 4:cost (:cost = "
        "cost-aware verification, calibrated before timing; default: one, from --block-size/--dynamic-threshold)",
    )  # fmt: skip
    ap.add_argument("--speed-prompts", type=int, default=8, help="prompts in the speedup runs (mixed datasets)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-tau", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dspine import generate, load_draft, load_target
    from dspine.decoding.cost import load_or_calibrate
    from dspine.embedded.smollm2 import embedded_draft_path, embedded_target_path

    model_dir = embedded_target_path()
    target = load_target(model_dir)
    # Packed like the engine packs it (dspine_batch.engines.reference): unpacked, the draft's 3-row linears take
    # MKL's small-M path and a proposal cost ~2x (10.9 vs ~5 ms on an AVX-512 EPYC), which is not what users run.
    draft = load_draft(args.draft or embedded_draft_path()).use_kernels()
    bs = args.block_size or draft.block_size
    prompts = load_prompts(args.eval, args.per_dataset, model_dir)
    stop = [2]  # <|im_end|>
    M = args.max_new_tokens
    thr = args.dynamic_threshold
    res: dict = {"block_size": bs, "dynamic_threshold": thr, "max_new_tokens": M, "threads": args.threads,
                 "draft": str(args.draft or "shipped"), "confidence_trained": draft.confidence_enabled}  # fmt: skip
    variants = [_variant(v) for v in args.variants] if args.variants else [(bs, thr, "fixed")]

    if not args.skip_tau:
        res["tau"] = {}
        for name, temp in (("greedy", 0.0), ("T=1", 1.0)):
            per = {}
            for ds, ps in prompts.items():
                outs = []
                for i in range(0, len(ps), args.batch):
                    outs += generate(target, draft, ps[i : i + args.batch], max_new_tokens=M, temperature=temp,
                                     seed=list(range(i, i + len(ps[i : i + args.batch]))), stop_token_ids=stop,
                                     block_size=bs, dynamic_threshold=thr)  # fmt: skip
                per[ds] = tau(outs)
                print(json.dumps({"tau": name, "dataset": ds, **per[ds]}), flush=True)
            res["tau"][name] = per

    if not args.skip_speed:
        mixed = [p for group in zip(*prompts.values()) for p in group][: args.speed_prompts]
        res["speed"] = {}
        for c in (1, args.concurrency):
            batches = [mixed[i : i + c] for i in range(0, len(mixed), c)]
            t_ar, n_ar, ar_steps = 0.0, 0, []
            runs = {v: {"t": 0.0, "n": 0, "same": True, "verify": [], "draft": [], "outs": []} for v in variants}
            costs = {v: load_or_calibrate(target, draft, c, v[0]) if v[2] == "cost" else None for v in variants}
            for b in batches:  # alternate plain and speculative per batch so load drift hits all alike
                clock = Clock(target, "forward")
                ar, dt = timed(lambda b=b: generate(target, None, b, max_new_tokens=M, stop_token_ids=stop))
                ar_steps += clock.close()[1:]  # [0] is the prefill
                t_ar += dt
                n_ar += sum(len(o.token_ids) for o in ar)
                for (vbs, vthr, vv), run in runs.items():
                    clock, dclock = Clock(target, "forward"), Clock(draft, "propose")
                    sp, dt = timed(lambda b=b, vbs=vbs, vthr=vthr, vv=vv, vc=costs[(vbs, vthr, vv)]: generate(
                        target, draft, b, max_new_tokens=M, stop_token_ids=stop, block_size=vbs,
                        dynamic_threshold=vthr, verify=vv, cost=vc))  # fmt: skip
                    run["verify"] += clock.close()[1:]
                    run["draft"] += dclock.close()
                    run["outs"] += sp
                    run["t"] += dt
                    run["n"] += sum(len(o.token_ids) for o in sp)
                    run["same"] &= all(a.token_ids == s.token_ids for a, s in zip(ar, sp))
            res["speed"][f"concurrency{c}"] = per_c = {}
            for (vbs, vthr, vv), run in runs.items():
                outs = run["outs"]
                proposed = sum(o.stats.draft_tokens_proposed for o in outs)
                rounds = sum(o.stats.verify_steps for o in outs)
                r = {
                    "block_size": vbs,
                    "dynamic_threshold": vthr,
                    "verify": vv,
                    "prompts": len(mixed),
                    "plain_tok_s": round(n_ar / t_ar, 2),
                    "spec_tok_s": round(run["n"] / run["t"], 2),
                    "speedup": round((run["n"] / run["t"]) / (n_ar / t_ar), 3),
                    "plain_s": round(t_ar, 1),
                    "spec_s": round(run["t"], 1),
                    "greedy_outputs_identical": run["same"],
                    "tau_micro": tau(outs)["tau_micro"],
                    "drafts_per_round": round(proposed / max(1, rounds), 3),
                    "plain_steps": sum(o.stats.plain_steps for o in outs),  # rounds with ℓ = 0 (no draft)
                    "ms_plain_step": ms(ar_steps),  # one target forward of 1 token per row
                    "ms_verify": ms(run["verify"]),  # one target forward of up to bs tokens per row
                    "ms_draft_propose": ms(run["draft"]),  # backbone + walk
                }
                per_c[f"bs{vbs}" + (f"@{vthr}" if vthr is not None else "") + (":cost" if vv == "cost" else "")] = r
                print(json.dumps({"speed": f"concurrency{c}", **r}), flush=True)

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
