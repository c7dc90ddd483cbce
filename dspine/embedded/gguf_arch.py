"""What differs per GGUF architecture when a llama.cpp file becomes a Hugging Face directory: the config read from
``{arch}.*`` metadata, the tensor names, and the tensors llama.cpp stores differently from Hugging Face.

Facts from llama.cpp's converter (``convert_hf_to_gguf.py``) and loader, as the installed ``transformers`` GGUF
integration also encodes them; the code is ours:

- **llama** (Llama, SmolLM2, Mistral): Q and K rows permuted per head for llama.cpp's adjacent-pair RoPE
  (``gguf_convert.unpermute_qk`` undoes it).
- **qwen2** (Qwen2 / Qwen2.5): biases on q, k, v; NEOX (rotate-half) RoPE, so nothing is permuted.
- **qwen3**: per-head q/k norms (``attn_q_norm`` / ``attn_k_norm``); head size from ``attention.key_length``.
- **gemma3**: every norm weight stored as ``1 + w`` (llama.cpp multiplies by the weight as is), so 1 is subtracted
  back; sliding layers every ``attention.sliding_window_pattern`` (llama.cpp's default for gemma3: 6, the 6th
  layer global) with their own RoPE base (``rope.freq_base_swa``, default 10000); the query scale is
  head_dim ** -0.5 except for the 62-layer (27B) model, where it is (hidden / heads) ** -0.5.
- **phi3** (Phi-3, Phi-4-mini): q/k/v fused in ``attn_qkv`` and gate/up in ``ffn_up`` (gate first), as Hugging Face
  stores them; NEOX RoPE over ``rope.dimension_count`` dims (partial rotary); longrope as two tensors,
  ``rope_factors_long`` / ``rope_factors_short``, with ``rope.scaling.original_context_length`` and
  ``rope.scaling.attn_factor``; ``attention.sliding_window`` 0 for none.
- **olmo2**: no pre-norms, ``post_attention_norm`` / ``post_ffw_norm`` after each sublayer, q/k norms over the whole
  projection; NEOX RoPE (nothing permuted). Sliding-window layers (OLMo 3 written as olmo2) are refused.
- **granite** (dense): the Llama layout (Q/K permuted) plus ``granite.embedding_scale``, ``granite.residual_scale``,
  ``granite.logit_scale`` and ``granite.attention.scale``, each written only when set (llama.cpp's defaults when
  absent: 1, 1, 1 and head_dim ** -0.5).
- **smollm3**: the Llama layout (Q/K permuted); NoPE on every 4th layer, fixed in llama.cpp (no metadata key).

Anything else (another architecture, a RoPE scaling type, llama.cpp's ``rope_freqs`` tensor for Llama 3 scaling) is
refused in one line naming it, never guessed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "olmo2", "granite", "smollm3")

_ATTN = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight"}
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_QKV_BIAS = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
             "attn_v.bias": "self_attn.v_proj.bias"}

# GGUF tensor name within ``blk.N.`` -> HF parameter name within ``model.layers.N.``, per architecture
BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "llama": {**_PRE_NORMS, **_ATTN, **_MLP},
    "qwen2": {**_PRE_NORMS, **_ATTN, **_QKV_BIAS, **_MLP},
    "qwen3": {**_PRE_NORMS, **_ATTN, **_QK_NORMS, **_MLP},
    "gemma3": {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight":
               "post_attention_layernorm.weight", "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight", **_ATTN, **_QK_NORMS, **_MLP},
    "phi3": {**_PRE_NORMS, "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight"},
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight", **_ATTN, **_QK_NORMS, **_MLP},
    "granite": {**_PRE_NORMS, **_ATTN, **_MLP},
    "smollm3": {**_PRE_NORMS, **_ATTN, **_MLP},
}

# Tensors outside the blocks that become config values, not weights (Phi-3's longrope factors)
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Architectures whose Q/K rows llama.cpp's converter permutes (``LlamaModel`` and its subclasses)
PERMUTED = ("llama", "granite", "smollm3")

_HF = {  # architecture -> (model_type, HF class)
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
}


class ArchError(ValueError):
    """A GGUF whose architecture or options this converter does not handle (``gguf_convert`` names the file)."""


def f32_value(x: float) -> float:
    """The decimal a float32 metadata value was written from (``9.999999747e-06`` -> ``1e-05``)."""
    return float(str(np.float32(x)))


def check_architecture(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ArchError(f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")


def config(arch: str, meta: Any, tensor_names: set[str], extra: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The HF ``config.json`` of a GGUF of ``arch`` (``meta``: a ``gguf_meta.Metadata``, whose readers check each
    value's type and range and name the key when one is wrong; ``extra``: the ``CONFIG_TENSORS`` the file holds,
    dequantized). What only the sizes together can say (heads that do not divide the width) is an ``ArchError``
    naming the keys."""
    check_architecture(arch)
    extra = extra or {}
    if "rope_freqs.weight" in tensor_names:
        raise ArchError("rope_freqs (llama.cpp's precomputed Llama 3 RoPE scaling) is not supported")
    n_heads = meta.count(f"{arch}.attention.head_count")
    hidden = meta.count(f"{arch}.embedding_length")
    n_kv = meta.count(f"{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise ArchError(f"{arch}.attention.head_count {n_heads} is not a multiple of "
                        f"{arch}.attention.head_count_kv {n_kv}")
    key_length = meta.count(f"{arch}.attention.key_length", 0, minimum=0)
    if not key_length and hidden % n_heads:
        raise ArchError(f"{arch}.embedding_length {hidden} does not split into {arch}.attention.head_count "
                        f"{n_heads} heads")
    head_dim = key_length or hidden // n_heads
    rope_dim = meta.count(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise ArchError(f"{arch}.rope.dimension_count {rope_dim} is not an even count of at most the head's "
                        f"{head_dim} dims")
    if rope_dim != head_dim and arch != "phi3":
        raise ArchError(f"partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    theta = f32_value(meta.number(f"{arch}.rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta, **_rope_scaling(arch, meta)}
    model_type, cls = _HF[arch]
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise ArchError("tokenizer.ggml.tokens is empty")
    vocab = meta.count(f"{arch}.vocab_size", len(tokens))
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.count(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.count(f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32_value(meta.number(f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": meta.count(f"{arch}.context_length"),
        "vocab_size": vocab,
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta; dspine's RopeSpec reads either.
        "rope_theta": theta,
        "rope_parameters": rope,
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
        "bos_token_id": meta.token_id("tokenizer.ggml.bos_token_id", vocab),
        "eos_token_id": meta.token_id("tokenizer.ggml.eos_token_id", vocab),
        "pad_token_id": meta.token_id("tokenizer.ggml.padding_token_id", vocab),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "gemma3":
        cfg.update(_gemma3(meta, cfg, rope))
    elif arch == "phi3":
        cfg.update(_phi3(meta, cfg, rope, rope_dim, extra))
    elif arch == "olmo2":
        if meta.get("olmo2.attention.sliding_window") or meta.get("olmo2.attention.sliding_window_pattern"):
            raise ArchError("olmo2 with sliding-window layers (OLMo 3) is not supported (OLMo 2 only)")
    elif arch == "granite":
        cfg.update(_granite(meta, head_dim))
    elif arch == "smollm3":  # llama.cpp: no RoPE where (layer + 1) % 4 == 0, a constant of its loader
        cfg.update(no_rope_layer_interval=4,
                   no_rope_layers=[int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])])
    return cfg


def _phi3(meta: Any, cfg: dict[str, Any], rope: dict[str, Any], rope_dim: int,
          extra: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's partial rotary, longrope (factors as tensors) and optional window over every layer."""
    if rope.get("rope_type") != "default":
        raise ArchError(f"phi3 with RoPE scaling {rope['rope_type']!r} is not supported (longrope only)")
    rope = {**rope, "partial_rotary_factor": rope_dim / cfg["head_dim"]}
    # at least 2: longrope's attention factor divides by log(original)
    original = meta.count("phi3.rope.scaling.original_context_length", 0, minimum=2)
    long, short = extra.get("rope_factors_long.weight"), extra.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ArchError("phi3 with only one of rope_factors_long / rope_factors_short")
    out: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False}
    if long is not None:
        if not original:
            raise ArchError("phi3 longrope without rope.scaling.original_context_length")
        for name, factors in (("rope_factors_long", long), ("rope_factors_short", short)):
            if factors.size != rope_dim // 2 or not (np.isfinite(factors).all() and (factors > 0).all()):
                raise ArchError(f"{name} must hold {rope_dim // 2} positive factors (one per rotated pair of "
                                f"phi3.rope.dimension_count {rope_dim}), got {factors.size}")
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=[f32_value(x) for x in np.asarray(long).reshape(-1)],
                    short_factor=[f32_value(x) for x in np.asarray(short).reshape(-1)])
        scale = cfg["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        attn = meta.number("phi3.rope.scaling.attn_factor", 0.0) or None
        if attn is not None and np.float32(attn) != np.float32(default):  # HF recomputes it when absent
            rope["attention_factor"] = f32_value(attn)
        out["original_max_position_embeddings"] = original
    window = meta.count("phi3.attention.sliding_window", 0, minimum=0)
    out.update(rope_parameters=rope, partial_rotary_factor=rope["partial_rotary_factor"],
               sliding_window=window or None)
    return out


def _granite(meta: Any, head_dim: int) -> dict[str, Any]:
    """Granite's multipliers: llama.cpp's ``*_scale`` keys, each absent when unset (llama.cpp's defaults then)."""

    def scale(key: str, default: float) -> float:
        value = meta.number(key, 0.0) or None
        return default if value is None else f32_value(value)

    return {"embedding_multiplier": scale("granite.embedding_scale", 1.0),
            "residual_multiplier": scale("granite.residual_scale", 1.0),
            "logits_scaling": scale("granite.logit_scale", 1.0),
            "attention_multiplier": scale("granite.attention.scale", head_dim**-0.5)}


def _rope_scaling(arch: str, meta: Any) -> dict[str, Any]:
    kind = meta.text(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = meta.number(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": meta.count(f"{arch}.rope.scaling.original_context_length",
                                                               minimum=2)}
    raise ArchError(f"RoPE scaling {kind!r} is not supported (supported: linear, yarn)")


def _gemma3(meta: Any, cfg: dict[str, Any], full_rope: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    key = "gemma3.attention.sliding_window_pattern"  # a period, or one bool per layer
    if isinstance(meta.get(key), list):
        pattern = meta.array(key, {"BOOL", "UINT8", "INT8", "UINT32", "INT32"}, "bools")
        if len(pattern) != n:
            raise ArchError(f"{key} has {len(pattern)} entries for {n} layers")
        sliding = [bool(x) for x in pattern]
    else:
        period = meta.count(key, 6)
        sliding = [bool((i + 1) % period) for i in range(n)]
    local_theta = f32_value(meta.number("gemma3.rope.freq_base_swa", 10000.0))
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": meta.count("gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if slide else "full_attention" for slide in sliding],
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "rope_local_base_freq": local_theta,
        "tie_word_embeddings": True,
    }
    cap = meta.number("gemma3.final_logit_softcapping", 0.0) or None
    if cap is not None:
        out["final_logit_softcapping"] = f32_value(cap)
    return out


def transform(arch: str, gguf_name: str, w: np.ndarray, cfg: dict[str, Any], unpermute) -> np.ndarray:
    """A dequantized tensor as Hugging Face stores it (``unpermute``: ``gguf_convert.unpermute_qk``)."""
    if arch in PERMUTED and gguf_name.endswith("attn_q.weight"):
        return unpermute(w, cfg["num_attention_heads"])
    if arch in PERMUTED and gguf_name.endswith("attn_k.weight"):
        return unpermute(w, cfg["num_key_value_heads"])
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w
