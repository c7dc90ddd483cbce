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

Anything else (another architecture, a RoPE scaling type, llama.cpp's ``rope_freqs`` tensor for Llama 3 scaling) is
refused in one line naming it, never guessed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

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
}

_HF = {  # architecture -> (model_type, HF class)
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


class ArchError(ValueError):
    """A GGUF whose architecture or options this converter does not handle (``gguf_convert`` names the file)."""


def f32_value(x: float) -> float:
    """The decimal a float32 metadata value was written from (``9.999999747e-06`` -> ``1e-05``)."""
    return float(str(np.float32(x)))


def check_architecture(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ArchError(f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")


def config(arch: str, meta: Any, tensor_names: set[str]) -> dict[str, Any]:
    """The HF ``config.json`` of a GGUF of ``arch`` (``meta``: ``.get(key, default)`` / ``.require(key)``)."""
    check_architecture(arch)
    if "rope_freqs.weight" in tensor_names:
        raise ArchError("rope_freqs (llama.cpp's precomputed Llama 3 RoPE scaling) is not supported")
    n_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ArchError(f"partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    theta = f32_value(meta.get(f"{arch}.rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta, **_rope_scaling(arch, meta)}
    model_type, cls = _HF[arch]
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32_value(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))),
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta; dspine's RopeSpec reads either.
        "rope_theta": theta,
        "rope_parameters": rope,
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "gemma3":
        cfg.update(_gemma3(meta, cfg, rope))
    return cfg


def _rope_scaling(arch: str, meta: Any) -> dict[str, Any]:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = float(meta.require(f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(meta.require(f"{arch}.rope.scaling.original_context_length"))}
    raise ArchError(f"RoPE scaling {kind!r} is not supported (supported: linear, yarn)")


def _gemma3(meta: Any, cfg: dict[str, Any], full_rope: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern") or 6  # a period, or one bool per layer
    if isinstance(pattern, list | tuple):
        if len(pattern) != n:
            raise ArchError(f"attention.sliding_window_pattern has {len(pattern)} entries for {n} layers")
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(n)]
    local_theta = f32_value(meta.get("gemma3.rope.freq_base_swa", 10000.0))
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(meta.require("gemma3.attention.sliding_window")),
        "layer_types": ["sliding_attention" if slide else "full_attention" for slide in sliding],
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "rope_local_base_freq": local_theta,
        "tie_word_embeddings": True,
    }
    cap = meta.get("gemma3.final_logit_softcapping")
    if cap is not None:
        out["final_logit_softcapping"] = f32_value(cap)
    return out


def transform(arch: str, gguf_name: str, w: np.ndarray, cfg: dict[str, Any], unpermute) -> np.ndarray:
    """A dequantized tensor as Hugging Face stores it (``unpermute``: ``gguf_convert.unpermute_qk``)."""
    if arch == "llama" and gguf_name.endswith("attn_q.weight"):
        return unpermute(w, cfg["num_attention_heads"])
    if arch == "llama" and gguf_name.endswith("attn_k.weight"):
        return unpermute(w, cfg["num_key_value_heads"])
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w
