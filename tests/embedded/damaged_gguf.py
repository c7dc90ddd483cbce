"""Small GGUF files written with the ``gguf`` package's writer from scratch (no HF model behind them): a valid one of
a few architectures, and the same with one thing damaged (``DAMAGES``), for ``test_gguf_damaged.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

V, H, I, L, NH, NKV, HD = 12, 16, 32, 2, 4, 2, 4  # vocabulary, hidden, MLP, layers, heads, KV heads, head size
TOKENS = ["a", "b", "c", "d", "e", "f", "g", "h", "ab", "cd", "<s>", "</s>"]
MERGES = ["a b", "c d"]


def metadata(arch: str) -> dict[str, tuple[Any, str]]:
    """key -> (value, gguf value type name) of a valid file of ``arch``."""
    u32, f32 = "UINT32", "FLOAT32"
    meta: dict[str, tuple[Any, str]] = {
        f"{arch}.context_length": (64, u32), f"{arch}.embedding_length": (H, u32), f"{arch}.block_count": (L, u32),
        f"{arch}.feed_forward_length": (I, u32), f"{arch}.attention.head_count": (NH, u32),
        f"{arch}.attention.head_count_kv": (NKV, u32), f"{arch}.attention.layer_norm_rms_epsilon": (1e-5, f32),
        f"{arch}.rope.freq_base": (10000.0, f32), f"{arch}.vocab_size": (V, u32),
        "tokenizer.ggml.model": ("gpt2", "STRING"), "tokenizer.ggml.pre": ("gpt2", "STRING"),
        "tokenizer.ggml.tokens": (TOKENS, "ARRAY:STRING"),
        "tokenizer.ggml.token_type": ([1] * 10 + [3, 3], "ARRAY:INT32"),
        "tokenizer.ggml.merges": (MERGES, "ARRAY:STRING"), "tokenizer.ggml.bos_token_id": (10, u32),
        "tokenizer.ggml.eos_token_id": (11, u32),
    }
    if arch == "gemma3":
        meta.update({"gemma3.attention.sliding_window": (8, u32), "gemma3.attention.sliding_window_pattern": (2, u32),
                     f"{arch}.attention.key_length": (HD, u32), f"{arch}.attention.value_length": (HD, u32)})
    if arch == "phi3":
        meta.update({"phi3.rope.dimension_count": (HD, u32), "phi3.rope.scaling.original_context_length": (32, u32),
                     "phi3.attention.sliding_window": (0, u32)})
    return meta


def tensors(arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> array (numpy order, as HF shapes them) of a valid file of ``arch``."""
    g = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return g.normal(0, 0.1, shape).astype(np.float32)

    out = {"token_embd.weight": w(V, H), "output_norm.weight": np.ones(H, np.float32)}
    for i in range(L):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": np.ones(H, np.float32), b + "attn_output.weight": w(H, NH * HD),
                    b + "ffn_down.weight": w(H, I)})
        if arch == "phi3":
            out.update({b + "attn_qkv.weight": w((NH + 2 * NKV) * HD, H), b + "ffn_up.weight": w(2 * I, H),
                        b + "ffn_norm.weight": np.ones(H, np.float32)})
            continue
        out.update({b + "attn_q.weight": w(NH * HD, H), b + "attn_k.weight": w(NKV * HD, H),
                    b + "attn_v.weight": w(NKV * HD, H), b + "ffn_gate.weight": w(I, H), b + "ffn_up.weight": w(I, H),
                    b + "ffn_norm.weight": np.ones(H, np.float32)})
        if arch == "gemma3":
            out.update({b + "attn_q_norm.weight": np.ones(HD, np.float32),
                        b + "attn_k_norm.weight": np.ones(HD, np.float32),
                        b + "post_attention_norm.weight": np.ones(H, np.float32),
                        b + "post_ffw_norm.weight": np.ones(H, np.float32)})
    if arch == "phi3":
        out.update({"rope_factors_long.weight": np.full(HD // 2, 2.0, np.float32),
                    "rope_factors_short.weight": np.ones(HD // 2, np.float32)})
    return out


def write(path: str | Path, arch: str = "llama", meta: dict[str, tuple[Any, str] | None] | None = None,
          tensor_changes: dict[str, np.ndarray | None] | None = None) -> Path:
    """A GGUF of ``arch``: ``metadata``/``tensors`` with ``meta``/``tensor_changes`` over them (None: left out)."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    for key, item in {**metadata(arch), **(meta or {})}.items():
        if item is None:
            continue
        value, kind = item
        if kind.startswith("ARRAY:"):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType[kind[6:]])
        else:
            w.add_key_value(key, value, gguf.GGUFValueType[kind])
    for name, a in {**tensors(arch), **(tensor_changes or {})}.items():
        if a is not None:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# name -> (arch, metadata changes, tensor changes, what the one-line error must name)
DAMAGES: dict[str, tuple[str, dict, dict, str]] = {
    "head_count_0": ("llama", {"llama.attention.head_count": (0, "UINT32")}, {}, "llama.attention.head_count"),
    "head_count_kv_3": ("llama", {"llama.attention.head_count_kv": (3, "UINT32")}, {}, "head_count_kv"),
    "block_count_0": ("llama", {"llama.block_count": (0, "UINT32")}, {}, "llama.block_count"),
    "block_count_more": ("llama", {"llama.block_count": (5, "UINT32")}, {}, "llama.block_count"),
    "block_count_less": ("llama", {"llama.block_count": (1, "UINT32")}, {}, "llama.block_count"),
    # 2M layers of modules (and per-layer lists) would take gigabytes before a shape is compared
    "block_count_huge": ("llama", {"llama.block_count": (2**21, "UINT32")}, {}, "llama.block_count"),
    "sliding_window_pattern_0": ("gemma3", {"gemma3.attention.sliding_window_pattern": (0, "UINT32")}, {},
                                 "gemma3.attention.sliding_window_pattern"),
    "original_context_length_1": ("phi3", {"phi3.rope.scaling.original_context_length": (1, "UINT32")}, {},
                                  "phi3.rope.scaling.original_context_length"),
    "bos_past_vocab": ("llama", {"tokenizer.ggml.bos_token_id": (12, "UINT32")}, {}, "tokenizer.ggml.bos_token_id"),
    "bos_negative": ("llama", {"tokenizer.ggml.bos_token_id": (-1, "INT32")}, {}, "tokenizer.ggml.bos_token_id"),
    "eos_past_vocab": ("llama", {"tokenizer.ggml.eos_token_id": (99, "UINT32")}, {}, "tokenizer.ggml.eos_token_id"),
    "context_length_abc": ("llama", {"llama.context_length": ("abc", "STRING")}, {}, "llama.context_length"),
    "context_length_0": ("llama", {"llama.context_length": (0, "UINT32")}, {}, "llama.context_length"),
    "rms_eps_string": ("llama", {"llama.attention.layer_norm_rms_epsilon": ("x", "STRING")}, {},
                       "llama.attention.layer_norm_rms_epsilon"),
    "freq_base_negative": ("llama", {"llama.rope.freq_base": (-1.0, "FLOAT32")}, {}, "llama.rope.freq_base"),
    "embedding_length_negative": ("llama", {"llama.embedding_length": (-16, "INT32")}, {},
                                  "llama.embedding_length"),
    "tokens_not_strings": ("llama", {"tokenizer.ggml.tokens": (list(range(12)), "ARRAY:INT32")}, {},
                           "tokenizer.ggml.tokens"),
    "token_type_short": ("llama", {"tokenizer.ggml.token_type": ([1, 1], "ARRAY:INT32")}, {},
                         "tokenizer.ggml.token_type"),
    "shape_disagrees": ("llama", {}, {"blk.1.ffn_up.weight": np.zeros((I + 1, H), np.float32)},
                        "blk.1.ffn_up.weight"),
    "embedding_disagrees": ("llama", {"llama.embedding_length": (24, "UINT32")}, {}, "llama.embedding_length"),
    "tensor_missing": ("llama", {}, {"blk.0.attn_k.weight": None}, "blk.0.attn_k.weight"),
    "wide_layers": ("llama", {"llama.feed_forward_length": (2**36, "UINT64")}, {}, "llama.feed_forward_length"),
    "wide_vocab": ("llama", {"llama.vocab_size": (2**36, "UINT64")}, {}, "llama.vocab_size"),
    "rope_factors_short": ("phi3", {}, {"rope_factors_long.weight": np.full(1, 2.0, np.float32)},
                           "rope_factors_long"),
}
