#!/usr/bin/env python
"""A random model with a published checkpoint's shapes, its weights on GGUF grids (Q4_1 linears, a Q8_0 embedding and
head, as a llama.cpp Q4_1 export has them, so our kernels keep them as blocks): the step and roofline benchmarks of a
family we do not ship, without a download (issue 53: "the same table for one more family"). A step's time depends on
the shapes and the weight formats, not on the values.

    python scripts/bench/shaped_model.py qwen3-0.6b out/qwen3-0.6b-shapes     # or gemma3-270m
    python scripts/bench/bench_roofline.py --model out/qwen3-0.6b-shapes --settings fp32 --compare --skip-engine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's dspine, and the tests' model builders

# name -> (config class, model class, config values): the published config's shapes (Qwen/Qwen3-0.6B's and
# google/gemma-3-270m's config.json)
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                         sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", choices=list(SHAPES))
    ap.add_argument("out", help="the folder to write (a Hugging Face checkpoint: config.json + safetensors)")
    args = ap.parse_args()
    import torch
    import transformers
    from helpers import to_gguf_grids

    conf, model_class, cfg = SHAPES[args.shapes]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, conf)(**cfg)).float().eval()
    with torch.no_grad():
        to_gguf_grids(model)
    model.save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
