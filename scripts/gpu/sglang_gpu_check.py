#!/usr/bin/env python
"""GPU check of the SGLang DSPINE backend through the dspine-batch adapter (needs the sglang venv and a GPU).

Not runnable on CPU; this is the prepared command for a GPU machine (docs/design.md, "The SGLang plugin"):

    bash scripts/setup_sglang_venv.sh
    ~/.cache/dspine/venv-sglang/bin/python scripts/gpu/sglang_gpu_check.py --model /models/Qwen3.5-4B \
        --make-draft /tmp/dspine-draft

1. greedy parity: DSPINE output_ids == no-speculation output_ids on fixed prompts (lossless);
2. spec stats present: verify steps > 0, tau >= 1, histogram sums to the verify steps;
3. sampled T=0.6 run completes with a sane tau;
4. hybrid target with extra_buffer + ReplaySSM spec (the seed's flags): a radix-cached continuation equals a full
   prefill (the prompt is sent twice after a flush: both outputs must match).

Prints one JSON summary; exit 0 iff every check passed. ``--make-draft DIR`` writes an untrained DSpine draft
for the target (``init_draft``; tau ~ 1, which is enough for parity) when you have no trained one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HYBRID_FLAGS = ("--linear-attn-backend triton --enable-linear-replayssm-spec --mamba-ssm-dtype float32 "
                "--mamba-radix-cache-strategy extra_buffer --max-mamba-cache-size 64")


def _requests(tok, n: int, new: int, temperature: float = 0.0):
    from dspine_batch.engines.base import Request, SamplingParams

    texts = ["Explain speculative decoding in two sentences.", "Write a haiku about GPUs.",
             "List three prime numbers and say why they are prime.", "def fibonacci(n):",
             "The capital of France is", "Translate 'good morning' to German and Spanish.",
             "Summarise the rules of chess briefly.", "What is 17 * 23? Show your work."]
    out = []
    for i in range(n):
        ids = tok.render_chat([{"role": "user", "content": texts[i % len(texts)]}]) if tok.has_chat_template \
            else tok.encode(texts[i % len(texts)])
        out.append(Request(f"r{i}", 0, ids, SamplingParams(max_new_tokens=new, temperature=temperature, seed=i,
                                                            stop_token_ids=tuple(tok.eos_ids()))))
    return out


def _run(model: str, draft: str, args: dict, reqs):
    from dspine_batch.engines.sglang.engine import SGLangEngine

    eng = SGLangEngine.load(model, draft, args)
    try:
        t0 = time.perf_counter()
        res = {r.row_id: r for r in eng.run(reqs, max_in_flight=8)}
        return res, time.perf_counter() - t0, eng
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", help="DSpine draft dir")
    ap.add_argument("--make-draft", help="write an untrained DSpine draft for --model here and use it")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--server-flags", default="", help="extra sglang serve flags (e.g. --attention-backend fa3)")
    a = ap.parse_args()
    draft = a.draft
    if a.make_draft:
        import torch

        from dspine import init_draft, load_target

        target = load_target(a.model, dtype=torch.float32, device="cpu")
        init_draft(target, num_layers=5, block_size=a.block_size).to(torch.bfloat16).save(a.make_draft)
        del target
        draft = a.make_draft
    if not draft:
        ap.error("--draft or --make-draft is required")
    from dspine.models.tokenizer import HFTokenizer

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    hybrid = "qwen3_5" in str(cfg.get("model_type")) or "Qwen3_5" in str(cfg.get("architectures"))
    flags = " ".join(x for x in (a.server_flags, HYBRID_FLAGS if hybrid else "") if x)
    common = {"server_flags": flags} if flags else {}
    tok = HFTokenizer(Path(a.model))
    summary: dict = {"model": a.model, "draft": draft, "hybrid": hybrid, "flags": flags}
    reqs = _requests(tok, a.prompts, a.new_tokens)
    base, t_base, _ = _run(a.model, "none", dict(common), reqs)
    spec, t_spec, _ = _run(a.model, draft, dict(common, block_size=str(a.block_size)), reqs)
    same = [k for k in base if base[k].token_ids == spec[k].token_ids]
    steps = sum(r.verify_steps or 0 for r in spec.values())
    summary["greedy_parity"] = {"equal": len(same), "of": len(base),
                                "errors": [r.error for r in list(base.values()) + list(spec.values()) if r.error]}
    summary["stats"] = {"verify_steps": steps,
                        "tau_micro": sum(r.completion_tokens - 1 for r in spec.values()) / max(steps, 1),
                        "histograms_ok": all(sum(r.accept_histogram or []) == (r.verify_steps or 0)
                                             for r in spec.values()),
                        "seconds_ar": round(t_base, 2), "seconds_spec": round(t_spec, 2)}
    sampled, _, _ = _run(a.model, draft, dict(common, block_size=str(a.block_size)),
                         _requests(tok, a.prompts, a.new_tokens, temperature=0.6))
    s_steps = sum(r.verify_steps or 0 for r in sampled.values())
    summary["sampled"] = {"completed": all(r.error is None for r in sampled.values()),
                          "tau_micro": sum(r.completion_tokens - 1 for r in sampled.values()) / max(s_steps, 1)}
    ok = (len(same) == len(base) and not summary["greedy_parity"]["errors"] and steps > 0
          and summary["stats"]["histograms_ok"] and summary["sampled"]["completed"])
    if hybrid:  # same prompt twice in one engine: the second hits the radix cache (extra_buffer track slots)
        twice = [reqs[0], type(reqs[0])("again", 0, reqs[0].prompt_ids, reqs[0].params)]
        res, _, _ = _run(a.model, draft, dict(common, block_size=str(a.block_size)), twice[:1])
        res2, _, _ = _run(a.model, draft, dict(common, block_size=str(a.block_size)), twice)
        summary["cached_equals_full_prefill"] = (res["r0"].token_ids == res2["again"].token_ids
                                                 == res2["r0"].token_ids)
        ok = ok and summary["cached_equals_full_prefill"]
    summary["ok"] = bool(ok)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
