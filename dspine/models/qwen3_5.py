"""Qwen3.5 hybrid target: Gated DeltaNet (``linear_attention``) layers interleaved with gated full attention.

One readable file in the gpt-fast style, like ``llama.py``. Differences from the dense Llama/Qwen3 block, all
checked against HF ``transformers`` (``models/qwen3_5/modeling_qwen3_5.py``):

- every RMSNorm of the decoder (input/post-attention norms, q_norm/k_norm, final norm) is the zero-centred
  ``x * (1 + w)`` variant; only the GDN output norm uses a plain weight (``gdn.gated_rmsnorm``);
- full attention is *gated*: ``q_proj`` emits, per head, ``[query (D) | gate (D)]``; the attention output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``; RoPE is partial (``partial_rotary_factor``, 0.25 in the
  released models; text positions make the multimodal rope sections coincide, so plain RoPE is exact);
- ``layer_types`` (or ``full_attention_interval``: every interval-th layer is full attention) picks the mixer.

Caches: attention layers hold a ``KVCache``; GDN layers an ``SSMState`` (conv window + fp32 recurrent state).
A speculative forward leaves the GDN state as it was and records per-token inputs; ``commit`` replays the
accepted prefix (``replay.py``, ReplaySSM).

Checkpoints: ``Qwen3_5ForCausalLM`` (``model_type`` qwen3_5_text, tensors ``model.*``) and the VLM
``Qwen3_5ForConditionalGeneration`` (``model_type`` qwen3_5: the text model sits under
``model.language_model.*`` with its config in ``text_config``; ``model.visual.*`` and the in-checkpoint MTP
head ``mtp.*`` are ignored).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspine.models import replay
from dspine.models.cache import KVCache, ModelCache, SSMState
from dspine.models.checkpoint import ModelLoadError, load_state
from dspine.models.gdn import causal_conv, delta_rule_scan, gated_rmsnorm, gates, prepare_qk, roll_window
from dspine.models.layers import Positions, RMSNorm, RopeSpec, Rotary, SwiGLU, apply_rope, attend, fuse_linears
from dspine.models.target import Target, TargetOutput

LINEAR, FULL = "linear_attention", "full_attention"


def text_config(cfg: dict) -> dict:
    """The decoder's config: top level for ``qwen3_5_text``; ``text_config`` for the ``qwen3_5`` VLM.

    For the VLM, top-level keys the text block lacks are kept, and ``tie_word_embeddings`` is the *top-level*
    value (default False) whatever ``text_config`` says: that is what HF's ConditionalGeneration model ties by.
    """
    if "text_config" not in cfg:
        return dict(cfg)
    text = dict(cfg["text_config"] or {})
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    return {**top, **text, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}


def layer_types(cfg: dict) -> list[str]:
    """``layer_types`` if given, else HF's rule: layer i is full attention iff (i+1) % interval == 0 (default 4)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        raise ModelLoadError(f"config.json: layer_types must be {n} entries of {LINEAR!r}/{FULL!r}, got {types!r}")
    return types


class GatedAttention(nn.Module):
    """GQA with per-head q/k zero-centred RMSNorm, partial RoPE and a sigmoid output gate."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or h // self.n_heads
        bias = bool(cfg.get("attention_bias", False))
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim * 2, bias=bias)  # per head: [query | gate]
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Inference only: q(+gate)/k/v as one projection."""
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv_width = self.n_kv * self.head_dim
        return self.qkv_proj(x).split([2 * self.n_heads * self.head_dim, kv_width, kv_width], dim=-1)

    def forward(self, x, cos, sin, at: Positions, kv: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q, gate = q.reshape(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, T, self.n_heads * self.head_dim)
        k = k.reshape(B, T, self.n_kv, self.head_dim)
        v = v.reshape(B, T, self.n_kv, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        kv.write(at.pos, k, v.transpose(1, 2), upto=at.upto, rows=at.rows)
        keys, values = kv.view(at.upto)
        o = attend(q, keys, values, at.mask(), self.head_dim**-0.5)  # [B, Hq, T, D]
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        return self.o_proj(o)


class ConvWeight(nn.Module):
    """Holds the depthwise conv kernel under HF's name ``conv1d.weight`` [C, 1, K]; the math is ``gdn.causal_conv``."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    """Holds the GDN output-norm weight (plain, init 1); the math is ``gdn.gated_rmsnorm``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rmsnorm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention mixer: fused qkv projection -> causal conv + SiLU -> gated delta rule -> gated norm."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.n_k = cfg["linear_num_key_heads"]
        self.n_v = cfg["linear_num_value_heads"]
        self.d_k = cfg["linear_key_head_dim"]
        self.d_v = cfg["linear_value_head_dim"]
        if self.n_v % self.n_k:
            raise ModelLoadError(
                f"config.json: linear_num_value_heads {self.n_v} is not a multiple of linear_num_key_heads {self.n_k}"
            )
        self.key_dim = self.n_k * self.d_k
        self.value_dim = self.n_v * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.get("linear_conv_kernel_dim", 4)
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(h, self.n_v, bias=False)
        self.conv1d = ConvWeight(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.d_v, cfg.get("rms_norm_eps", 1e-6))
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.in_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Inference only: the four input projections (qkv, z, b, a) as one GEMM."""
        self.in_proj = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv, z, b, a) input projections of x."""
        if self.in_proj is None:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return self.in_proj(x).split([self.conv_dim, self.value_dim, self.n_v, self.n_v], dim=-1)

    def empty_state(self, batch: int, dtype, device) -> SSMState:
        return SSMState(
            conv=torch.zeros(batch, self.conv_dim, self.kernel - 1, dtype=dtype, device=device),
            rec=torch.zeros(batch, self.n_v, self.d_k, self.d_v, dtype=torch.float32, device=device),
        )

    def forward(self, x: torch.Tensor, state: SSMState, n: torch.Tensor | None, speculative: bool) -> torch.Tensor:
        """x [B, T, h]. Non-speculative: commit the first ``n[b]`` tokens (None: all T) into ``state``.
        Speculative: leave ``state`` as the checkpoint and record the per-token inputs for ``replay.commit``."""
        B, T, _ = x.shape
        qkv, z, b, a = self.project(x)
        u = qkv.transpose(1, 2)  # [B, C, T] conv inputs
        z = z.reshape(B, T, self.n_v, self.d_v)
        g, beta = gates(a, b, self.A_log, self.dt_bias)  # [B, T, H_v] fp32
        y = F.silu(causal_conv(state.conv, u, self.conv1d.weight[:, 0])).transpose(1, 2)  # [B, T, C]
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = prepare_qk(q.view(B, T, self.n_k, self.d_k), k.view(B, T, self.n_k, self.d_k))  # fp32
        v = v.reshape(B, T, self.n_v, self.d_v).float()
        valid = None
        if n is not None and not speculative:
            valid = torch.arange(T, device=x.device)[None, :] < n[:, None]  # [B, T]
        rec, o = delta_rule_scan(state.rec, k, v, g, beta, q=q, valid=valid)  # o [B, T, H_v, D_v] fp32
        if speculative:
            replay.record(state, u, k, v, g, beta)
        else:
            state.rec = rec
            state.conv = roll_window(state.conv, u, torch.full((B,), T, device=x.device) if n is None else n)
        o = self.norm(o.to(x.dtype), z)  # per value head
        return self.out_proj(o.reshape(B, T, self.value_dim))


class Block(nn.Module):
    def __init__(self, cfg: dict, kind: str):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, offset=1.0)
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, offset=1.0)
        self.mlp = SwiGLU(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x, cos, sin, at: Positions, state: KVCache | SSMState, n, speculative: bool) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            x = x + self.linear_attn(h, state, n, speculative)
        else:
            x = x + self.self_attn(h, cos, sin, at, state)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35Target(Target):
    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg  # the text config (see ``text_config``)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported (only silu)")
        self.hidden_size = cfg["hidden_size"]
        self.vocab_size = cfg["vocab_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.layer_types = layer_types(cfg)
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, t) for t in self.layer_types)
        self.norm = RMSNorm(self.hidden_size, cfg.get("rms_norm_eps", 1e-6), offset=1.0)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        self.head_dim = cfg.get("head_dim") or self.hidden_size // cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        self.rotary = Rotary(RopeSpec.from_config(cfg, self.head_dim))

    @classmethod
    def from_pretrained(cls, path: Path, cfg: dict, dtype=torch.float32, device="cpu") -> Qwen35Target:
        path = Path(path)
        if cfg.get("model_type") == "qwen3_5" and not isinstance(cfg.get("text_config"), dict):
            raise ModelLoadError(f"{path / 'config.json'}: model_type 'qwen3_5' needs a 'text_config' block")
        text = text_config(cfg)
        required = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
        )
        model = cls.empty(text, dtype, device, path, required)
        load_state(model, path, rename=model.checkpoint_name, dtype=dtype, mmap=torch.device(device).type == "cpu")
        return model.eval()

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("mtp.", "model.visual.")):
            return None  # MTP head and vision tower: unused by a text-only target
        if name == "lm_head.weight":
            return None if self.tied else name
        for prefix in ("model.language_model.", "model."):
            if name.startswith(prefix):
                return name.removeprefix(prefix)
        return name

    def new_cache(self, batch: int, capacity: int) -> ModelCache:
        layers: list[KVCache | SSMState] = []
        for layer in self.layers:
            if layer.kind == LINEAR:
                layers.append(layer.linear_attn.empty_state(batch, self.dtype, self.device))
            else:
                layers.append(KVCache.empty(batch, self.n_kv, capacity, self.head_dim, self.dtype, self.device))
        return ModelCache(torch.zeros(batch, dtype=torch.long, device=self.device), layers)

    def forward(self, ids, cache, n_valid=None, speculative=False, taps=()):
        """See ``Target.forward``. ``n_valid`` is ignored when ``speculative`` (``commit`` decides).
        Outputs at positions ``>= n_valid[b]`` are meaningless (the GDN state is frozen there)."""
        B, T = ids.shape
        if any(isinstance(s, SSMState) and s.pending is not None for s in cache.layers):
            raise RuntimeError("a speculative forward is pending: call commit(cache, n) before the next forward")
        n = None if n_valid is None else n_valid.to(device=ids.device, dtype=torch.long)
        pos = cache.lengths[:, None] + torch.arange(T, device=ids.device)  # [B, T]
        cos, sin = self.rotary(pos, self.dtype)
        x = self.embed_tokens(ids)
        at = Positions.of(pos)
        tapped: dict[int, torch.Tensor] = {}
        want = set(taps)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, at, cache.layers[i], n, speculative)
            if i in want:
                tapped[i] = x
        if not speculative:
            cache.lengths += T if n is None else n
        tap = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return TargetOutput(self.norm(x), tap)

    def commit(self, cache: ModelCache, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` tokens of the pending speculative forward: KV by length, GDN by ReplaySSM."""
        n = n.to(cache.lengths)
        for state in cache.layers:
            if isinstance(state, SSMState):
                replay.commit(state, n)
        cache.lengths += n
