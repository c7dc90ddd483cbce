"""Dense decoder-only targets: Llama (SmolLM2 is one), Qwen3, and the families that are the Llama block with options
(Qwen2/2.5, Mistral, Gemma 3, SmolLM3, OLMo 2, Granite, Phi-3/Phi-4-mini: ``families.py`` reads each config as a
``DenseSpec``).

One readable file in the gpt-fast style: explicit KV cache, per-row positions, shapes in comments. Where a family
differs it is one option of the block, named where it acts (``spec.norms``, ``spec.qk_norm``, ...).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dspine.models.cache import KVCache, ModelCache
from dspine.models.checkpoint import ModelLoadError, in_config, load_state
from dspine.models.families import DenseSpec, read_spec
from dspine.models.layers import Packing, Positions, RMSNorm, Rotary, SwiGLU, apply_rope, attend, fuse_linears
from dspine.models.target import Target, TargetOutput


class Attention(nn.Module):
    """GQA attention. ``qk_norm`` (the draft's and Qwen3's per-head RMSNorm) or ``spec`` (a family's options:
    biases, QK-norm per head or over the projection, the score scale)."""

    def __init__(self, cfg: dict, qk_norm: bool = False, spec: DenseSpec | None = None):
        super().__init__()
        h = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or h // self.n_heads
        bias = bool(cfg.get("attention_bias", False))
        qkv_bias, o_bias = (bias, bias) if spec is None else (spec.qkv_bias, spec.o_bias)
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=o_bias)
        eps = cfg.get("rms_norm_eps", 1e-6)
        mode = ("head" if qk_norm else "") if spec is None else spec.qk_norm
        offset = 0.0 if spec is None else spec.norm_offset
        # "head": one norm per head vector (Qwen3, Gemma 3); "proj": over the whole q / k projection (OLMo 2)
        self.qk_norm_over = mode
        wide = mode == "proj"
        q_dim = self.n_heads * self.head_dim if wide else self.head_dim
        k_dim = self.n_kv * self.head_dim if wide else self.head_dim
        self.q_norm = RMSNorm(q_dim, eps, offset) if mode else None
        self.k_norm = RMSNorm(k_dim, eps, offset) if mode else None
        self.scale = self.head_dim**-0.5 if spec is None or spec.attn_scale is None else spec.attn_scale
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
        """``cos``/``sin`` None: a NoPE layer (SmolLM3), keys and queries are not rotated."""
        q, k, v = self.project(x)
        if self.qk_norm_over == "proj":  # OLMo 2: over all heads at once, before the split
            q, k = self.q_norm(q), self.k_norm(k)
        if packed is not None:  # x [N, H]: the valid tokens only (``Packing``)
            q, k, v = (packed.spread(y) for y in (q, k, v))
            B, T = packed.shape
        else:
            B, T, _ = x.shape
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fast:  # the same computation in two fused calls
            from dspine.cpu import kernels

            kv.ensure(at.upto)
            if cos is None:  # rotate nothing: zero rotary dims
                cos = sin = q.new_zeros(B, 1, T, 0)
            q = kernels.rope_store(q.contiguous(), k, v, cos[:, 0], sin[:, 0], kv.k, kv.v, at.pos)
            o = kernels.attend_cache(q, kv.k, kv.v, at.queries(packed), window, self.scale)
            return self.o_proj(o if packed is None else packed.gather(o))
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, Hq, T, D], [B, Hkv, T, D]
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(at.pos, k, v.transpose(1, 2), upto=at.upto, rows=at.rows)
        keys, values = kv.view(at.upto)
        o = attend(q, keys, values, at.mask(window), self.scale)
        o = o.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o if packed is None else packed.gather(o))


class Block(nn.Module):
    """One decoder layer. ``spec.norms``: "pre" (Llama: norm -> sublayer -> residual), "sandwich" (Gemma: norm ->
    sublayer -> norm -> residual, for attention and the MLP) or "post" (OLMo 2: sublayer -> norm -> residual). The
    norms keep their checkpoint names, which mean different things per layout (Llama's ``post_attention_layernorm``
    is the MLP's pre-norm; Gemma's and OLMo's is attention's post-norm)."""

    def __init__(self, cfg: dict, spec: DenseSpec):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        h = cfg["hidden_size"]

        def norm() -> RMSNorm:
            return RMSNorm(h, eps, spec.norm_offset)

        self.layout = spec.norms
        self.residual_scale = spec.residual_scale
        self.input_layernorm = norm() if spec.norms != "post" else None
        self.self_attn = Attention(cfg, spec=spec)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if spec.norms == "sandwich" else None
        self.post_feedforward_layernorm = norm() if spec.norms != "pre" else None
        self.mlp = SwiGLU(h, cfg["intermediate_size"], act=spec.act, bias=spec.mlp_bias)

    def plan_fused(self) -> bool:
        """Inference only, after ``Target.use_kernels``: run this layer as one call of ``csrc/layer.cpp`` (the same
        kernels in the same order: the same bits) where its linears and norms are ours and its gate SiLU or tanh-GELU:
        pre, sandwich or post norms, QK norms per head or over the projection, a residual scale (every family of this
        module); True when it will. ``self.fused = None`` turns it off again."""
        from dspine.cpu.kernels import FusedRMSNorm, PackedLinear

        a, m = self.self_attn, self.mlp
        lins = [getattr(a, "qkv_proj", None), a.o_proj, getattr(m, "gate_up", None), m.down_proj]
        # the attention's and the MLP's pre-norms (None: none), the post-norms, the QK norms
        pre = [self.input_layernorm, self.post_attention_layernorm if self.layout == "pre"
               else self.pre_feedforward_layernorm]
        post = [] if self.layout == "pre" else [self.post_attention_layernorm, self.post_feedforward_layernorm]
        qk = [a.q_norm, a.k_norm] if a.qk_norm_over else []
        norms = [n for n in pre if n is not None] + post + qk
        if (self.layout not in ("pre", "sandwich", "post") or a.qk_norm_over not in ("", "head", "proj")
                or not (a.fast and m.fast) or not all(isinstance(n, FusedRMSNorm) for n in norms)
                or len({(n.eps, n.offset) for n in norms}) != 1
                or not all(isinstance(x, PackedLinear) for x in lins)):
            self.fused = None
            return False
        none = torch.empty(0)
        specs = [x.op_spec() for x in lins]
        weights = [none if n is None else n.weight for n in pre]
        for x in lins:
            weights += [x.packed, none if x.bias is None else x.bias]
        weights += [n.weight for n in qk] or [none, none]
        weights += [n.weight for n in post] or [none, none]
        ints = [x.out_features for x in lins] + [p for _, p in specs] + [a.n_heads, a.n_kv, a.head_dim]
        self.fused = (weights, [n for n, _ in specs], ints, int(m.act != "silu"),
                      [norms[0].eps, norms[0].offset, float(a.scale), float(self.residual_scale)])
        return True

    fused: tuple | None = None

    def forward(self, x, cos, sin, at: Positions, kv, window, packed: Packing | None = None):
        if self.fused is not None and cos is not None and x.shape[0]:
            from dspine.cpu.kernels import bf16_attention

            weights, names, ints, gelu, floats = self.fused
            kv.ensure(at.upto)
            dp = int(kv.k.dtype == torch.bfloat16 and bf16_attention(ints[-1]))
            index = packed.index if packed is not None else _NO_INDEX
            return torch.ops.dspine_cpu.dense_layer(x, weights, names, [*ints, int(window or 0), gelu, dp], floats,
                                                    cos[:, 0], sin[:, 0], kv.k, kv.v, at.pos, at.queries(packed),
                                                    index)
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        a = self.self_attn(h, cos, sin, at, kv, window, packed)
        if self.layout != "pre":
            a = self.post_attention_layernorm(a)
        x = x + (a if self.residual_scale == 1.0 else a * self.residual_scale)
        if self.layout == "pre":
            h = self.post_attention_layernorm(x)
        else:
            h = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x)
        m = self.mlp(h)
        if self.post_feedforward_layernorm is not None:
            m = self.post_feedforward_layernorm(m)
        return x + (m if self.residual_scale == 1.0 else m * self.residual_scale)


_NO_INDEX = torch.empty(0, dtype=torch.long)  # dense_layer's "not packed"


class DenseTarget(Target):
    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        self.model_type = cfg.get("model_type", "llama")
        self.spec = spec = read_spec(cfg)
        self.family = spec.family
        self.hidden_size = cfg["hidden_size"]
        self.vocab_size = cfg["vocab_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, spec) for _ in range(self.num_layers))
        self.norm = RMSNorm(self.hidden_size, cfg.get("rms_norm_eps", 1e-6), spec.norm_offset)
        self.tied = bool(cfg.get("tie_word_embeddings", spec.family in ("gemma3",)))
        self.lm_head = None if self.tied else nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        # one RoPE table per distinct spec (Gemma 3: sliding and full layers differ), shared by the layers using it
        distinct = list(dict.fromkeys(r for r in spec.ropes if r is not None))
        self.rotaries = nn.ModuleList(Rotary(r) for r in distinct)
        self.rope_index = [None if r is None else distinct.index(r) for r in spec.ropes]
        self.rotary = self.rotaries[0] if distinct else None
        self.windows = list(spec.windows)
        if spec.fused_checkpoint:  # Phi-3 stores q/k/v and gate/up fused: build them fused, load them as such
            self.fuse_projections()

    @classmethod
    def from_pretrained(cls, path: Path, cfg: dict, dtype=torch.float32, device="cpu") -> DenseTarget:
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for key in required:
            if key not in cfg:
                raise ModelLoadError(f"{path / 'config.json'}: missing {key!r}")
        try:
            model = cls.empty(cfg, dtype, device, path, required)
        except ModelLoadError as e:
            raise in_config(e, path) from None
        load_state(model, path, rename=model.checkpoint_name, dtype=dtype, mmap=torch.device(device).type == "cpu")
        return model.eval()

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.tied:
            return None
        if self.spec.fused_checkpoint:
            name = name.replace(".mlp.gate_up_proj.", ".mlp.gate_up.")
        return name

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled where the family scales them (Gemma by sqrt(hidden) rounded to the model's
        dtype, Granite by ``embedding_multiplier``): the draft embeds its block through this too."""
        x = self.embed_tokens(ids)
        scale = self.spec.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Granite divides the logits by ``logits_scaling``; Gemma may soft-cap them (``c * tanh(z / c)``)."""
        out = super().logits(hidden)
        if self.spec.logits_divisor != 1.0:
            out = out / self.spec.logits_divisor
        cap = self.spec.final_softcap
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def describe(self) -> dict:
        """The family's options as ``dspine info`` prints them."""
        sp = self.spec
        ropes = ["none (NoPE)" if r is None else f"{r.rope_type} (theta {r.theta:g}, {r.rotary_dim} of "
                 f"{self.layers[0].self_attn.head_dim} dims)" for r in sp.ropes]
        return {
            "options": {k: v for k, v in {
                "qkv_bias": sp.qkv_bias, "o_bias": sp.o_bias, "mlp_bias": sp.mlp_bias, "qk_norm": sp.qk_norm or None,
                "norms": sp.norms, "norm_offset": sp.norm_offset or None, "activation": sp.act,
                "embed_scale": None if sp.embed_scale == 1.0 else sp.embed_scale,
                "residual_scale": None if sp.residual_scale == 1.0 else sp.residual_scale,
                "attn_scale": sp.attn_scale, "logits_divisor": None if sp.logits_divisor == 1.0 else sp.logits_divisor,
                "final_softcap": sp.final_softcap}.items() if v not in (None, False)},
            "layers_rope": ropes if len(set(ropes)) > 1 else ropes[0],
            "layers_window": self.windows if len(set(self.windows)) > 1 else self.windows[0],
        }

    @property
    def invariance_gaps(self) -> tuple[str, ...]:
        """What of this target is not batch invariant on our kernels (``Target.invariance_gaps``)."""
        return super().invariance_gaps + self.spec.gaps

    def fused_attention(self) -> bool:
        return all(layer.self_attn.fast for layer in self.layers)

    @property
    def packs(self) -> bool:
        return self.fused_attention()

    # every layer fused (``Block.plan_fused``) and rotated: the forward runs them all in one native call
    # (``csrc/layer.cpp``'s dense_stack: the bits of the per-layer calls, 10-35 us of interpreter a layer less)
    stacked = True
    _stack: tuple | None = None

    def _stack_args(self, cache: ModelCache) -> tuple | None:
        """dense_stack's per-layer arguments (weights, op names, ints, floats), flattened once per set of plans and
        KV dtype; None where a layer is not fused or not rotated (NoPE), so the forward loops over the layers."""
        plans = [getattr(layer, "fused", None) for layer in self.layers]
        if any(p is None for p in plans) or any(r is None for r in self.rope_index):
            return None
        from dspine.cpu.kernels import bf16_attention

        dtype = cache.layers[0].k.dtype
        st = self._stack
        if st is not None and st[0] == dtype and len(st[1]) == len(plans) and all(a is b for a, b in zip(st[1], plans)):
            return st[2]
        weights, names, ints, floats = [], [], [], []
        for plan, window in zip(plans, self.windows):
            w, n, i, gelu, f = plan
            weights += w
            names += n
            ints += [*i, int(window or 0), gelu, int(dtype == torch.bfloat16 and bf16_attention(i[-1]))]
            floats += f
        self._stack = (dtype, plans, (weights, names, ints, floats))
        return self._stack[2]

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
        # longrope's choice per position, as plain decoding makes it (``Rotary.needs_long``): a verify's positions
        # below the switch keep the short factors
        ends = cache.lengths + (T if n_valid is None else n_valid.to(cache.lengths))
        tables = [rot(pos, self.dtype, ends, cache.lengths == 0) for rot in self.rotaries]  # (cos, sin) per RoPE
        x = self.embed(ids if packed is None else packed.gather(ids))
        at = Positions.of(pos)
        tapped = []
        want = set(taps)
        if self.stacked and x.shape[0] and (args := self._stack_args(cache)) is not None:
            for kv in cache.layers:
                kv.ensure(at.upto)
            firsts = [(c[:, 0], s[:, 0]) for c, s in tables]
            per_layer = [firsts[r] for r in self.rope_index]
            outs = torch.ops.dspine_cpu.dense_stack(
                x, *args, [c for c, _ in per_layer], [s for _, s in per_layer], [kv.k for kv in cache.layers],
                [kv.v for kv in cache.layers], at.pos, at.queries(packed),
                packed.index if packed is not None else _NO_INDEX, sorted(want))
            x, tapped = outs[0], outs[1:]
        else:
            for i, layer in enumerate(self.layers):
                r = self.rope_index[i]
                cos, sin = (None, None) if r is None else tables[r]
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
