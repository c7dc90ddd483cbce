"""Plain decode tok/s of the reference engine vs Hugging Face transformers on each family's tiny model (issue 42).

Each family's model is its test model (``tests/family_models.py``: the family's own config class, its distinctive
options on) at a benchmark size (``--hidden``/``--layers``/``--vocab``), random weights, fp32 on the CPU. Decode
rate = (time for N+1 new tokens - time for 1 new token) / N per row, so the prompt's prefill is not counted; greedy,
no stop tokens, equal-length prompts (HF needs no padding). ``--whole``: tokens / wall of the whole call instead
(prefill included; steadier than a difference of two timings on a loaded machine). Ours: ``dspine.generate``
without a draft (our CPU kernels, the default); HF: ``model.generate(do_sample=False)``. One run each, best of
``--repeat``.

    python scripts/bench/bench_families.py --json out/bench_families.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's dspine, and the tests' model builders

from family_models import FAMILIES, save_tiny_family, save_tiny_gemma4  # noqa: E402

from dspine import generate, load_target  # noqa: E402


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(family: str, root: Path, args) -> dict:
    import transformers

    size = dict(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
                vocab_size=args.vocab, max_position_embeddings=4096)
    if family == "gemma3":
        size.update(layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (args.layers // 6)
                    + ["sliding_attention"] * (args.layers % 6), query_pre_attn_scalar=64)
    if family == "phi3":
        size.update(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                     "short_factor": [1.0] * 24, "long_factor": [2.0] * 24},
                    original_max_position_embeddings=4096)
    if family == "gemma4":  # its own builder (tests/family_models.py): the 6-layer pattern at the benchmark width
        path = save_tiny_gemma4(root / family, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                                head_dim=64, global_head_dim=128, vocab_size=args.vocab,
                                vocab_size_per_layer_input=args.vocab, hidden_size_per_layer_input=64,
                                max_position_embeddings=4096)
    else:
        path = save_tiny_family(root / family, family, **size)
    ours = load_target(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    params = sum(p.numel() for p in ref.parameters())
    out = {"family": family, "kernel": ours.kernel, "params_M": round(params / 1e6, 1)}
    n = args.new_tokens
    for batch in args.batch:
        prompts = torch.randint(3, args.vocab, (batch, 16), generator=torch.Generator().manual_seed(batch))
        plist = prompts.tolist()

        def mine(k, plist=plist):
            return lambda: generate(ours, None, plist, max_new_tokens=k)

        def theirs(k, prompts=prompts):
            def run():
                with torch.no_grad():
                    ref.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=k, min_new_tokens=k,
                                 do_sample=False)
            return run

        mine(2)(), theirs(2)()  # warm-up
        if args.whole:
            ours_s, hf_s = _best(mine(n), args.repeat) / n, _best(theirs(n), args.repeat) / n
        else:
            ours_s = (_best(mine(n + 1), args.repeat) - _best(mine(1), args.repeat)) / n
            hf_s = (_best(theirs(n + 1), args.repeat) - _best(theirs(1), args.repeat)) / n
        out[f"b{batch}"] = {"ours_tok_s": round(batch / ours_s, 1), "hf_tok_s": round(batch / hf_s, 1),
                            "ratio": round(hf_s / ours_s, 2)}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=[*FAMILIES, "gemma4"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench(f, Path(tmp), args) for f in args.families]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
