"""The DSpine draft model for inference: causal DFlash backbone + adjacent injection + transition cache.

One readable file in the gpt-fast style (see ``llama.py``): explicit KV cache, per-row positions, shapes in
comments. Design reference: ``design/dspine-model.md`` §1 (DFlash backbone), §2 (what DSpine adds), §4
(checkpoint format), §6.2 (dynamic proposal). Ideas and published facts from DFlash, DSpine and SpecForge;
no code copied.

How a round uses it (the decoding loop owns the target and both caches):

1. ``extend_context(cache, taps, n_valid)``: new committed positions' target taps become context K/V rows,
   ``ctx = hidden_norm(fc(taps))`` projected by each layer's own ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE).
   Context never passes attention or MLP; it is only ever read as keys and values.
2. ``propose(cache, anchor, target, temperature, generators)``: the block ``[anchor, MASK x (bs-1)]`` at
   positions ``start..start+bs-1`` (``start = cache.lengths[b]``) runs through the layers with causal
   in-block attention and adjacent injection after every layer, the target head gives backbone logits, the
   top-k of each slot become candidates, the last layer's write is re-applied for every candidate
   predecessor (transition cache ``scores [B, bs-1, k, k]``), and a walk over that cache picks the
   tokens: argmax for greedy rows, inverse-CDF sampling from ``softmax(scores/T)`` for sampled rows.

The block's own K/V are written into the cache at positions ``>= lengths`` (the "garbage beyond lengths"
region of ``layers.py``): they are masked by position for everyone else and overwritten by the next
``extend_context``, so nothing of the block survives the call in any visible way.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .cache import KVCache, ModelCache
from .checkpoint import ModelLoadError, load_state, read_config, weight_files
from .layers import RMSNorm, RopeSpec, Rotary, SwiGLU, apply_rope, attend, position_mask
from .llama import Attention
from .target import Target, default_tap_ids
from .transfer import compute_transfer_space, max_transfer_rank

INIT_STD = 0.02  # HF ``initializer_range`` default for Qwen3/Llama

# The SpecForge ``DSpineConfig`` training fields at their defaults (§4.1). The draft never reads them; they
# travel in ``dspine_config`` so a checkpoint says how it was trained.
TRAINING_DEFAULTS: dict = {
    "ce_weight": 0.1,
    "alignment_weight": 0.5,
    "alignment_warmup_steps": 146,
    "replacement_layers": 3,
    "replacement_probability": 0.5,
    "replacement_hold_ratio": 0.16667,
    "replacement_end_ratio": 0.33333,
    "candidate_mass_threshold": 0.0001,
}


# ----------------------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class DraftSpec:
    """The validated numbers the draft is built from (parsed from a ``config.json`` dict)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    head_dim: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    transfer_rank: int
    message_size: int
    top_k: int
    injection_offsets: tuple[int, ...]
    use_confidence_head: bool
    confidence_trained: bool
    windows: tuple[int | None, ...]  # per layer: sliding window, or None for full attention
    draft_vocab_size: int | None = None  # proposal head over this many target ids (None: the full vocabulary)


def _fail(where: str, key: str, msg: str) -> NoReturn:
    raise ModelLoadError(f"{where}: {key} {msg}")


def _as_int(where: str, key: str, value, lo: int | None = None, hi: int | None = None, rule: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(where, key, f"must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        _fail(where, key, f"= {value} out of range ({rule or f'need {lo} <= {key} <= {hi}'})")
    return value


def _as_float(where: str, key: str, value, lo: float, hi: float, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        _fail(where, key, f"= {value!r} out of range ({rule})")
    return float(value)


def _as_bool(where: str, key: str, value) -> bool:
    if not isinstance(value, bool):
        _fail(where, key, f"must be true or false, got {value!r}")
    return value


def parse_draft_config(cfg: dict, where: str = "config.json") -> DraftSpec:
    """Validate a draft ``config.json`` dict (§4.1); errors are ``ModelLoadError`` naming ``where`` and the key.

    ``block_size``, ``mask_token_id``, ``target_layer_ids`` and ``num_target_layers`` are read from
    ``dflash_config`` first, then from the top level (checkpoints differ).
    """
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            _fail(where, repr(key), "is missing")
    H = _as_int(where, "hidden_size", cfg["hidden_size"], 1)
    V = _as_int(where, "vocab_size", cfg["vocab_size"], 2)
    L = _as_int(where, "num_hidden_layers", cfg["num_hidden_layers"], 1)
    heads = _as_int(where, "num_attention_heads", cfg["num_attention_heads"], 1)
    kv_heads = _as_int(where, "num_key_value_heads", cfg.get("num_key_value_heads") or heads, 1)
    if heads % kv_heads:
        _fail(where, "num_key_value_heads", f"= {kv_heads} must divide num_attention_heads = {heads}")
    head_dim = _as_int(where, "head_dim", cfg.get("head_dim") or H // heads, 1)
    _as_int(where, "intermediate_size", cfg["intermediate_size"], 1)
    if cfg.get("hidden_act", "silu") != "silu":
        _fail(where, "hidden_act", f"= {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("is_causal", True) is not True:
        _fail(where, "is_causal", "must be true: a DSpine draft uses a causal block (bidirectional is DFlash)")
    try:
        RopeSpec.from_config(cfg, head_dim)
    except ValueError as e:
        _fail(where, "rope", str(e))

    dflash = cfg.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        _fail(where, "dflash_config", "must be an object")

    def flash_key(key: str):
        if key in dflash:
            return dflash[key], f"dflash_config.{key}"
        if key in cfg:
            return cfg[key], key
        _fail(where, f"dflash_config.{key}", "is missing (looked in dflash_config, then the top level)")

    value, key = flash_key("block_size")
    block_size = _as_int(where, key, value, 2, rule="need block_size >= 2")
    value, key = flash_key("mask_token_id")
    mask_id = _as_int(where, key, value, 0, V - 1, rule=f"need 0 <= mask_token_id < vocab_size = {V}")
    value, key = flash_key("num_target_layers")
    n_target = _as_int(where, key, value, 1, rule="need num_target_layers >= 1")
    ids, key = flash_key("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        _fail(where, key, f"must be a non-empty list of layer indices, got {ids!r}")
    for j, i in enumerate(ids):
        _as_int(where, f"{key}[{j}]", i, 0, n_target - 1, rule=f"need 0 <= id < num_target_layers = {n_target}")

    ds = cfg.get("dspine_config")
    if not isinstance(ds, dict):
        _fail(where, "dspine_config", "is missing (not a DSpine draft checkpoint)")
    for key in ("transfer_rank", "message_size", "top_k"):
        if key not in ds:
            _fail(where, f"dspine_config.{key}", "is missing")
    rmax = max_transfer_rank(H, V)
    rank = _as_int(
        where, "dspine_config.transfer_rank", ds["transfer_rank"], 1, rmax,
        rule=f"need 0 < transfer_rank <= min(hidden_size, vocab_size - 1) = {rmax}",
    )  # fmt: skip
    message = _as_int(where, "dspine_config.message_size", ds["message_size"], 1, rule="need message_size >= 1")
    top_k = _as_int(where, "dspine_config.top_k", ds["top_k"], 1, V, rule=f"need 1 <= top_k <= vocab_size = {V}")
    draft_vocab = ds.get("draft_vocab_size")
    if draft_vocab is not None:
        draft_vocab = _as_int(where, "dspine_config.draft_vocab_size", draft_vocab, top_k, V,
                              rule=f"need top_k = {top_k} <= draft_vocab_size <= vocab_size = {V}")  # fmt: skip
    offsets = ds.get("injection_offsets", [1] * L)
    if not isinstance(offsets, list) or len(offsets) != L:
        _fail(where, "dspine_config.injection_offsets", f"must be a list of {L} integers (one per layer)")
    for j, d in enumerate(offsets):
        _as_int(where, f"dspine_config.injection_offsets[{j}]", d, 1, rule="need offset >= 1")
    hold = _as_float(
        where, "dspine_config.replacement_hold_ratio",
        ds.get("replacement_hold_ratio", TRAINING_DEFAULTS["replacement_hold_ratio"]), 0.0, 1.0,
        "need 0 <= replacement_hold_ratio < replacement_end_ratio <= 1",
    )  # fmt: skip
    end = _as_float(
        where, "dspine_config.replacement_end_ratio",
        ds.get("replacement_end_ratio", TRAINING_DEFAULTS["replacement_end_ratio"]), 0.0, 1.0,
        "need 0 <= replacement_hold_ratio < replacement_end_ratio <= 1",
    )  # fmt: skip
    if not hold < end:
        _fail(where, "dspine_config.replacement_hold_ratio", f"= {hold} must be < replacement_end_ratio = {end}")
    if "replacement_probability" in ds:
        _as_float(where, "dspine_config.replacement_probability", ds["replacement_probability"], 0, 1, "need [0, 1]")
    if "replacement_layers" in ds:
        _as_int(where, "dspine_config.replacement_layers", ds["replacement_layers"], 0, L)
    for key in ("ce_weight", "alignment_weight", "candidate_mass_threshold"):
        if key in ds:
            _as_float(where, f"dspine_config.{key}", ds[key], 0.0, math.inf, "need >= 0")
    if "alignment_warmup_steps" in ds:
        _as_int(where, "dspine_config.alignment_warmup_steps", ds["alignment_warmup_steps"], 0, rule="need >= 0")
    use_head = _as_bool(where, "dspine_config.use_confidence_head", ds.get("use_confidence_head", False))
    trained = _as_bool(where, "dspine_config.confidence_trained", ds.get("confidence_trained", False))

    use_sw = _as_bool(where, "use_sliding_window", cfg.get("use_sliding_window", False))
    window = None
    if use_sw:
        window = _as_int(where, "sliding_window", cfg.get("sliding_window"), 1, rule="need sliding_window >= 1")
    types = cfg.get("layer_types") or ["sliding_attention" if use_sw else "full_attention"] * L
    if not isinstance(types, list) or len(types) != L:
        _fail(where, "layer_types", f"must list one type per layer ({L})")
    for j, t in enumerate(types):
        if t not in ("sliding_attention", "full_attention"):
            _fail(where, f"layer_types[{j}]", f"= {t!r} (need sliding_attention or full_attention)")
    windows = tuple(window if t == "sliding_attention" else None for t in types)

    return DraftSpec(
        hidden_size=H,
        vocab_size=V,
        num_layers=L,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        block_size=block_size,
        mask_token_id=mask_id,
        target_layer_ids=tuple(ids),
        num_target_layers=n_target,
        transfer_rank=rank,
        message_size=message,
        top_k=top_k,
        injection_offsets=tuple(offsets),
        use_confidence_head=use_head,
        confidence_trained=trained,
        windows=windows,
        draft_vocab_size=draft_vocab,
    )


def _rope_from_target(tcfg: dict, head_dim: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for the draft, copied from the target where a qwen3 draft can express it."""
    try:
        spec = RopeSpec.from_config(tcfg, head_dim)
    except ValueError:  # e.g. a multimodal rope type: keep only the base frequency
        params = {**(tcfg.get("rope_scaling") or {}), **(tcfg.get("rope_parameters") or {})}
        return float(params.get("rope_theta", tcfg.get("rope_theta", 10000.0))), None
    if spec.rope_type == "linear":
        return spec.theta, {"rope_type": "linear", "factor": spec.factor}
    if spec.rope_type == "llama3":
        return spec.theta, {
            "rope_type": "llama3",
            "factor": spec.factor,
            "low_freq_factor": spec.low_freq_factor,
            "high_freq_factor": spec.high_freq_factor,
            "original_max_position_embeddings": spec.original_max_position,
        }
    return spec.theta, None


_BASE_OVERRIDES = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "sliding_window",
    "mask_token_id",
    "target_layer_ids",
)
_DSPINE_OVERRIDES = (
    "transfer_rank",
    "message_size",
    "top_k",
    *TRAINING_DEFAULTS,
    "injection_offsets",
    "use_confidence_head",
    "draft_vocab_size",
    "confidence_trained",
)


def make_draft_config(target: Target, num_layers: int = 5, block_size: int = 16, **overrides) -> dict:
    """The ``config.json`` dict (§4.1 layout) of a fresh draft for ``target``; see ``init_draft``."""
    unknown = sorted(set(overrides) - set(_BASE_OVERRIDES) - set(_DSPINE_OVERRIDES))
    if unknown:
        raise TypeError(f"init_draft: unknown override(s) {unknown}; allowed: {[*_BASE_OVERRIDES, *_DSPINE_OVERRIDES]}")
    o = dict(overrides)
    tcfg = target.config.get("text_config") or target.config
    H, V, L = target.hidden_size, target.vocab_size, num_layers
    heads = o.get("num_attention_heads", tcfg["num_attention_heads"])
    kv_heads = o.get("num_key_value_heads", tcfg.get("num_key_value_heads") or heads)
    head_dim = o.get("head_dim", tcfg.get("head_dim") or H // heads)
    theta, scaling = _rope_from_target(tcfg, head_dim)
    window = o.get("sliding_window", 8192)
    n_taps = min(5, target.num_layers)
    tap_ids = list(o.get("target_layer_ids", default_tap_ids(target.num_layers, n_taps)))
    mask_id = o.get("mask_token_id", tcfg.get("mask_token_id", target.config.get("mask_token_id")))
    if mask_id is None:
        mask_id = V - 1  # no mask token in the target config: borrow the last id (see init_draft)
    dspine = {
        "transfer_rank": o.get("transfer_rank", min(1024, max_transfer_rank(H, V))),
        "message_size": o.get("message_size", min(512, H)),
        "top_k": o.get("top_k", 16),
        **{k: o.get(k, v) for k, v in TRAINING_DEFAULTS.items()},
        "replacement_layers": o.get("replacement_layers", min(TRAINING_DEFAULTS["replacement_layers"], L)),
        "injection_offsets": list(o.get("injection_offsets", [1] * L)),
        "use_confidence_head": o.get("use_confidence_head", True),
        "confidence_trained": o.get("confidence_trained", False),
    }
    if o.get("draft_vocab_size") is not None:
        dspine["draft_vocab_size"] = int(o["draft_vocab_size"])
    return {
        "architectures": ["DSpineDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": o.get("intermediate_size", tcfg["intermediate_size"]),
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": o.get("rms_norm_eps", tcfg.get("rms_norm_eps", 1e-6)),
        "attention_bias": False,
        "rope_theta": o.get("rope_theta", theta),
        "rope_scaling": o.get("rope_scaling", scaling),
        "max_position_embeddings": o.get("max_position_embeddings", tcfg.get("max_position_embeddings", 32768)),
        "vocab_size": V,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "num_target_layers": target.num_layers,
        "block_size": block_size,
        "is_causal": True,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if window is not None else "full_attention"] * L,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": mask_id,
            "target_layer_ids": tap_ids,
            "num_target_layers": target.num_layers,
        },
        "dspine_config": dspine,
        "auto_map": {"AutoModel": "dspine.DSpineDraftModel"},
    }


# ----------------------------------------------------------------------------------------------------------
# modules


class DraftAttention(Attention):
    """Qwen3 attention whose queries are block slots only; keys are the context rows plus the block so far."""

    def context_kv(self, ctx: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows as keys/values: ctx [B, T, H] -> k, v [B, H_kv, T, D] (k normed and rotated)."""
        B, T, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(B, T, self.n_kv, self.head_dim))
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = self.v_proj(ctx).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x, cos, sin, pos, kv: KVCache, window: int | None, span: tuple[int, int]):
        # x [B, bs, H] (normed block), pos [B, bs]; span = (min position, max position + 1) over the batch
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, bs, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, bs, D]
        kv.write(pos, k, v.transpose(1, 2))  # beyond lengths: invisible to later calls, overwritten by them
        # Keys at positions <= q_pos (context < start, block slots <= own) and > q_pos - window. Keys no
        # query can see under the window are sliced off first so long contexts cost O(window), not O(length).
        lo = 0 if window is None else max(0, span[0] - window + 1)
        keys, values = kv.k[:, :, lo : span[1]], kv.v[:, :, lo : span[1]]
        mask = position_mask(pos - lo, span[1] - lo, window)  # [B, 1, bs, S]
        o = attend(q, keys, values, mask, self.head_dim**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def train_forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Training path: every block of a sequence at once, context K/V shared, explicit block-causal mask.

        x [N, bs, H] (normed blocks), cos/sin of the block positions, ctx_k/ctx_v [1, H_kv, T, D] (this
        layer's context keys/values), mask bool [N, 1, bs, T + bs] (``block_causal_mask``) -> [N, bs, H].
        """
        N, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, T, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(N, T, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(N, T, self.n_kv, self.head_dim)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [N, Hq, bs, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [N, Hkv, bs, D]
        keys = torch.cat([ctx_k.expand(N, -1, -1, -1), k], dim=2)  # [N, Hkv, T_ctx + bs, D]
        values = torch.cat([ctx_v.expand(N, -1, -1, -1), v.transpose(1, 2)], dim=2)
        o = attend(q, keys, values, mask, self.head_dim**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(N, T, -1))


class DraftLayer(nn.Module):
    """Qwen3 decoder layer (RMSNorm -> attention -> residual; RMSNorm -> SwiGLU -> residual)."""

    def __init__(self, cfg: dict):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = DraftAttention(cfg, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = SwiGLU(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x, cos, sin, pos, kv, window, span):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, kv, window, span)
        return x + self.mlp(self.post_attention_layernorm(x))

    def train_forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn.train_forward(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Injection(nn.Module):
    """Adjacent injection (§2.3): slot i receives a gated message about its predecessor after every layer.

    ``features`` reads the pre-injection state into the transfer space; ``write`` adds
    ``rms(h) * W_l(g * u)``. The write is scaled by the receiver's own RMS so it is a relative update at any
    depth, and ``W_l`` (and ``G_pred``) start at zero so a fresh draft is exactly the causal DFlash backbone.
    """

    def __init__(self, hidden: int, rank: int, message: int, num_layers: int):
        super().__init__()
        self.scale = math.sqrt(rank)  # features and predecessor codes live on the sphere of radius sqrt(r)
        self.readouts = nn.ModuleList(nn.Linear(hidden, rank, bias=False) for _ in range(num_layers))  # R_l
        self.writes = nn.ModuleList(nn.Linear(message, hidden, bias=False) for _ in range(num_layers))  # W_l
        self.message = nn.Linear(rank, message, bias=False)  # M (shared)
        self.receiver_gate = nn.Linear(rank, message, bias=False)  # G_recv (shared)
        self.predecessor_gate = nn.Linear(rank, message, bias=False)  # G_pred (shared)
        self.bias = nn.Parameter(torch.zeros(message))

    def features(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """f_l = sqrt(r) * normalize(R_l h): h [..., H] -> [..., r]."""
        f = F.normalize(self.readouts[layer](h).float(), dim=-1)
        return (self.scale * f).to(h.dtype)

    def write(self, layer: int, h: torch.Tensor, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """h + rms(h) * W_l(sigmoid(G_recv f + G_pred p + b) * M p); h/f [..., 1, .] broadcast against p [..., k, r]."""
        g = torch.sigmoid(self.receiver_gate(f) + self.predecessor_gate(p) + self.bias)  # [..., m]
        u = self.message(p)  # [..., m]
        rms = (h.float().norm(dim=-1, keepdim=True) / math.sqrt(h.shape[-1])).to(h.dtype)  # [..., 1]
        return h + rms * self.writes[layer](g * u)


class ConfidenceHead(nn.Module):
    """c = sigmoid(w . [h~ ; code(a)] + b) (§5, after DSpark): will slot i's proposal survive verification?

    ``h~`` is the refined last-layer state of slot i given its chosen predecessor a **after the final norm**
    (the vector that is scored against the LM head) and ``code(a)`` the unit transfer code of a (no sqrt(r)).
    Both depend only on the prefix up to a, so stopping on c is a stopping time (§6.3).
    """

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(self, refined: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        # refined [..., H], code [..., r] -> [...] float32 in (0, 1)
        return torch.sigmoid(self.proj(torch.cat([refined, code.to(refined.dtype)], dim=-1)).float()).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------
# the model


@dataclass
class BlockOutput:
    """Everything one backbone pass over a block produces (``DSpineDraft.backbone``)."""

    hidden: torch.Tensor  # [B, bs, H] after the last layer's injection and the final norm
    logits: torch.Tensor  # [B, bs-1, V'] float32 backbone logits of slots 1..bs-1 over the draft vocabulary
    last_pre: torch.Tensor  # [B, bs, H] last layer's output *before* its injection: what refinement rewrites
    last_feat: torch.Tensor  # [B, bs, r] f_L(i), the last layer's receiver features
    anchor: torch.Tensor  # [B] LongTensor, the block's slot-0 token


@dataclass
class Transition:
    """The transition cache (§2.4): every candidate of slot i scored under every candidate predecessor."""

    cand: torch.Tensor  # [B, n, k] LongTensor, n = bs-1: top-k backbone candidates of slots 1..bs-1
    pred: torch.Tensor  # [B, n, k] LongTensor: predecessor of each row (the anchor for every row of slot 1)
    scores: torch.Tensor  # [B, n, k(pred row), k(cand)] float32 refined logits
    confidence: torch.Tensor | None  # [B, n, k(pred row)] float32, or None without an enabled head


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, bs-1] LongTensor (slots beyond n_draft may hold anything)
    q: torch.Tensor | None  # [B, bs-1, V] float32 draft probabilities; None when every row is greedy
    n_draft: torch.Tensor  # [B] LongTensor: proposals to verify (bs-1 unless dynamic stopping cut it)
    confidence: torch.Tensor | None  # [B, bs-1] float32 c_i along the chosen path, or None


@dataclass
class TrainBlockOutput:
    """What ``DSpineDraft.train_forward`` returns for the N blocks of one sequence (with gradients)."""

    hidden: torch.Tensor  # [N, bs, H] after the last layer's injection and the final norm
    last_pre: torch.Tensor  # [N, bs, H] last layer's output before its injection (refinement rewrites it)
    last_feat: torch.Tensor  # [N, bs, r] f_L(i)
    post_feats: list[torch.Tensor]  # per layer [N, bs, r]: features of the post-injection state (alignment)


def block_causal_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None) -> torch.Tensor:
    """Training mask [N, 1, bs, T + bs]: query (n, k) sees context rows j < a_n, block rows k' <= k.

    Context is strict (< anchor): at inference the anchor's own target hidden is not known yet. With a
    sliding window only rows j > a_n + k - window stay visible, exactly ``position_mask`` at inference.
    """
    dev = anchors.device
    k = torch.arange(block_size, device=dev)
    j = torch.arange(ctx_len, device=dev)
    q_pos = anchors[:, None] + k[None, :]  # [N, bs]
    ctx = j[None, None, :] < anchors[:, None, None]  # [N, 1, T]
    if window is not None:
        ctx = ctx & (j[None, None, :] > q_pos[:, :, None] - window)  # [N, bs, T]
    ctx = ctx.expand(anchors.shape[0], block_size, ctx_len)
    blk = (k[None, :] <= k[:, None])[None].expand(anchors.shape[0], -1, -1)  # [N, bs, bs]
    return torch.cat([ctx, blk], dim=-1)[:, None]


class DSpineDraft(nn.Module):
    """DSpine draft (§1-2): DFlash's context-as-K/V backbone with a causal block and adjacent injection.

    Owns no embedding and no LM head: the block is embedded with ``target.embed`` and scored with
    ``target.head_weight``. ``transfer_codes [V, r]`` and ``transfer_ready`` are buffers saved with the
    weights (never recomputed at load, see ``transfer.py``).
    """

    def __init__(self, cfg: dict, confidence_head: bool | None = None, where: str = "config.json"):
        super().__init__()
        spec = parse_draft_config(cfg, where)
        self.config = cfg
        self.spec = spec
        H, V, r = spec.hidden_size, spec.vocab_size, spec.transfer_rank
        self.hidden_size, self.vocab_size, self.transfer_rank = H, V, r
        self.block_size = spec.block_size
        self.mask_token_id = spec.mask_token_id
        self.target_layer_ids = list(spec.target_layer_ids)
        self.top_k = spec.top_k
        self.injection_offsets = list(spec.injection_offsets)
        self.windows = list(spec.windows)
        self.confidence_trained = spec.confidence_trained  # mutable: a second training stage may set it

        self.fc = nn.Linear(len(spec.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(spec.num_layers))
        self.norm = RMSNorm(H, spec.rms_norm_eps)
        self.injection = Injection(H, r, spec.message_size, spec.num_layers)
        use_head = spec.use_confidence_head if confidence_head is None else confidence_head
        self.confidence_head = ConfidenceHead(H, r) if use_head else None
        self.register_buffer("transfer_codes", torch.zeros(V, r))
        self.register_buffer("transfer_ready", torch.tensor(False))
        # The proposal head's vocabulary (target ids, ascending), when smaller than the target's: the backbone
        # logits are computed over these rows of the target head only (§ "draft vocabulary" in draft.py docs).
        self.draft_vocab: torch.Tensor | None
        if spec.draft_vocab_size is not None:
            self.register_buffer("draft_vocab", torch.arange(spec.draft_vocab_size))
        else:
            self.draft_vocab = None
        self._head_rows: tuple[tuple, torch.Tensor] | None = None
        self.rotary = Rotary(RopeSpec.from_config(cfg, spec.head_dim))

    # -- basics ----------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    #: Default proposal walk. The batched transition cache measured as fast as or faster than the lazy walk
    #: on CPU too (SmolLM2 draft, quiet machine: 49 vs 58 ms at batch 1, 169 vs 163 ms at batch 8), so it is
    #: the default everywhere; "lazy" stays available (same output, k× fewer refinements).
    walk: str = "cache"

    @property
    def confidence_enabled(self) -> bool:
        """Dynamic stopping needs a head *and* a config that says it was trained (an untrained head is noise)."""
        return self.confidence_head is not None and bool(self.confidence_trained)

    def new_cache(self, batch: int, capacity: int) -> ModelCache:
        """Empty context cache: one ``KVCache`` per layer; ``lengths`` counts context rows per batch row."""
        a = self.layers[0].self_attn
        return ModelCache(
            torch.zeros(batch, dtype=torch.long, device=self.device),
            [KVCache.empty(batch, a.n_kv, capacity, a.head_dim, self.dtype, self.device) for _ in self.layers],
        )

    def _check_ready(self) -> None:
        if not bool(self.transfer_ready):
            raise RuntimeError(
                "DSpine draft: transfer_ready is false, so transfer_codes are not valid. Codes are computed once "
                "by init_draft() from the target head and must be stored in the checkpoint; they are never "
                "recomputed at load because eigh is not bit-stable across hardware."
            )

    def _check_target(self, target: Target) -> None:
        if target.vocab_size != self.vocab_size or target.hidden_size != self.hidden_size:
            raise ValueError(
                f"target (vocab {target.vocab_size}, hidden {target.hidden_size}) does not match the draft "
                f"(vocab {self.vocab_size}, hidden {self.hidden_size})"
            )

    # -- the proposal head -------------------------------------------------------------------------------------

    def head(self, target: Target) -> torch.Tensor:
        """The rows of ``target.head_weight`` the backbone scores: [V', H] (the whole head without a draft vocab).

        The backbone logits over a 49k-token head were most of a small draft's cost on CPU (8 slots x 49152 x
        576 MACs, more than the target's own decode step); a draft vocabulary of the tokens the target actually
        writes cuts that by V / V'. The rows are gathered once per head tensor and kept (frozen target).
        """
        w = target.head_weight
        if self.draft_vocab is None:
            return w
        key = (w.data_ptr(), w.dtype, w.device, w._version, self.draft_vocab.data_ptr())
        if self._head_rows is None or self._head_rows[0] != key:
            self._head_rows = (key, w.detach().index_select(0, self.draft_vocab.to(w.device)))
        return self._head_rows[1]

    def head_logits(self, hidden: torch.Tensor, target: Target) -> torch.Tensor:
        """Backbone logits over the draft vocabulary: hidden [..., H] -> [..., V'] float32 (one 2-D GEMM)."""
        if self.draft_vocab is None:
            return target.logits(hidden.to(target.dtype))
        w = self.head(target)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(w.dtype).contiguous()
        return (flat @ w.T).float().view(*hidden.shape[:-1], -1)

    def vocab_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids (identity without a draft vocab)."""
        return idx if self.draft_vocab is None else self.draft_vocab[idx]

    def vocab_index(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids -> (index into the draft vocabulary, present mask); absent ids get index 0 (mask them)."""
        if self.draft_vocab is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        v = self.draft_vocab.to(ids.device)
        idx = torch.searchsorted(v, ids).clamp(max=len(v) - 1)
        return idx, v[idx] == ids

    def check_vocab(self, where: str = "draft") -> None:
        """A loaded ``draft_vocab`` must be strictly increasing target ids (a corrupt one would propose garbage)."""
        v = self.draft_vocab
        if v is None:
            return
        if v.dtype != torch.long or v.ndim != 1:
            raise ModelLoadError(f"{where}: draft_vocab must be a 1-D int64 tensor, got {v.dtype} {tuple(v.shape)}")
        if len(v) and (int(v.min()) < 0 or int(v.max()) >= self.vocab_size):
            raise ModelLoadError(f"{where}: draft_vocab holds ids outside 0..{self.vocab_size - 1}")
        if len(v) > 1 and not bool((v[1:] > v[:-1]).all()):
            raise ModelLoadError(f"{where}: draft_vocab must be strictly increasing (sorted, no repeats)")

    # -- context -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def extend_context(self, cache: ModelCache, taps: torch.Tensor, n_valid: torch.Tensor | None = None) -> None:
        """Append context rows: taps [B, T, n*H] at positions ``lengths[b] + t``; ``lengths += n_valid``.

        Rows ``t >= n_valid[b]`` are written too but land beyond the new length, where they are masked by
        position and overwritten later (``layers.py``), so ragged batches need no padding logic here.
        """
        B, T, D = taps.shape
        if D != self.fc.in_features:
            raise ValueError(f"taps have {D} features, expected {len(self.target_layer_ids)} x {self.hidden_size}")
        if T == 0:
            return
        pos = cache.lengths[:, None] + torch.arange(T, device=cache.lengths.device)  # [B, T]
        cos, sin = self.rotary(pos, self.dtype)
        ctx = self.hidden_norm(self.fc(taps.to(self.dtype)))  # [B, T, H], computed once per context row
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            k, v = layer.self_attn.context_kv(ctx, cos, sin)
            kv.write(pos, k, v)
        cache.lengths += T if n_valid is None else n_valid.to(cache.lengths)

    # -- block forward -----------------------------------------------------------------------------------------

    def _predecessors(self, layer: int, f: torch.Tensor, anchor_pred: torch.Tensor) -> torch.Tensor:
        """p_l(i) = f_l(i-d) if i-d >= 1 else sqrt(r)*code(anchor), for slots 1..bs-1: f [B, bs, r] -> [B, bs-1, r]."""
        src = torch.arange(1, f.shape[1], device=f.device) - self.injection_offsets[layer]  # [bs-1] predecessor slot
        return torch.where((src >= 1)[None, :, None], f[:, src.clamp(min=0)], anchor_pred[:, None, :])

    def _inject(
        self, layer: int, h: torch.Tensor, f: torch.Tensor, anchor_pred: torch.Tensor, p: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Write into slots 1..bs-1 of h [B, bs, H] with predecessors p (default: predicted); slot 0 untouched."""
        p = self._predecessors(layer, f, anchor_pred) if p is None else p  # [B, bs-1, r]
        return torch.cat([h[:, :1], self.injection.write(layer, h[:, 1:], f[:, 1:], p)], dim=1)

    @torch.no_grad()
    def backbone(
        self,
        cache: ModelCache,
        anchor: torch.Tensor,
        target: Target,
        block_size: int | None = None,
        *,
        block_tokens: torch.Tensor | None = None,
        inject: bool = True,
    ) -> BlockOutput:
        """One pass over the block ``[anchor, MASK x (bs-1)]`` at positions ``lengths[b] + 0..bs-1``.

        ``block_tokens [B, bs]`` replaces the block's inputs (tests perturb later slots with it; slot 0 is the
        anchor); ``inject=False`` gives the plain causal DFlash backbone.
        """
        self._check_ready()
        self._check_target(target)
        bs = self.block_size if block_size is None else block_size
        if block_tokens is None:
            block_tokens = torch.full((anchor.shape[0], bs), self.mask_token_id, dtype=torch.long, device=self.device)
            block_tokens[:, 0] = anchor
        B, bs = block_tokens.shape
        if bs < 2:
            raise ValueError(f"block_size {bs} < 2 proposes nothing")
        pos = cache.lengths[:, None] + torch.arange(bs, device=cache.lengths.device)  # [B, bs]
        span = (int(cache.lengths.min()), int(cache.lengths.max()) + bs)
        cos, sin = self.rotary(pos, self.dtype)
        x = target.embed(block_tokens).to(self.dtype)  # [B, bs, H]
        anchor_pred = self.injection.scale * self.transfer_codes[block_tokens[:, 0]]  # [B, r]
        pre = feat = x
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pos, cache.layers[i], self.windows[i], span)
            pre, feat = x, self.injection.features(i, x)  # [B, bs, H], [B, bs, r]
            if inject:
                x = self._inject(i, x, feat, anchor_pred)
        hidden = self.norm(x)
        logits = self.head_logits(hidden[:, 1:], target)  # [B, bs-1, V'] over the draft vocabulary
        return BlockOutput(hidden, logits, pre, feat, block_tokens[:, 0])

    # -- training forward -------------------------------------------------------------------------------------

    def train_forward(
        self,
        taps: torch.Tensor,
        anchors: torch.Tensor,
        block_tokens: torch.Tensor,
        target: Target,
        replace: torch.Tensor | None = None,
        true_tokens: torch.Tensor | None = None,
        replace_layers: int = 0,
    ) -> TrainBlockOutput:
        """All blocks of one sequence in one pass, with gradients (design §5; the inference twin is ``backbone``).

        taps [T, n*H] are the target tap outputs of the whole sequence (row j = position j); anchors [N]
        the block start positions; block_tokens [N, bs] the inputs (``[x_a, MASK...]``). Context K/V are
        computed once per layer for all T rows and masked per block by ``block_causal_mask``, which gives
        the same slot logits as ``extend_context`` of rows < a followed by ``backbone`` (tested).

        Teacher-forced predecessor replacement (§5): blocks with ``replace[n]`` get, in layers
        < ``replace_layers``, sqrt(r)*code(true previous token) (``true_tokens`` [N, bs] = x_a..x_{a+bs-1})
        instead of the predicted predecessor features, so early training is not stuck on garbage messages.
        """
        self._check_ready()
        T = taps.shape[0]
        N, bs = block_tokens.shape
        pos = anchors[:, None] + torch.arange(bs, device=anchors.device)  # [N, bs]
        cos, sin = self.rotary(pos, self.dtype)
        ccos, csin = self.rotary(torch.arange(T, device=anchors.device)[None], self.dtype)
        ctx = self.hidden_norm(self.fc(taps.to(self.dtype)))[None]  # [1, T, H]
        x = target.embed(block_tokens).to(self.dtype)  # [N, bs, H]
        anchor_pred = self.injection.scale * self.transfer_codes[block_tokens[:, 0]]  # [N, r]
        forced = None
        if replace is not None and replace_layers > 0:
            forced = self.injection.scale * self.transfer_codes[true_tokens[:, :-1]]  # [N, bs-1, r]
        post = []
        pre = feat = x
        for i, layer in enumerate(self.layers):
            ck, cv = layer.self_attn.context_kv(ctx, ccos, csin)  # [1, Hkv, T, D]
            x = layer.train_forward(x, cos, sin, ck, cv, block_causal_mask(anchors, T, bs, self.windows[i]))
            pre, feat = x, self.injection.features(i, x)
            p = self._predecessors(i, feat, anchor_pred)  # [N, bs-1, r]
            if forced is not None and i < replace_layers:
                p = torch.where(replace[:, None, None], forced, p)
            x = self._inject(i, x, feat, anchor_pred, p)
            post.append(self.injection.features(i, x))
        return TrainBlockOutput(self.norm(x), pre, feat, post)

    def refine_train(self, out: TrainBlockOutput, pred: torch.Tensor) -> torch.Tensor:
        """Refined, normed last-layer states of slots 1..bs-1 with given predecessors pred [N, bs-1] -> [N, bs-1, H].

        The training twin of ``refine`` (with gradients); training passes the *true* previous tokens.
        """
        return self._refine(out.last_pre[:, 1:, None], out.last_feat[:, 1:, None], pred[..., None])[:, :, 0]

    # -- last-write refinement and the transition cache --------------------------------------------------------

    def _refine(self, pre: torch.Tensor, feat: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """Re-apply the last layer's write with predecessor code(pred), then the final norm.

        pre [..., 1 or k, H], feat [..., 1 or k, r], pred [..., k] LongTensor -> [..., k, H]
        """
        p = self.injection.scale * self.transfer_codes[pred]  # [..., k, r]
        return self.norm(self.injection.write(len(self.layers) - 1, pre, feat, p))

    @torch.no_grad()
    def refine(self, out: BlockOutput, slot: int, pred: torch.Tensor) -> torch.Tensor:
        """Refined, normed last-layer state h~(slot | pred) [B, H] for one slot (1..bs-1) and pred [B] tokens.

        The sequential definition the transition cache batches: score it with ``target.head_weight``.
        """
        if not 1 <= slot < out.hidden.shape[1]:
            raise ValueError(f"slot {slot} out of range 1..{out.hidden.shape[1] - 1}")
        return self._refine(out.last_pre[:, slot, None], out.last_feat[:, slot, None], pred[:, None])[:, 0]

    @torch.no_grad()
    def confidence(self, refined: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """c = sigmoid(w . [h~ ; code(pred)] + b): refined [..., H], pred [...] -> [...] float32."""
        if self.confidence_head is None:
            raise RuntimeError("this DSpine draft has no confidence head")
        return self.confidence_head(refined, self.transfer_codes[pred])

    @torch.no_grad()
    def transition(self, out: BlockOutput, target: Target) -> Transition:
        """Top-k candidates per slot and their refined scores under every candidate predecessor (§2.4).

        Row j of slot i (i >= 2) is "slot i-1 chose its candidate j"; slot 1's predecessor is the anchor, so
        its k rows are identical. About n*k*k dot products on top of n*k refinements.
        """
        B, n, V = out.logits.shape
        k = min(self.top_k, V)
        cand = self.vocab_ids(out.logits.topk(k, dim=-1).indices)  # [B, n, k] target ids
        pred = torch.cat([out.anchor[:, None, None].expand(B, 1, k), cand[:, :-1]], dim=1)  # [B, n, k]
        refined = self._refine(out.last_pre[:, 1:, None], out.last_feat[:, 1:, None], pred)  # [B, n, k, H]
        w = target.head_weight[cand]  # [B, n, k, H]
        scores = (refined.to(w.dtype) @ w.transpose(-1, -2)).float()  # [B, n, k(pred), k(cand)]
        conf = self.confidence(refined, pred) if self.confidence_enabled else None  # [B, n, k]
        return Transition(cand, pred, scores, conf)

    # -- proposal ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(
        self,
        cache: ModelCache,
        anchor: torch.Tensor,
        target: Target,
        temperature: torch.Tensor,
        generators: list[torch.Generator | None],
        block_size: int | None = None,
        dynamic_threshold: float | None = None,
        walk: str | None = None,
    ) -> Proposal:
        """Draft bs-1 tokens after ``anchor`` for every row (§2.4, §6.2).

        ``walk``: "cache" builds the whole [n, k, k] transition cache in one batched pass (GPU-friendly);
        "lazy" refines only the chosen predecessor per slot. Same tokens, same q. Default: ``self.walk``.

        Greedy rows (temperature 0) walk the transition cache by argmax; sampled rows draw x_i from
        q_i = softmax(scores[i, row(x_{i-1}), :] / T) over the k candidates by inverse CDF, consuming exactly
        one ``torch.rand(bs-1, generator=generators[b])`` per call, so a row's draws never depend on its batch
        neighbours. ``dynamic_threshold`` (used only when ``confidence_enabled``) stops at the first
        c_i < threshold: ``n_draft = i - 1``; c_i depends only on x_{<i}, so the cut is a stopping time.
        """
        bs = self.block_size if block_size is None else block_size
        if not 2 <= bs <= self.block_size:
            raise ValueError(f"block_size {bs} out of range 2..{self.block_size}")
        out = self.backbone(cache, anchor, target, bs)
        if (self.walk if walk is None else walk) == "cache":
            tr = self.transition(out, target)
            B = tr.cand.shape[0]
            rows = torch.arange(B, device=tr.cand.device)

            def row_scores(i: int, prev: torch.Tensor):
                conf = None if tr.confidence is None else tr.confidence[rows, i, prev]
                return tr.scores[rows, i, prev], conf

            return self._walk(tr.cand, row_scores, temperature, generators, dynamic_threshold)
        return self._walk_lazy(out, target, temperature, generators, dynamic_threshold)

    def _walk_lazy(self, out: BlockOutput, target: Target, temperature, generators, threshold) -> Proposal:
        """The walk with refinement computed only for the predecessor actually chosen (k× less work).

        Equal to walking the full transition cache (the cache is the batched form of this sequential
        definition); preferred where 15·k² refinements cost more than 15 sequential small steps (CPU).
        """
        B, n, V = out.logits.shape
        k = min(self.top_k, V)
        cand = self.vocab_ids(out.logits.topk(k, dim=-1).indices)  # [B, n, k] target ids
        w = target.head_weight[cand]  # [B, n, k, H]
        rows = torch.arange(B, device=cand.device)

        def row_scores(i: int, prev: torch.Tensor):
            pred = out.anchor if i == 0 else cand[rows, i - 1, prev]  # [B]
            refined = self._refine(out.last_pre[:, 1 + i, None], out.last_feat[:, 1 + i, None], pred[:, None])[:, 0]
            scores = (w[:, i] @ refined.to(w.dtype)[:, :, None])[..., 0].float()  # [B, k]
            conf = self.confidence(refined, pred) if self.confidence_enabled else None
            return scores, conf

        return self._walk(cand, row_scores, temperature, generators, threshold)

    def _walk(
        self,
        cand: torch.Tensor,
        row_scores,
        temperature: torch.Tensor,
        generators: list[torch.Generator | None],
        threshold: float | None,
    ) -> Proposal:
        """Choose x_1..x_n slot by slot; ``row_scores(i, prev)`` gives slot i+1's candidate scores [B, k] (and
        confidence [B] or None) given that slot i chose candidate ``prev`` [B] (ignored for slot 1)."""
        B, n, k = cand.shape
        dev = cand.device
        temperature = torch.as_tensor(temperature, dtype=torch.float32).to(dev).reshape(B)
        sampled = temperature > 0  # [B]
        sampled_rows = sampled.tolist()
        any_sampled = any(sampled_rows)
        if any_sampled:
            if len(generators) != B:
                raise ValueError(f"need one generator (or None) per row: got {len(generators)} for batch {B}")
            draws = []
            for b in range(B):
                g = generators[b]
                if sampled_rows[b]:
                    draws.append(torch.rand(n, generator=g, device=g.device if g is not None else dev).to(dev))
                else:
                    draws.append(torch.zeros(n, device=dev))
            u = torch.stack(draws)  # [B, n] uniforms in [0, 1)
            temp = torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]  # [B, 1]
            q_small = torch.zeros(B, n, k, dtype=torch.float32, device=dev)
        rows = torch.arange(B, device=dev)
        ks = torch.arange(k, device=dev)
        prev = torch.zeros(B, dtype=torch.long, device=dev)  # row into the cache: slot 1's rows are all equal
        tokens = torch.empty(B, n, dtype=torch.long, device=dev)
        conf = None
        for i in range(n):
            s, c = row_scores(i, prev)  # [B, k] scores of slot i+1 given the chosen predecessor
            if c is not None:  # computed before x_{i+1} is chosen
                if conf is None:
                    conf = torch.empty(B, n, dtype=torch.float32, device=dev)
                conf[:, i] = c
            pick = s.argmax(-1)
            if any_sampled:
                probs = torch.softmax(s / temp, dim=-1)  # [B, k]: q_i restricted to the candidates
                cdf = probs.cumsum(-1)
                j = (cdf <= (u[:, i] * cdf[:, -1])[:, None]).sum(-1)  # first index with cdf > u
                j = torch.minimum(j, torch.where(probs > 0, ks, 0).amax(-1))  # never an index with q = 0
                pick = torch.where(sampled, j, pick)
                q_small[:, i] = torch.where(sampled[:, None], probs, F.one_hot(pick, k).float())
            tokens[:, i] = cand[rows, i, pick]
            prev = pick
        q = None
        if any_sampled:  # dense q: exactly the sampled distribution, zero off the candidates; greedy rows one-hot
            q = torch.zeros(B, n, self.vocab_size, dtype=torch.float32, device=dev).scatter_(-1, cand, q_small)
        n_draft = torch.full((B,), n, dtype=torch.long, device=dev)
        if threshold is not None and conf is not None:
            stop = conf < threshold  # [B, n]
            n_draft = torch.where(stop.any(-1), stop.int().argmax(-1), n_draft)  # first c_i < threshold -> i-1
        return Proposal(tokens, q, n_draft, conf)

    # -- checkpoint --------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` (§4.1 + ``confidence_trained``) and one ``model.safetensors`` (§4.2 names)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = copy.deepcopy(self.config)
        cfg["dtype"] = str(self.dtype).removeprefix("torch.")
        cfg["dspine_config"]["use_confidence_head"] = self.confidence_head is not None
        cfg["dspine_config"]["confidence_trained"] = bool(self.confidence_trained)
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """Random init: N(0, 0.02) linears, unit norms; injection writes and G_pred zero (= DFlash at init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, INIT_STD, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.offset else 1.0)
        inj = self.injection
        for w in inj.writes:
            w.weight.zero_()
        inj.predecessor_gate.weight.zero_()
        inj.bias.zero_()
        if self.confidence_head is not None:  # c = 0.5 until trained
            self.confidence_head.proj.weight.zero_()
            self.confidence_head.proj.bias.zero_()


def init_draft(
    target: Target,
    num_layers: int = 5,
    block_size: int = 16,
    seed: int = 0,
    draft_vocab: torch.Tensor | list[int] | None = None,
    **overrides,
) -> DSpineDraft:
    """A randomly initialised DSpine draft for ``target`` (fp32, on the target's device).

    Dimensions default to the target's (heads, KV heads, head_dim, intermediate size, RoPE, RMS eps); see
    ``make_draft_config`` for every override. ``mask_token_id`` defaults to the target config's
    ``mask_token_id`` when it has one, else to ``vocab_size - 1`` (the draft only needs a fixed id whose
    embedding marks "unknown"; a trained draft must keep the id it was trained with). Transfer codes are
    computed from ``target.head_weight`` (§2.2) and stored; readouts start at D^T; writes and G_pred at zero.
    ``draft_vocab`` (target ids) restricts the proposal head to those tokens (sorted and de-duplicated here).
    """
    vocab = None
    if draft_vocab is not None:
        vocab = torch.as_tensor(draft_vocab, dtype=torch.long).unique()  # sorted, no repeats
        overrides["draft_vocab_size"] = len(vocab)
    cfg = make_draft_config(target, num_layers, block_size, **overrides)
    with torch.device("meta"):
        model = DSpineDraft(cfg, where="init_draft")
    model = model.to_empty(device="cpu")
    model.rotary.inv_freq = model.rotary.spec.inv_freq()
    model.reset_parameters(torch.Generator().manual_seed(seed))
    space = compute_transfer_space(target.head_weight.detach(), model.transfer_rank)
    with torch.no_grad():
        model.transfer_codes.copy_(space.codes.cpu())
        model.transfer_ready.fill_(True)
        if vocab is not None:
            model.draft_vocab.copy_(vocab)
        for readout in model.injection.readouts:
            readout.weight.copy_(space.directions.T.float().cpu())  # R_l = D^T
    return model.to(target.device).eval()


def with_draft_vocab(draft: DSpineDraft, vocab: torch.Tensor | list[int]) -> DSpineDraft:
    """A copy of ``draft`` whose proposal head covers only ``vocab`` (target ids): every weight is kept, so a
    draft trained on the full head can be warm-started on a draft vocabulary (the head is the target's)."""
    ids = torch.as_tensor(vocab, dtype=torch.long).unique()
    cfg = copy.deepcopy(draft.config)
    cfg["dspine_config"]["draft_vocab_size"] = len(ids)
    new = DSpineDraft(cfg, confidence_head=draft.confidence_head is not None, where="with_draft_vocab")
    state = {k: v for k, v in draft.state_dict().items() if k != "draft_vocab"}
    missing, unexpected = new.load_state_dict({**state, "draft_vocab": ids}, strict=False)
    if unexpected or [m for m in missing if not m.startswith("rotary.")]:
        raise ValueError(f"with_draft_vocab: state mismatch (missing {missing}, unexpected {unexpected})")
    new.confidence_trained = draft.confidence_trained
    new = new.to(device=draft.device, dtype=draft.dtype).train(draft.training)
    new.rotary.inv_freq = new.rotary.spec.inv_freq(device=draft.device)  # fp32, as load_draft keeps it
    return new


def _checkpoint_name(name: str) -> str | None:
    """Checkpoint tensor name -> module name; None for the borrowed embedding / LM head (ignored)."""
    name = name.removeprefix("model.")
    if name.startswith(("embed_tokens.", "lm_head.")):
        return None
    return name


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DSpineDraft:
    """Load a draft saved by ``DSpineDraft.save`` (or a §4-compatible export), strictly.

    Accepts an optional ``model.`` prefix, ignores ``embed_tokens.*``/``lm_head.*``, refuses unknown and
    missing tensors. The confidence head is optional: it exists iff its tensors are in the checkpoint.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    cfg = read_config(path)
    names = [_checkpoint_name(n) for n in weight_files(path)]
    has_head = any(n is not None and n.startswith("confidence_head.") for n in names)
    with torch.device("meta"):
        model = DSpineDraft(cfg, confidence_head=has_head, where=str(cfg_file))
    if model.confidence_trained and not has_head:
        raise ModelLoadError(
            f"{cfg_file}: dspine_config.confidence_trained is true but {path} has no 'confidence_head.proj.weight'"
        )
    model = model.to_empty(device=device).to(dtype)
    model.rotary.inv_freq = model.rotary.spec.inv_freq(device=device)
    load_state(model, path, rename=_checkpoint_name)
    model.check_vocab(str(path / "model.safetensors"))
    return model.eval()


DECODE_DEFAULTS = "decode.json"


def read_decode_defaults(path: str | Path) -> dict:
    """Measured decode settings shipped beside a draft (``decode.json``): ``block_size`` and/or
    ``dynamic_threshold``, used by engines when the user sets none. Absent file: ``{}``.

    They live outside ``config.json`` because they describe the hardware the draft was measured on (a CPU
    wants shorter verify blocks than a GPU), not the model; ``BENCHMARKS.md`` holds the measurements.
    """
    f = Path(path) / DECODE_DEFAULTS
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    out: dict = {}
    for key, value in raw.items():
        if key.startswith("_"):  # comments / provenance
            continue
        if key == "block_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ModelLoadError(f"{f}: block_size must be an integer >= 2, got {value!r}")
        elif key == "dynamic_threshold":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ModelLoadError(f"{f}: dynamic_threshold must be a number in [0, 1], got {value!r}")
        else:
            raise ModelLoadError(f"{f}: unknown key {key!r} (block_size, dynamic_threshold)")
        out[key] = value
    return out
