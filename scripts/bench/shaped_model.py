#!/usr/bin/env python
"""A random model with a published checkpoint's shapes, its weights on GGUF grids (Q4_1 linears, a Q8_0 embedding and
head, as a llama.cpp Q4_1 export has them, so our kernels keep them as blocks): the step and roofline benchmarks of a
family we do not ship, without a download (issue 53: "the same table for one more family"). A step's time depends on
the shapes and the weight formats, not on the values.

    python scripts/bench/shaped_model.py qwen3-0.6b out/qwen3-0.6b-shapes
    python scripts/bench/bench_roofline.py --model out/qwen3-0.6b-shapes --settings fp32 --compare --skip-engine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's dspine, and the tests' model builders

# name -> (family, config values): the published config's shapes (Qwen/Qwen3-0.6B's config.json)
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", choices=list(SHAPES))
    ap.add_argument("out", help="the folder to write (a Hugging Face checkpoint: config.json + safetensors)")
    args = ap.parse_args()
    from helpers import save_tiny_hf

    family, cfg = SHAPES[args.shapes]
    cfg = dict(cfg)
    path = save_tiny_hf(args.out, family, vocab=cfg.pop("vocab_size"), layers=cfg.pop("num_hidden_layers"),
                        gguf=True, **cfg)
    print(path)


if __name__ == "__main__":
    main()
