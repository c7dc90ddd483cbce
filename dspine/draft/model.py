"""The DSpine draft model: causal DFlash backbone + adjacent injection, one forward for inference and training.

One readable file in the gpt-fast style (see ``llama.py``): explicit KV cache, per-row positions, shapes in
comments. See ``docs/design.md``, "The DSpine draft". Ideas and published facts from DFlash, DSpine and
SpecForge; no code copied. Its neighbours: ``draft_config.py`` (the ``config.json``), ``proposal.py`` (the
transition cache and the sampled path), ``draft_io.py`` (init, load, save).

How a decoding round uses it (the decoding loop owns the target and both caches):

1. ``extend_context(cache, taps, n_valid)``: new committed positions' target taps become context K/V rows,
   ``ctx = hidden_norm(fc(taps))`` projected by each layer's own ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE).
   Context never passes attention or MLP; it is only ever read as keys and values.
2. ``propose(cache, anchor, target, temperature, generators)``: the block ``[anchor, MASK x (bs-1)]`` at
   positions ``start..start+bs-1`` (``start = cache.lengths[b]``) runs through the layers with causal
   in-block attention and adjacent injection after every layer (``backbone``), the target head gives
   backbone logits, and ``proposal.py`` turns them into tokens.

The block's own K/V are written into the cache at positions ``>= lengths`` (the "garbage beyond lengths"
region of ``layers.py``): they are masked by position for everyone else and overwritten by the next
``extend_context``, so nothing of the block survives the call in any visible way.

Training (``train_forward``) runs the same ``forward`` over every block of a sequence at once: the context
K/V of the whole sequence are computed once per layer and each block sees its part through
``block_causal_mask``. Only where the keys come from differs (``CachedKeys`` or ``SequenceKeys``).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from dspine.draft import proposal
from dspine.draft.config import parse_draft_config
from dspine.draft.proposal import BlockOutput
from dspine.models.cache import KVCache, ModelCache
from dspine.models.checkpoint import ModelLoadError
from dspine.models.layers import RMSNorm, RopeSpec, Rotary, SwiGLU, apply_rope, attend, position_mask
from dspine.models.llama import Attention
from dspine.models.target import Target, head_matmul

INIT_STD = 0.02  # HF ``initializer_range`` default for Qwen3/Llama


# ----------------------------------------------------------------------------------------------------------
# where a layer's keys come from


class BlockKeys(Protocol):
    """Where a layer's attention keys come from: the one thing inference and training do differently."""

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's own k, v [N, H_kv, bs, D] -> (keys, values, mask) the block's queries attend to."""
        ...


@dataclass
class CachedKeys:
    """Inference: context rows live in the layer's KV cache; the block is written beyond ``lengths`` and read back.

    Keys at positions <= q_pos (context < start, block slots <= own) and > q_pos - window. Keys no query can
    see under the window are sliced off first so long contexts cost O(window), not O(length).
    """

    cache: KVCache
    pos: torch.Tensor  # [B, bs] block positions
    window: int | None
    span: tuple[int, int]  # (min position, max position + 1) over the batch

    def keys_values(self, k, v):
        self.cache.write(self.pos, k, v)  # beyond lengths: invisible to later calls, overwritten by them
        lo = 0 if self.window is None else max(0, self.span[0] - self.window + 1)
        keys, values = self.cache.k[:, :, lo : self.span[1]], self.cache.v[:, :, lo : self.span[1]]
        return keys, values, position_mask(self.pos - lo, self.span[1] - lo, self.window)  # mask [B, 1, bs, S]


@dataclass
class SequenceKeys:
    """Training: one sequence's context K/V, shared by all its blocks, then each block's own, under ``mask``."""

    ctx_k: torch.Tensor  # [1, H_kv, T, D] (normed and rotated)
    ctx_v: torch.Tensor  # [1, H_kv, T, D]
    mask: torch.Tensor  # bool [N, 1, bs, T + bs] (``block_causal_mask``)

    def keys_values(self, k, v):
        N = k.shape[0]
        keys = torch.cat([self.ctx_k.expand(N, -1, -1, -1), k], dim=2)  # [N, Hkv, T + bs, D]
        values = torch.cat([self.ctx_v.expand(N, -1, -1, -1), v], dim=2)
        return keys, values, self.mask


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

    def forward(self, x, cos, sin, keys: BlockKeys):
        # x [N, bs, H] (normed blocks), cos/sin of the block positions -> [N, bs, H]
        N, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, T, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(N, T, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(N, T, self.n_kv, self.head_dim)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [N, Hq, bs, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [N, Hkv, bs, D]
        all_k, all_v, mask = keys.keys_values(k, v.transpose(1, 2))
        o = attend(q, all_k, all_v, mask, self.head_dim**-0.5)
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

    def forward(self, x, cos, sin, keys: BlockKeys):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keys)
        return x + self.mlp(self.post_attention_layernorm(x))


class Injection(nn.Module):
    """Adjacent injection : slot i receives a gated message about its predecessor after every layer.

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

    # The block-level steps below are the one implementation of the injection math: the reference draft and
    # the SGLang draft model (dspine/sglang) both call them.

    def code(self, codes: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A token's predecessor message input sqrt(r) * code(id): ids [...] -> [..., r]."""
        return self.scale * codes[ids]

    @staticmethod
    def predecessors(f: torch.Tensor, anchor_pred: torch.Tensor, offset: int) -> torch.Tensor:
        """p(i) = f(i-d) if i-d >= 1 else the anchor's code, for slots 1..bs-1: f [N, bs, r] -> [N, bs-1, r]."""
        src = torch.arange(1, f.shape[1], device=f.device) - offset  # [bs-1] predecessor slot
        return torch.where((src >= 1)[None, :, None], f[:, src.clamp(min=0)], anchor_pred[:, None, :])

    def inject(self, layer: int, x: torch.Tensor, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s injection into slots 1..bs-1 of x [N, bs, H] (slot 0, the anchor, is kept)."""
        return torch.cat([x[:, :1], self.write(layer, x[:, 1:], f[:, 1:], p)], dim=1)

    def refine(self, norm: Callable[[torch.Tensor], torch.Tensor], last_layer: int, pre: torch.Tensor,
               f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Last-write refinement: the last layer's write redone with predecessor input p, then the final norm."""
        return norm(self.write(last_layer, pre, f, p))


class ConfidenceHead(nn.Module):
    """c = sigmoid(w . [h~ ; code(a)] + b) (after DSpark): will slot i's proposal survive verification?

    ``h~`` is the refined last-layer state of slot i given its chosen predecessor a **after the final norm**
    (the vector that is scored against the LM head) and ``code(a)`` the unit transfer code of a (no sqrt(r)).
    Both depend only on the prefix up to a, so stopping on c is a stopping time.
    """

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(self, refined: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        # refined [..., H], code [..., r] -> [...] float32 in (0, 1)
        return torch.sigmoid(self.proj(torch.cat([refined, code.to(refined.dtype)], dim=-1)).float()).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------
# the model


class DSpineDraft(nn.Module):
    """DSpine draft: DFlash's context-as-K/V backbone with a causal block and adjacent injection.

    Owns no embedding and no LM head: the block is embedded with ``target.embed`` and scored with
    ``target.head_weight``. ``transfer_codes [V, r]`` and ``transfer_ready`` are buffers saved with the
    weights (never recomputed at load, see ``transfer.py``).
    """

    def __init__(self, cfg: dict, confidence_head: bool | None = None, where: str = "config.json"):
        super().__init__()
        spec = parse_draft_config(cfg, where)
        self.config = cfg
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
        # logits are computed over these rows of the target head only (see ``head``).
        self.draft_vocab: torch.Tensor | None
        if spec.draft_vocab_size is not None:
            self.register_buffer("draft_vocab", torch.arange(spec.draft_vocab_size))
        else:
            self.draft_vocab = None
        self._head_rows: tuple[tuple, torch.Tensor, nn.Module | None] | None = None
        self._kernels = False  # ``use_kernels`` ran: inference only
        self.released = False  # ``release`` ran: weights freed (retired), load again to propose
        self.rotary = Rotary(RopeSpec.from_config(cfg, spec.head_dim))

    # -- basics ----------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def use_kernels(self, cache_key: str | None = None) -> DSpineDraft:
        """Inference only: the fp32 linears and the draft-vocabulary head through ``dspine.cpu.kernels`` (see
        ``Target.use_kernels``); a no-op off the CPU, for other dtypes or where the kernels cannot be built. A
        draft so packed can no longer be trained or saved. With ``cache_key`` (``registry.checkpoint_key`` of the
        draft's directory) the packed linears are kept on disk and the next load reads them instead of
        recognising each weight's format again (what a cached entry lacks is packed here)."""
        from dspine.cpu.kernels import load, load_packed, pack_cache_path, pack_linears, save_packed
        from dspine.models.layers import fuse_norms

        if self._kernels or self.dtype != torch.float32 or self.device.type != "cpu" or load() is None:
            return self
        for layer in self.layers:  # gate/up as one streamed weight and the fused SiLU gate
            layer.mlp.fuse()
            layer.mlp.fast = True
        cached = None if cache_key is None else pack_cache_path(f"draft-{cache_key}")
        if cached is None or not cached.is_file() or not load_packed(self, cached):
            pack_linears(self)
            if cached is not None:
                save_packed(self, cached)
        pack_linears(self)  # none left after a complete cache entry
        fuse_norms(self)
        self._kernels = True
        self._head_rows = None
        return self

    def release(self) -> None:
        """Free the weights of a draft retired for the rest of its stream (``rounds.retire_draft``): every
        parameter and buffer becomes a shape-only meta tensor and the gathered head rows go; the config and sizes
        stay for the stream's bookkeeping. A released draft cannot propose again (``released``: an engine that
        needs it for a later stream loads it again)."""
        for m in self.modules():
            for name, t in list(m._parameters.items()):
                if t is not None:
                    m._parameters[name] = nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"),
                                                       requires_grad=False)
            for name, t in list(m._buffers.items()):
                if t is not None:
                    m._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        self._head_rows = None
        self.released = True

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
            rows = w.detach().index_select(0, self.draft_vocab.to(w.device))
            packed = None
            if self._kernels:
                from dspine.cpu.kernels import PackedLinear

                packed = PackedLinear(rows)
            self._head_rows = (key, rows, packed)
        return self._head_rows[1]

    def head_logits(self, hidden: torch.Tensor, target: Target) -> torch.Tensor:
        """Backbone logits over the draft vocabulary: hidden [..., H] -> [..., V'] float32 (one 2-D GEMM)."""
        if self.draft_vocab is None:
            return target.logits(hidden.to(target.dtype))
        w = self.head(target)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(w.dtype).contiguous()
        packed = self._head_rows[2]
        out = packed(flat) if packed is not None and flat.dtype == torch.float32 else head_matmul(w, flat)
        return out.float().view(*hidden.shape[:-1], -1)

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

    # -- the block forward -------------------------------------------------------------------------------------

    def _predecessors(self, layer: int, f: torch.Tensor, anchor_pred: torch.Tensor) -> torch.Tensor:
        """p_l(i) = f_l(i-d) if i-d >= 1 else sqrt(r)*code(anchor), for slots 1..bs-1: f [N, bs, r] -> [N, bs-1, r]."""
        return self.injection.predecessors(f, anchor_pred, self.injection_offsets[layer])

    def forward(
        self,
        block_tokens: torch.Tensor,
        pos: torch.Tensor,
        target: Target,
        layer_keys: Callable[[int], BlockKeys],
        *,
        inject: bool = True,
        replace: torch.Tensor | None = None,
        replaced: torch.Tensor | None = None,
        replace_layers: int = 0,
        post_feats: bool = False,
    ) -> BlockOutput:
        """The blocks ``block_tokens`` [N, bs] at positions ``pos`` [N, bs] through every layer and injection.

        ``layer_keys(i)`` says where layer i's keys come from (``CachedKeys`` / ``SequenceKeys``): the only
        difference between inference and training. ``inject=False`` gives the plain causal DFlash backbone.
        Blocks with ``replace[n]`` use ``replaced`` [N, bs-1, r] as predecessor features in layers
        < ``replace_layers`` (teacher forcing); ``post_feats`` keeps every layer's post-injection features.
        """
        self._check_ready()
        cos, sin = self.rotary(pos, self.dtype)
        x = target.embed(block_tokens).to(self.dtype)  # [N, bs, H]
        anchor_pred = self.injection.code(self.transfer_codes, block_tokens[:, 0])  # [N, r]
        post = [] if post_feats else None
        pre = feat = x
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, layer_keys(i))
            pre, feat = x, self.injection.features(i, x)  # [N, bs, H], [N, bs, r]
            if inject:
                p = self._predecessors(i, feat, anchor_pred)  # [N, bs-1, r]
                if replaced is not None and i < replace_layers:
                    p = torch.where(replace[:, None, None], replaced, p)
                x = self.injection.inject(i, x, feat, p)  # slot 0 kept
            if post is not None:
                post.append(self.injection.features(i, x))
        return BlockOutput(self.norm(x), pre, feat, block_tokens[:, 0], post_feats=post)

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
        """One pass over the block ``[anchor, MASK x (bs-1)]`` at positions ``lengths[b] + 0..bs-1``, with logits.

        ``block_tokens [B, bs]`` replaces the block's inputs (tests perturb later slots with it; slot 0 is the
        anchor); ``inject=False`` gives the plain causal DFlash backbone.
        """
        self._check_target(target)
        bs = self.block_size if block_size is None else block_size
        if block_tokens is None:
            block_tokens = torch.full((anchor.shape[0], bs), self.mask_token_id, dtype=torch.long, device=self.device)
            block_tokens[:, 0] = anchor
        bs = block_tokens.shape[1]
        if bs < 2:
            raise ValueError(f"block_size {bs} < 2 proposes nothing")
        pos = cache.lengths[:, None] + torch.arange(bs, device=cache.lengths.device)  # [B, bs]
        span = (int(cache.lengths.min()), int(cache.lengths.max()) + bs)

        def layer_keys(i: int) -> BlockKeys:
            return CachedKeys(cache.layers[i], pos, self.windows[i], span)

        out = self(block_tokens, pos, target, layer_keys, inject=inject)
        out.logits = self.head_logits(out.hidden[:, 1:], target)  # [B, bs-1, V'] over the draft vocabulary
        return out

    def train_forward(
        self,
        taps: torch.Tensor,
        anchors: torch.Tensor,
        block_tokens: torch.Tensor,
        target: Target,
        replace: torch.Tensor | None = None,
        true_tokens: torch.Tensor | None = None,
        replace_layers: int = 0,
    ) -> BlockOutput:
        """All blocks of one sequence in one pass, with gradients (``forward`` with ``SequenceKeys``).

        taps [T, n*H] are the target tap outputs of the whole sequence (row j = position j); anchors [N]
        the block start positions; block_tokens [N, bs] the inputs (``[x_a, MASK...]``). Context K/V are
        computed once per layer for all T rows and masked per block by ``block_causal_mask``, which gives
        the same slot logits as ``extend_context`` of rows < a followed by ``backbone`` (tested).

        Teacher-forced predecessor replacement: blocks with ``replace[n]`` get, in layers < ``replace_layers``,
        sqrt(r)*code(true previous token) (``true_tokens`` [N, bs] = x_a..x_{a+bs-1}) instead of the predicted
        predecessor features, so early training is not stuck on garbage messages. Returns ``post_feats``.
        """
        T = taps.shape[0]
        bs = block_tokens.shape[1]
        pos = anchors[:, None] + torch.arange(bs, device=anchors.device)  # [N, bs]
        ccos, csin = self.rotary(torch.arange(T, device=anchors.device)[None], self.dtype)
        ctx = self.hidden_norm(self.fc(taps.to(self.dtype)))[None]  # [1, T, H]

        def layer_keys(i: int) -> BlockKeys:
            ck, cv = self.layers[i].self_attn.context_kv(ctx, ccos, csin)  # [1, Hkv, T, D]
            return SequenceKeys(ck, cv, block_causal_mask(anchors, T, bs, self.windows[i]))

        replaced = None
        if replace is not None and replace_layers > 0:
            replaced = self.injection.code(self.transfer_codes, true_tokens[:, :-1])  # [N, bs-1, r]
        return self(block_tokens, pos, target, layer_keys, replace=replace, replaced=replaced,
                    replace_layers=replace_layers, post_feats=True)  # fmt: skip

    # -- last-write refinement ---------------------------------------------------------------------------------

    def _refine(self, pre: torch.Tensor, feat: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """Re-apply the last layer's write with predecessor code(pred), then the final norm.

        pre [..., 1 or k, H], feat [..., 1 or k, r], pred [..., k] LongTensor -> [..., k, H]
        """
        p = self.injection.code(self.transfer_codes, pred)  # [..., k, r]
        return self.injection.refine(self.norm, len(self.layers) - 1, pre, feat, p)

    def refine_slots(self, out: BlockOutput, pred: torch.Tensor) -> torch.Tensor:
        """Refined, normed last-layer states of slots 1..bs-1 given predecessors (with gradients when enabled).

        pred [N, bs-1] -> [N, bs-1, H] (training passes the *true* previous tokens), or pred [N, bs-1, k] ->
        [N, bs-1, k, H] (the transition cache: every candidate predecessor).
        """
        if pred.ndim == 2:
            return self._refine(out.last_pre[:, 1:, None], out.last_feat[:, 1:, None], pred[..., None])[:, :, 0]
        return self._refine(out.last_pre[:, 1:, None], out.last_feat[:, 1:, None], pred)

    @torch.no_grad()
    def confidence(self, refined: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """c = sigmoid(w . [h~ ; code(pred)] + b): refined [..., H], pred [...] -> [...] float32."""
        if self.confidence_head is None:
            raise RuntimeError("this DSpine draft has no confidence head")
        return self.confidence_head(refined, self.transfer_codes[pred])

    # -- proposal (sampling in ``proposal.py``) and checkpoint (``draft_io.py``) -------------------------------

    def transition(self, out: BlockOutput, target: Target) -> proposal.Transition:
        """The transition cache of one backbone pass (``proposal.transition``)."""
        return proposal.transition(self, out, target)

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
    ) -> proposal.Proposal:
        """Draft bs-1 tokens after ``anchor`` for every row: backbone, transition cache, ``proposal.sample_path``.

        Greedy rows (temperature 0) take the argmax, sampled rows draw one ``torch.rand(bs-1)`` from their own
        generator. ``dynamic_threshold`` (used only when ``confidence_enabled``) stops at the first
        c_i < threshold: ``n_draft = i - 1``; c_i depends only on x_{<i}, so the cut is a stopping time.
        """
        bs = self.block_size if block_size is None else block_size
        if not 2 <= bs <= self.block_size:
            raise ValueError(f"block_size {bs} out of range 2..{self.block_size}")
        tr = proposal.transition(self, self.backbone(cache, anchor, target, bs), target)
        rows = torch.arange(tr.cand.shape[0], device=tr.cand.device)

        def slot_scores(i: int, prev: torch.Tensor):
            conf = None if tr.confidence is None else tr.confidence[rows, i, prev]
            return tr.scores[rows, i, prev], conf

        return proposal.sample_path(tr.cand, slot_scores, temperature, generators, dynamic_threshold, self.vocab_size)

    def save(self, path: str | Path) -> None:
        """Write the checkpoint: ``config.json`` (+ ``dtype``, ``use_confidence_head``, ``confidence_trained`` as
        they are now) and one ``model.safetensors`` (``dspine.draft.io.load_draft`` reads it back)."""
        if self._kernels:
            raise RuntimeError("this draft's linears were packed for inference (use_kernels): it cannot be saved")
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
