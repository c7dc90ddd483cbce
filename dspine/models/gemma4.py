"""Gemma 4's text decoder (``gemma4_text``; the ``text_config`` of a ``gemma4`` checkpoint): the small dense models.

Its block is Gemma 3's sandwich (four norms, GELU-tanh, sliding and full layers with their own RoPE, QK-norm,
embedding x sqrt(hidden), final soft-capping) with these differences, each read from ``transformers``' modeling
file (the facts, not the code):

- norms are ``x * w`` (not ``1 + w``); values are RMS-normalised per head too (no weight); scores are not scaled
  (``q . k``, the QK-norms carry the scale);
- full layers have their own head size and KV-head count (``per_layer_config``, or ``global_head_dim`` /
  ``num_global_key_value_heads``); with ``attention_k_eq_v`` they have no ``v_proj``: values are the key
  projection before its norm;
- full layers' RoPE is ``proportional`` (``layers.RopeSpec``): the whole head rotates half-by-half, only its first
  ``partial_rotary_factor`` of frequencies non-zero;
- per-layer inputs: a second embedding (``embed_tokens_per_layer``, x sqrt(P)) plus a projection of the scaled
  embedding (x hidden^-0.5, RMS-normed), summed and x 2^-0.5, give each layer a P-wide input; after its MLP the
  layer adds ``norm(proj(gelu(gate(x)) * input))``, then the whole layer output is multiplied by ``layer_scalar``;
- the last ``num_kv_shared_layers`` layers have no keys or values of their own: each reads the cache of the last
  earlier layer of its type (so they write nothing), and with ``use_double_wide_mlp`` their MLP is twice as wide.

Not run: the mixture-of-experts block (``enable_moe_block``, the 26B-A4B model) and fully bidirectional attention;
both are refused by name. Attention runs on torch here (the fused CPU attention has no value norm or shared
cache), so the target names that gap and the prefix cache / chunked prefill turn off for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspine.models.cache import KVCache, ModelCache
from dspine.models.checkpoint import ModelLoadError, load_state
from dspine.models.layers import Positions, RMSNorm, RopeSpec, Rotary, SwiGLU, apply_rope, attend
from dspine.models.target import Target, TargetOutput

SLIDING, FULL = "sliding_attention", "full_attention"
_SKIP_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def text_config(cfg: dict) -> dict:
    """The decoder's config: top level for ``gemma4_text``; ``text_config`` for the ``gemma4`` multimodal model."""
    if "text_config" not in cfg:
        return dict(cfg)
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "audio_config")}
    return {**top, **(cfg["text_config"] or {}), "model_type": "gemma4_text"}


@dataclass(frozen=True)
class LayerPlan:
    kind: str  # SLIDING or FULL
    head_dim: int
    n_kv: int
    k_eq_v: bool  # values are the key projection (no v_proj)
    source: int | None  # KV-shared layers: the layer whose cache they read (None: their own)
    intermediate: int


def plan_layers(cfg: dict) -> list[LayerPlan]:
    """Each layer's shape, as Hugging Face's ``Gemma4TextConfig`` derives it; ``ModelLoadError`` for what we do not
    run."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("enable_moe_block"):
        raise ModelLoadError("config.json: enable_moe_block (Gemma 4's mixture-of-experts layers, the 26B-A4B model) "
                             "is not supported (dense Gemma 4 only)")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("config.json: use_bidirectional_attention 'all' (an encoder Gemma 4) is not a causal LM")
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"config.json: layer_types must be {n} entries of {SLIDING!r}/{FULL!r}")
    types[-1] = FULL  # HF forces the last layer global
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    n_kv = int(cfg.get("num_key_value_heads") or heads)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not cfg.get("per_layer_config"):
        full = {"head_dim": int(cfg.get("global_head_dim", 512))}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    if shared and (shared >= n or set(types[:first_shared]) != set(types)):
        raise ModelLoadError(f"config.json: num_kv_shared_layers {shared} leaves no earlier layer of each type to "
                             f"share keys and values from")
    plans = []
    for i, kind in enumerate(types):
        own = overrides.get(i, {})
        source = None
        if i >= first_shared:
            source = max(j for j in range(first_shared) if types[j] == kind)
        wide = 2 if cfg.get("use_double_wide_mlp") and source is not None else 1
        plans.append(LayerPlan(kind, int(own.get("head_dim", head_dim)), int(own.get("num_key_value_heads", n_kv)),
                               k_eq_v and kind == FULL, source, int(cfg["intermediate_size"]) * wide))
    return plans


def _rope(cfg: dict, kind: str, head_dim: int) -> RopeSpec:
    params = dict((cfg.get("rope_parameters") or {}).get(kind) or {})
    if not params:
        params = ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
                  if kind == FULL else {"rope_type": "default", "rope_theta": 10_000.0})
    try:
        return RopeSpec.from_config(cfg, head_dim, params=params)
    except ValueError as e:
        raise ModelLoadError(f"config.json: {kind} layers: {e}") from None


def _value_norm(v: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, in fp32 (Gemma 4's ``v_norm``)."""
    x = v.float()
    return (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(v.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict, plan: LayerPlan):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        bias = bool(cfg.get("attention_bias", False))
        self.n_heads, self.head_dim, self.n_kv, self.eps = cfg["num_attention_heads"], plan.head_dim, plan.n_kv, eps
        self.shared = plan.source is not None
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        if not self.shared:
            self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
            self.v_proj = None if plan.k_eq_v else nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)

    def forward(self, x, cos, sin, at: Positions, kv: KVCache, window: int | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        if not self.shared:  # a KV-shared layer reads what its source layer wrote in this same forward
            k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
            k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
            v = _value_norm(v, self.eps).transpose(1, 2)
            kv.write(at.pos, k, v, upto=at.upto, rows=at.rows)
        keys, values = kv.view(at.upto)
        o = attend(q, keys, values, at.mask(window), 1.0)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: dict, plan: LayerPlan):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        self.act = act
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, plan)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, plan.intermediate, act=act)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        p = int(cfg.get("hidden_size_per_layer_input") or 0)
        if p:
            self.per_layer_input_gate = nn.Linear(h, p, bias=False)
            self.per_layer_projection = nn.Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, per_layer, cos, sin, at, kv, window):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, at, kv, window))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if per_layer is not None:
            g = self.per_layer_input_gate(x)
            g = (F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Target(Target):
    family = "gemma4"

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg = text_config(cfg)
        self.model_type = "gemma4_text"
        self.plans = plans = plan_layers(cfg)
        self.hidden_size, self.vocab_size = cfg["hidden_size"], cfg["vocab_size"]
        self.num_layers = len(plans)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, p) for p in plans)
        self.norm = RMSNorm(self.hidden_size, eps)
        self.per_layer = p = int(cfg.get("hidden_size_per_layer_input") or 0)
        if p:
            self.embed_tokens_per_layer = nn.Embedding(int(cfg.get("vocab_size_per_layer_input") or self.vocab_size),
                                                       self.num_layers * p)
            self.per_layer_model_projection = nn.Linear(self.hidden_size, self.num_layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, eps)
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = None if self.tied else nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        specs = [_rope(cfg, pl.kind, pl.head_dim) for pl in plans]
        distinct = list(dict.fromkeys(specs))
        self.rotaries = nn.ModuleList(Rotary(r) for r in distinct)
        self.rope_index = [distinct.index(r) for r in specs]
        window = cfg.get("sliding_window")
        self.windows = [window if pl.kind == SLIDING else None for pl in plans]
        # one cache per layer with its own keys and values; a KV-shared layer reads its source layer's
        self.owners = [i for i, pl in enumerate(plans) if pl.source is None]
        self.cache_index = [self.owners.index(i if pl.source is None else pl.source) for i, pl in enumerate(plans)]
        self.final_softcap = cfg.get("final_logit_softcapping")

    @classmethod
    def from_pretrained(cls, path: Path, cfg: dict, dtype=torch.float32, device="cpu") -> Gemma4Target:
        try:
            model = cls.empty(cfg, dtype, device, path)
        except ModelLoadError as e:
            raise ModelLoadError(str(e).replace("config.json:", f"{path / 'config.json'}:", 1)) from None
        expected = set(model.state_dict())

        def rename(name: str) -> str | None:
            if name.startswith(_SKIP_PREFIXES):  # the multimodal model's towers: not the text decoder
                return None
            name = name.removeprefix("model.language_model.").removeprefix("model.")
            if name == "lm_head.weight" and model.tied:
                return None
            if ".self_attn." in name and name.split(".self_attn.")[1].split(".")[0] in ("k_proj", "v_proj", "k_norm",
                                                                                          "v_norm"):
                return name if name in expected else None  # KV-shared layers' unused projections (HF drops them)
            return name

        load_state(model, path, rename=rename, dtype=dtype)
        return model.eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings x sqrt(hidden) rounded to the model's dtype (as Gemma 3)."""
        return self.embed_tokens(ids) * torch.tensor(self.hidden_size**0.5, dtype=torch.float32).to(self.dtype)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, T, layers, P]: the per-layer embedding of each token and a projection of its scaled embedding."""
        B, T = ids.shape
        p = self.per_layer
        tok = self.embed_tokens_per_layer(ids) * torch.tensor(p**0.5, dtype=torch.float32).to(self.dtype)
        proj = self.per_layer_model_projection(x) * self.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(B, T, self.num_layers, p))
        return (proj + tok.reshape(B, T, self.num_layers, p)) * 2.0**-0.5

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().logits(hidden)
        cap = self.final_softcap
        return torch.tanh(out / cap) * cap if cap else out

    def describe(self) -> dict:
        shared = [i for i, pl in enumerate(self.plans) if pl.source is not None]
        return {"options": {k: v for k, v in {
            "norms": "sandwich (x * w)", "activation": self.layers[0].act, "embed_scale": self.hidden_size**0.5,
            "attn_scale": 1.0, "value_norm": True, "final_softcap": self.final_softcap,
            "per_layer_input": self.per_layer or None,
            "k_eq_v_full_layers": any(pl.k_eq_v for pl in self.plans) or None,
            "kv_shared_layers": shared or None}.items() if v is not None},
            "layers_head_dim": [pl.head_dim for pl in self.plans],
            "layers_rope": [f"{r.rope_type} (theta {r.theta:g})" for r in (self.rotaries[i].spec
                                                                           for i in self.rope_index)],
            "layers_window": self.windows}

    @property
    def invariance_gaps(self) -> tuple[str, ...]:
        return super().invariance_gaps + (
            "Gemma 4's attention (value norm, per-layer head sizes, KV-shared layers) runs on torch's ops, whose "
            "rounding follows the batch's shape",)

    def new_cache(self, batch: int, capacity: int) -> ModelCache:
        caches = [KVCache.empty(batch, self.plans[i].n_kv, capacity, self.plans[i].head_dim, self.kv_dtype,
                                self.device) for i in self.owners]
        return ModelCache(torch.zeros(batch, dtype=torch.long, device=self.device), caches)

    def forward(self, ids, cache, n_valid=None, speculative=False, taps=()):
        """See ``target.py``. Padded rows compute every slot (no packing); their outputs there are never read."""
        B, T = ids.shape
        pos = cache.lengths[:, None] + torch.arange(T, device=ids.device)  # [B, T]
        tables = [rot(pos, self.dtype) for rot in self.rotaries]
        x = self.embed(ids)
        per_layer = self.per_layer_inputs(ids, x) if self.per_layer else None
        at = Positions.of(pos)
        want, tapped = set(taps), {}
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.rope_index[i]]
            x = layer(x, None if per_layer is None else per_layer[:, :, i], cos, sin, at,
                      cache.layers[self.cache_index[i]], self.windows[i])
            if i in want:
                tapped[i] = x
        if not speculative:
            cache.lengths += T if n_valid is None else n_valid.to(cache.lengths)
        tap = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return TargetOutput(self.norm(x), tap)
