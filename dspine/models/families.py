"""The dense decoder families the reference engine loads, and how each one's config reads as a ``DenseSpec``.

Every family here is the Llama block (pre-norm attention, gated MLP, explicit KV cache: ``llama.py``) with a few
options; a family is the set of options its Hugging Face config implies, read here once so the model code asks
"is there a post-norm" rather than "is this OLMo". The arithmetic of each option follows the family's modeling
file in ``transformers`` (the facts, not the code):

- **Llama** (SmolLM2, Llama 3.x): optional ``attention_bias`` / ``mlp_bias``; llama3/linear RoPE scaling.
- **Qwen3**: per-head RMSNorm on q and k; optional sliding-window layers (``layer_types``).
- **Qwen2 / Qwen2.5**: biases on q, k and v (not o); sliding layers from ``max_window_layers`` when enabled; yarn.
- **Mistral**: one sliding window over every layer.
- **Gemma 3** (text): ``x * (1 + w)`` norms, the embedding scaled by sqrt(hidden), a sandwich of four norms per
  block, per-head QK-norm, scores scaled by ``query_pre_attn_scalar ** -0.5``, tanh-approximated GELU, sliding and
  full layers with their own RoPE (base and scaling per layer type), optional final logit soft-capping.
- **SmolLM3**: NoPE layers (``no_rope_layers[i] == 0``: no rotation at all).
- **OLMo 2**: no pre-norms; norms after attention and after the MLP; RMSNorm over the whole q and k projections.
- **Granite** (dense): embedding, residual and attention multipliers; logits divided by ``logits_scaling``.
- **Phi-3 / Phi-4-mini**: q/k/v and gate/up stored fused; partial rotary; longrope.

``gaps`` names what cannot run batch invariant on our kernels for a config (see ``Target.invariance_gaps``): the
features that need invariance (prefix cache, chunked prefill) turn off for it and the run log says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspine.models.checkpoint import ModelLoadError
from dspine.models.layers import RopeSpec

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class DenseSpec:
    """What a dense family's block does, per option (defaults: Llama)."""

    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = ""  # "": none; "head": RMSNorm per head (Qwen3, Gemma 3); "proj": over the projection (OLMo 2)
    norms: str = "pre"  # "pre" (Llama), "sandwich" (Gemma: pre and post around each sublayer), "post" (OLMo 2)
    norm_offset: float = 0.0  # 1.0: Gemma's x * (1 + w)
    act: str = "silu"
    embed_scale: float = 1.0  # Gemma sqrt(hidden), Granite embedding_multiplier
    residual_scale: float = 1.0  # Granite residual_multiplier
    attn_scale: float | None = None  # None: head_dim ** -0.5
    logits_divisor: float = 1.0  # Granite logits_scaling
    final_softcap: float | None = None  # Gemma final_logit_softcapping
    fused_checkpoint: bool = False  # Phi-3: qkv_proj / gate_up_proj in the checkpoint
    windows: tuple[int | None, ...] = ()  # per layer
    ropes: tuple[RopeSpec | None, ...] = ()  # per layer; None: a NoPE layer
    gaps: tuple[str, ...] = ()  # pieces that are not batch invariant on our kernels


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # what the docs and ``dspine info`` call it
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    gguf_arch: str | None = None  # llama.cpp's ``general.architecture`` for this family


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama (SmolLM2, Llama 3.x)", ("llama",), ("LlamaForCausalLM",), "llama"),
    Family("qwen3", "Qwen3 dense", ("qwen3",), ("Qwen3ForCausalLM",), "qwen3"),
    Family("qwen2", "Qwen2 / Qwen2.5", ("qwen2",), ("Qwen2ForCausalLM",), "qwen2"),
    Family("mistral", "Mistral / Ministral (one window)", ("mistral",), ("MistralForCausalLM",), "llama"),
    Family("gemma3", "Gemma 3 (text: 270M, 1B)", ("gemma3_text",), ("Gemma3ForCausalLM",), "gemma3"),
    Family("smollm3", "SmolLM3", ("smollm3",), ("SmolLM3ForCausalLM",), "smollm3"),
    Family("olmo2", "OLMo 2", ("olmo2",), ("Olmo2ForCausalLM",), "olmo2"),
    Family("granite", "Granite (dense)", ("granite",), ("GraniteForCausalLM",), "granite"),
    Family("phi3", "Phi-3 / Phi-4-mini", ("phi3",), ("Phi3ForCausalLM",), "phi3"),
)


def family_of(cfg: dict) -> Family | None:
    """The dense family a config belongs to, by ``model_type`` first, then by architecture; None if none."""
    arch = (cfg.get("architectures") or [None])[0]
    for fam in FAMILIES:
        if cfg.get("model_type") in fam.model_types:
            return fam
    for fam in FAMILIES:
        if arch in fam.architectures:
            return fam
    return None


def read_spec(cfg: dict) -> DenseSpec:
    """The ``DenseSpec`` of a dense family's config; a ``ModelLoadError`` naming the option we do not run."""
    fam = family_of(cfg)
    if fam is None:
        raise ModelLoadError(f"config.json: model_type {cfg.get('model_type')!r} is not a dense family")
    n = int(cfg["num_hidden_layers"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh") or (fam.name != "gemma3" and act != "silu"):
        raise ModelLoadError(f"config.json: activation {act!r} is not supported for {fam.title} (silu only)")
    try:
        rope = RopeSpec.from_config(cfg, head_dim)
    except ValueError as e:
        raise ModelLoadError(f"config.json: {e}") from None
    bias = bool(cfg.get("attention_bias", False))
    base = dict(family=fam.name, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)), act=act,
                windows=tuple(_windows(cfg, fam.name, n)), ropes=(rope,) * n)
    if fam.name == "qwen3":
        base.update(qk_norm="head")
    elif fam.name == "qwen2":
        base.update(qkv_bias=True, o_bias=False)
    elif fam.name in ("mistral", "phi3"):
        base.update(qkv_bias=False, o_bias=False, mlp_bias=False, fused_checkpoint=fam.name == "phi3")
    elif fam.name == "gemma3":
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError("config.json: use_bidirectional_attention (an encoder Gemma) is not a causal LM")
        types = _layer_types(cfg, n)
        ropes = tuple(_gemma_rope(cfg, head_dim, t) for t in types)
        base.update(qk_norm="head", norms="sandwich", norm_offset=1.0, embed_scale=math.sqrt(cfg["hidden_size"]),
                    attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5, ropes=ropes,
                    final_softcap=cfg.get("final_logit_softcapping"), mlp_bias=False)
    elif fam.name == "smollm3":
        keep = _rope_layers(cfg, n)
        base.update(ropes=tuple(rope if keep[i] else None for i in range(n)))
    elif fam.name == "olmo2":
        base.update(qk_norm="proj", norms="post", mlp_bias=False)
    elif fam.name == "granite":
        base.update(embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                    residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                    attn_scale=float(cfg.get("attention_multiplier", head_dim**-0.5)),
                    logits_divisor=float(cfg.get("logits_scaling", 1.0)))
    spec = DenseSpec(**base)
    return DenseSpec(**{**base, "gaps": _gaps(spec, cfg)})


def _layer_types(cfg: dict, n: int) -> list[str]:
    types = list(cfg.get("layer_types") or [FULL] * n)
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"config.json: layer_types must be {n} entries of {SLIDING!r}/{FULL!r}, got {types!r}")
    return types


def _rope_layers(cfg: dict, n: int) -> list[int]:
    """SmolLM3: 1 where a layer rotates, 0 where it is a NoPE layer (``no_rope_layers``; default every
    ``no_rope_layer_interval``-th)."""
    return cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(n)]


def _windows(cfg: dict, family: str, n: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as the family's HF model applies it. A Qwen2/Qwen3 or
    SmolLM3 config with ``use_sliding_window`` and no ``layer_types`` (written by a transformers before 5) slides the
    layers its HF config class picks then: Qwen's from ``max_window_layers`` on (HF's default 28), SmolLM3's NoPE
    layers."""
    window = cfg.get("sliding_window")
    if family in ("mistral", "phi3"):  # one window over every layer when set
        return [window] * n
    if family in ("gemma3",):
        return [window if t == SLIDING else None for t in _layer_types(cfg, n)]
    if family in ("qwen2", "qwen3", "smollm3") and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types")
        if types is None and family in ("qwen2", "qwen3"):
            types = [SLIDING if i >= int(cfg.get("max_window_layers", 28)) else FULL for i in range(n)]
        elif types is None:
            types = [FULL if rotates else SLIDING for rotates in _rope_layers(cfg, n)]
        return [window if t == SLIDING else None for t in _layer_types({**cfg, "layer_types": types}, n)]
    return [None] * n


def _gemma_rope(cfg: dict, head_dim: int, layer_type: str) -> RopeSpec:
    """Gemma 3's RoPE for one layer type: ``rope_parameters`` keyed by layer type (transformers 5), or the legacy
    ``rope_theta`` (full layers, default 1e6) + ``rope_scaling`` and ``rope_local_base_freq`` (sliding, 1e4)."""
    params = cfg.get("rope_parameters") or {}
    if layer_type in params:
        own = dict(params[layer_type] or {})
    elif layer_type == FULL:
        own = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
    else:
        own = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    own.setdefault("rope_theta", 1_000_000.0 if layer_type == FULL else 10_000.0)
    try:
        return RopeSpec.from_config(cfg, head_dim, params=own)
    except ValueError as e:
        raise ModelLoadError(f"config.json: {layer_type} layers: {e}") from None


def _gaps(spec: DenseSpec, cfg: dict) -> tuple[str, ...]:
    """What of this config cannot be batch invariant on our kernels (empty: everything can)."""
    gaps = []
    for rope in {r for r in spec.ropes if r is not None}:
        if rope.rope_type == "longrope" and int(cfg.get("max_position_embeddings") or 0) > rope.original_max_position:
            gaps.append("longrope rotates a prompt longer than original_max_position_embeddings wholly with its long "
                        "factors (as Hugging Face does), which a chunk of it or a prefix-cache hit cannot know")
    return tuple(gaps)
