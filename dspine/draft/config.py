"""The DSpine draft's ``config.json``: validation into a ``DraftSpec``, and the config of a fresh draft.

A draft checkpoint is a Qwen3-style config with a ``dflash_config`` (block, mask token, target taps) and a
``dspine_config`` (transfer rank, message size, top-k, injection offsets, confidence head, training
settings); see ``docs/design.md``, "The DSpine draft". Every error is a ``ModelLoadError`` naming the file
and the key, because these configs are hand-edited and exported by other tools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from dspine.draft.transfer import max_transfer_rank
from dspine.models.checkpoint import ModelLoadError
from dspine.models.layers import RopeSpec
from dspine.models.target import Target, default_tap_ids

# The SpecForge ``DSpineConfig`` training fields at their defaults. The draft never reads them; they
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
    """Validate a draft ``config.json`` dict; errors are ``ModelLoadError`` naming ``where`` and the key.

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
    """The ``config.json`` dict of a fresh draft for ``target``; see ``init_draft``."""
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
