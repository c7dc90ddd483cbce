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
both are refused by name. On our CPU kernels attention is the fused pair every dense family uses
(``kernels.rope_store`` / ``attend_cache``: the value norm is applied before the store, a KV-shared layer rotates
its queries and reads its source layer's cache, scale 1), the per-layer input projection is packed too, and a
ragged forward computes its valid tokens only: batch invariant, so the prefix cache and chunked prefill run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspine.models.cache import KVCache, ModelCache
from dspine.models.checkpoint import ModelLoadError, in_config, load_state
from dspine.models.layers import Packing, Positions, RMSNorm, RopeSpec, Rotary, SwiGLU, apply_rope, attend, fuse_linears
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
        self.shared, self.k_eq_v = plan.source is not None, plan.k_eq_v
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        if not self.shared:
            self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
            if not plan.k_eq_v:
                self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.qkv_proj: nn.Linear | None = None
        self.fast = False  # RoPE + cache store and attention through dspine.cpu.kernels (``Target.use_kernels``)

    def fuse(self) -> None:
        """Inference only: the projections of x as one GEMM (q, k and, unless keys are values, v); a KV-shared
        layer projects queries only."""
        if self.shared:
            return
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, *(() if self.k_eq_v else (self.v_proj,)))
        del self.q_proj, self.k_proj
        if not self.k_eq_v:
            del self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q, k, v projections (k and v None on a KV-shared layer; v is k's projection with ``attention_k_eq_v``)."""
        if self.qkv_proj is None:
            q = self.q_proj(x)
            if self.shared:
                return q, None, None
            k = self.k_proj(x)
            return q, k, k if self.k_eq_v else self.v_proj(x)
        kv_width = self.n_kv * self.head_dim
        parts = self.qkv_proj(x).split([self.n_heads * self.head_dim] + [kv_width] * (1 if self.k_eq_v else 2), -1)
        return parts[0], parts[1], parts[-1]

    def forward(self, x, cos, sin, at: Positions, kv: KVCache, window: int | None,
                packed: Packing | None = None) -> torch.Tensor:
        q, k, v = self.project(x)
        if packed is not None:  # x [N, H]: the valid tokens only (``Packing``)
            q, k, v = (None if y is None else packed.spread(y) for y in (q, k, v))
            B, T = packed.shape
        else:
            B, T, _ = x.shape
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim))
        if not self.shared:  # a KV-shared layer reads what its source layer wrote in this same forward
            v = v.view(B, T, self.n_kv, self.head_dim)
            v = _value_norm(v, self.eps) if not self.fast else torch.ops.dspine_cpu.rms_norm(
                v.contiguous(), v.new_ones(self.head_dim), self.eps, 0.0)  # ours: batch invariant
            k = self.k_norm(k.view(B, T, self.n_kv, self.head_dim))
        if self.fast:  # the same computation in two fused calls
            from dspine.cpu import kernels

            if self.shared:  # rotate the queries only: no key or value heads to store
                k = v = q.new_empty(B, T, 0, self.head_dim)
            else:
                kv.ensure(at.upto)
            q = kernels.rope_store(q.contiguous(), k, v, cos[:, 0], sin[:, 0], kv.k, kv.v, at.pos)
            o = kernels.attend_cache(q, kv.k, kv.v, at.queries(packed), window, 1.0)
            return self.o_proj(o if packed is None else packed.gather(o))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        if not self.shared:
            kv.write(at.pos, apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2), upto=at.upto, rows=at.rows)
        keys, values = kv.view(at.upto)
        o = attend(q, keys, values, at.mask(window), 1.0).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o if packed is None else packed.gather(o))


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

    def forward(self, x, per_layer, cos, sin, at, kv, window, packed=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, at, kv, window,
                                                             packed))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if per_layer is not None:
            g = self.per_layer_input_gate(x)
            if self.mlp.fast:  # the MLP's fused activation-gate op, batch invariant (``kernels.gelu_tanh_mul``)
                from dspine.cpu.kernels import gelu_tanh_mul, silu_mul

                g = (silu_mul if self.act == "silu" else gelu_tanh_mul)(torch.cat([g, per_layer], dim=-1))
            else:
                g = (F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Target(Target):
    family = "gemma4"
    OUTSIDE_LINEARS = ("per_layer_model_projection",)  # packed with the layers (``Target.use_kernels``)

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
            raise in_config(e, path) from None
        load_state(model, path, rename=model.checkpoint_name, dtype=dtype)
        return model.eval()

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_SKIP_PREFIXES):  # the multimodal model's towers: not the text decoder
            return None
        name = name.removeprefix("model.language_model.").removeprefix("model.")
        if name == "lm_head.weight" and self.tied:
            return None
        if ".self_attn." in name and name.split(".self_attn.")[1].split(".")[0] in ("k_proj", "v_proj", "k_norm",
                                                                                      "v_norm"):
            return name if name in self._names else None  # KV-shared layers' unused projections (HF drops them)
        return name

    @functools.cached_property
    def _names(self) -> set[str]:
        return set(self.state_dict())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings x sqrt(hidden) rounded to the model's dtype (as Gemma 3)."""
        return self.embed_tokens(ids) * torch.tensor(self.hidden_size**0.5, dtype=torch.float32).to(self.dtype)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[..., layers, P] for ids [...] (``[B, T]``, or ``[N]`` packed): the per-layer embedding of each token and a
        projection of its scaled embedding ``x``."""
        p, lead = self.per_layer, ids.shape
        tok = self.embed_tokens_per_layer(ids) * torch.tensor(p**0.5, dtype=torch.float32).to(self.dtype)
        proj = self.per_layer_model_projection(x) * self.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(*lead, self.num_layers, p))
        return (proj + tok.reshape(*lead, self.num_layers, p)) * 2.0**-0.5

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

    def fused_attention(self) -> bool:
        return all(layer.self_attn.fast for layer in self.layers)

    @property
    def packs(self) -> bool:
        return self.fused_attention()

    def new_cache(self, batch: int, capacity: int) -> ModelCache:
        caches = [KVCache.empty(batch, self.plans[i].n_kv, capacity, self.plans[i].head_dim, self.kv_dtype,
                                self.device) for i in self.owners]
        return ModelCache(torch.zeros(batch, dtype=torch.long, device=self.device), caches)

    def forward(self, ids, cache, n_valid=None, speculative=False, taps=()):
        """See ``target.py``. With ``n_valid`` on the fused CPU kernels only the valid tokens are computed
        (``Packing``, as ``llama.DenseTarget``); on torch padded slots are computed and never read."""
        B, T = ids.shape
        pos = cache.lengths[:, None] + torch.arange(T, device=ids.device)  # [B, T]
        packed = Packing.of(n_valid, B, T) if n_valid is not None and self.packs else None
        if packed is not None and bool((n_valid == 0).any()):  # a finished row kept in its slot reads one key
            pos = torch.where((n_valid == 0).to(pos.device)[:, None], torch.zeros_like(pos), pos)
        tables = [rot(pos, self.dtype) for rot in self.rotaries]
        ids_in = ids if packed is None else packed.gather(ids)
        x = self.embed(ids_in)
        per_layer = self.per_layer_inputs(ids_in, x) if self.per_layer else None
        at = Positions.of(pos)
        want, tapped = set(taps), {}
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.rope_index[i]]
            x = layer(x, None if per_layer is None else per_layer[..., i, :], cos, sin, at,
                      cache.layers[self.cache_index[i]], self.windows[i], packed)
            if i in want:
                tapped[i] = x
        if not speculative:
            cache.lengths += T if n_valid is None else n_valid.to(cache.lengths)
        tap = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        hidden = self.norm(x)
        if packed is not None:
            hidden = packed.spread(hidden).view(B, T, -1)
            tap = None if tap is None else packed.spread(tap).view(B, T, -1)
        return TargetOutput(hidden, tap)
