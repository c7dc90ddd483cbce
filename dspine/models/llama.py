"""Dense decoder-only targets: Llama (SmolLM2 is one) and Qwen3 (Llama + per-head q/k RMSNorm).

One readable file in the gpt-fast style: explicit KV cache, per-row positions, shapes in comments.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dspine.models.cache import KVCache, ModelCache
from dspine.models.checkpoint import ModelLoadError, load_state
from dspine.models.layers import Packing, Positions, RMSNorm, RopeSpec, Rotary, SwiGLU, apply_rope, attend, fuse_linears
from dspine.models.target import Target, TargetOutput


class Attention(nn.Module):
    def __init__(self, cfg: dict, qk_norm: bool):
        super().__init__()
        h = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or h // self.n_heads
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.qkv_proj: nn.Linear | None = None
        self.fast = False  # RoPE + cache store and attention through dspine.cpu.kernels (``Target.use_kernels``)

    def fuse(self) -> None:
        """Inference only: q/k/v as one projection (one GEMM per layer instead of three)."""
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv_width = self.n_kv * self.head_dim
        return self.qkv_proj(x).split([self.n_heads * self.head_dim, kv_width, kv_width], dim=-1)

    def forward(self, x, cos, sin, at: Positions, kv: KVCache, window: int | None, packed: Packing | None = None):
        if packed is not None:  # x [N, H]: the valid tokens only (``Packing``)
            q, k, v = (packed.spread(y) for y in self.project(x))
            B, T = packed.shape
        else:
            B, T, _ = x.shape
            q, k, v = self.project(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fast:  # the same computation in two fused calls
            from dspine.cpu import kernels

            kv.ensure(at.upto)
            q = kernels.rope_store(q.contiguous(), k, v, cos[:, 0], sin[:, 0], kv.k, kv.v, at.pos)
            o = kernels.attend_cache(q, kv.k, kv.v, at.pos, window, self.head_dim**-0.5)
            return self.o_proj(o if packed is None else packed.gather(o))
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        kv.write(at.pos, k, v.transpose(1, 2), upto=at.upto, rows=at.rows)
        keys, values = kv.view(at.upto)
        o = attend(q, keys, values, at.mask(window), self.head_dim**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: dict, qk_norm: bool):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = SwiGLU(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x, cos, sin, at: Positions, kv, window, packed: Packing | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, at, kv, window, packed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseTarget(Target):
    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        self.model_type = cfg.get("model_type", "llama")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported (only silu)")
        qk_norm = self.model_type == "qwen3"
        self.hidden_size = cfg["hidden_size"]
        self.vocab_size = cfg["vocab_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, qk_norm) for _ in range(self.num_layers))
        self.norm = RMSNorm(self.hidden_size, cfg.get("rms_norm_eps", 1e-6))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = Rotary(RopeSpec.from_config(cfg, head_dim))
        # Qwen3 checkpoints may set use_sliding_window with per-layer windows; honour the simple form.
        sw = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types") or ["full_attention"] * self.num_layers
        self.windows = [sw if t == "sliding_attention" else None for t in types]

    @classmethod
    def from_pretrained(cls, path: Path, cfg: dict, dtype=torch.float32, device="cpu") -> DenseTarget:
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        model = cls.empty(cfg, dtype, device, path, required)

        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and model.tied:
                return None
            return name

        load_state(model, path, rename=rename, dtype=dtype)
        return model.eval()

    def fused_attention(self) -> bool:
        return all(layer.self_attn.fast for layer in self.layers)

    @property
    def packs(self) -> bool:
        return self.fused_attention()

    def new_cache(self, batch: int, capacity: int) -> ModelCache:
        a = self.layers[0].self_attn
        return ModelCache(
            torch.zeros(batch, dtype=torch.long, device=self.device),
            [KVCache.empty(batch, a.n_kv, capacity, a.head_dim, self.kv_dtype, self.device) for _ in self.layers],
        )

    def forward(self, ids, cache, n_valid=None, speculative=False, taps=()):
        """See ``target.py``. With ``n_valid`` on the fused CPU kernels only the valid tokens are computed
        (``Packing``): a ragged verify or prefill costs its real tokens, not rows x the longest row. Each token's
        bits are those of the padded forward (the kernels are batch invariant); outputs at padded slots are 0."""
        B, T = ids.shape
        pos = cache.lengths[:, None] + torch.arange(T, device=ids.device)  # [B, T]
        packed = Packing.of(n_valid, B, T) if n_valid is not None and self.packs else None
        if packed is not None and bool((n_valid == 0).any()):
            # a row with nothing to compute (a finished row kept in its slot): its padded query reads one key
            # instead of its whole context; what it writes at slot 0 of its own row is never read again (the slot
            # is overwritten whole when a newcomer takes it)
            pos = torch.where((n_valid == 0).to(pos.device)[:, None], torch.zeros_like(pos), pos)
        cos, sin = self.rotary(pos, self.dtype)
        x = self.embed_tokens(ids if packed is None else packed.gather(ids))
        at = Positions.of(pos)
        tapped = []
        want = set(taps)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, at, cache.layers[i], self.windows[i], packed)
            if i in want:
                tapped.append(x)
        if not speculative:
            cache.lengths += T if n_valid is None else n_valid.to(cache.lengths)
        tap = None
        if taps:
            order = {i: t for i, t in zip(sorted(want), tapped)}
            tap = torch.cat([order[i] for i in taps], dim=-1)
        hidden = self.norm(x)
        if packed is not None:
            hidden = packed.spread(hidden).view(B, T, -1)
            tap = None if tap is None else packed.spread(tap).view(B, T, -1)
        return TargetOutput(hidden, tap)
