"""The target-model contract the decoding loop relies on (``load_target`` lives in ``registry.py``).

Every reference target (``llama.py`` for Llama/Qwen3 dense, ``qwen3_5.py`` for the Qwen3.5 hybrid) is a
``Target``. The decoding loop only ever calls:

- ``new_cache(batch, capacity)`` -> ``ModelCache`` with ``lengths`` zero;
- ``forward(ids [B,T], cache, n_valid=None, speculative=False, taps=())`` -> ``TargetOutput``. Row b's tokens
  sit at positions ``cache.lengths[b] + t``. Without ``speculative`` the first ``n_valid[b]`` tokens
  (default all T) are committed: ``lengths += n_valid`` and recurrent state advances over exactly those.
  With ``speculative`` nothing is committed yet; ``commit(cache, n)`` then keeps the first ``n[b]`` tokens
  (KV: a length change; GDN: ReplaySSM from the pre-verify checkpoint);
- ``logits(hidden)`` -> float32 logits; ``embed(ids)``; ``head_weight`` (the lm_head, shared with the draft).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspine.models.cache import ModelCache
from dspine.models.checkpoint import ModelLoadError, check_shapes, checkpoint_shapes
from dspine.models.layers import skip_init


def head_matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [M, H] @ weight[V, H].T -> [M, V], computed as (weight @ x.T).T, with one row padded to two.

    Used for the target head and for the draft's head over its vocabulary. Why: for a large head (49k x 576)
    and a few rows, MKL's x @ W.T path is pathological on some CPUs (AMD EPYC, 2 threads: 18 ms for 2 rows,
    26 ms for 3, vs 2.7 / 4.2 ms for W @ x.T), and one row goes to a single-threaded GEMV (7.2 ms) where two
    rows through the GEMM take 2.7 ms. Each output row is the same dot
    products either way; only the kernel (and so the fp32 rounding) differs. ``scripts/bench/bench_step.py``.
    """
    if x.shape[0] == 1 and x.device.type == "cpu":
        return (weight @ x.repeat(2, 1).T)[:, :1].T  # a stride-0 expand is slow here: copy the row
    return (weight @ x.T).T


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B, T, H] after the final norm (feed to ``logits``)
    taps: torch.Tensor | None  # [B, T, n_taps * H]: outputs of the requested layers, concatenated


class Target(nn.Module):
    """Base class: shared helpers; subclasses implement ``forward``/``new_cache``/``commit``."""

    config: dict
    embed_tokens: nn.Embedding
    lm_head: nn.Linear | None
    num_layers: int
    hidden_size: int
    vocab_size: int

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def max_position(self) -> int:
        return int(self.config.get("max_position_embeddings") or 1 << 30)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # One contiguous 2-D GEMM: a strided 3-D input (e.g. block slots 1..) falls back to a slow batched
        # matmul on CPU (measured 176 ms vs 56 ms for a draft block at batch 8).
        flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        head = getattr(self, "infer_head", None)  # a submodule set by ``quantize``/``use_kernels`` (no class
        # default: it would shadow the registered module)
        if head is not None and torch.is_grad_enabled() and flat.requires_grad:
            # a draft being trained backpropagates through these logits; the packed/quantized heads have no
            # autograd formula (torch would warn and drop the gradient), the float head has one
            head = None
        out = head(flat.to(self.dtype)) if head is not None else head_matmul(self.head_weight, flat)
        return out.float().view(*hidden.shape[:-1], -1)

    def quantize(self, mode: str) -> Target:
        """Weight-only quantization of every linear of the decoder and of the head used by ``logits``.

        The float ``head_weight`` (= the embeddings when tied) stays for ``embed`` and for the draft, which
        scores its own proposals with it; only the target's logits, which decide acceptance, use the quantized
        head, so plain and speculative decoding sample from the same (quantized) distribution.
        """
        from dspine.cpu.quant import quantize_linears, quantized_linear

        if mode == "none":
            return self
        quantize_linears(self.layers, mode)
        # int4 keeps an int8 head, like the 4-bit GGUFs (Q4_1 layers, Q8_0 token embedding/head): the head's
        # errors land directly on the logits
        self.infer_head = quantized_linear(self.head_weight, "int8" if mode == "int4" else mode)
        if self.lm_head is not None:  # untied: logits no longer need the float copy, but the draft does
            self.lm_head.requires_grad_(False)
        return self

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype unless ``set_kv_dtype`` chose another (the bf16 policy
        stores bf16 keys and values over fp32 weights)."""
        return getattr(self, "_kv_dtype", None) or self.dtype

    def fused_attention(self) -> bool:
        """Whether attention runs through our fused ops (``kernels.rope_store`` / ``attend_cache``), which read
        and write float32 or bfloat16 caches; torch's attention reads the cache in the model's dtype only."""
        return False

    def set_kv_dtype(self, dtype: torch.dtype) -> Target:
        """Store keys and values in ``dtype`` (float32 or bfloat16) where attention is ours (``fused_attention``).

        Why: under the bf16 policy the KV cache is most of a long batch's memory; bf16 halves it (and the bytes
        attention streams), while rotation, scores, softmax and the weighted sum stay fp32 in registers. It
        changes outputs, so the kernel name says so (``-kvbf16``; ``-kvbf16dp`` where attention over it runs on
        bf16 dot products, ``kernels.bf16_attention``), and caches built before the change are not this target's
        any more (the prefix cache keys its layout on the dtype)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"KV cache dtype {dtype}: choose torch.float32 or torch.bfloat16")
        if dtype == self.kv_dtype:
            return self
        if not self.fused_attention():
            raise ValueError(f"a {dtype} KV cache needs our fused attention (a dense target with CPU kernels); "
                             f"this target's attention is torch's ({self.kernel})")
        self._kv_dtype = None if dtype == self.dtype else dtype
        base = self.kernel.removesuffix("-kvbf16dp").removesuffix("-kvbf16")
        if dtype == torch.bfloat16 and self.dtype != torch.bfloat16:
            from dspine.cpu import kernels

            # attention over it on bf16 dot products where the CPU has them (other bits: another name)
            dims = {m.head_dim for m in self.modules() if hasattr(m, "fast") and hasattr(m, "head_dim")}
            dp = bool(dims) and all(kernels.bf16_attention(d) for d in dims)
            base += "-kvbf16dp" if dp else "-kvbf16"
        self._kernel = base
        return self

    @property
    def kernel(self) -> str:
        """What computes this target's linears: ``dspine-<isa>`` (``use_kernels``), ``dspine-<isa>-bf16`` (the bf16
        family), ``dspine-<isa>-q8`` / ``-q16`` (the integer ones), ``torch``, or a quant mode; ``-kvbf16`` when keys
        and values are stored in bf16 over fp32 weights (``-kvbf16dp``: and attention runs on bf16 dot products)."""
        return getattr(self, "_kernel", "torch")

    @property
    def invariance_gaps(self) -> tuple[str, ...]:
        """Why a row's outputs on this target may depend on the other rows of its batch or on how its prompt was
        split (empty: batch invariant). The features that need invariance (the prefix cache, chunked prefill) turn
        off where this is not empty, and the run log names each gap. Base rule: our CPU kernels (``dspine-*``) are
        invariant and torch's GEMMs are not; a family adds its own pieces (``families.DenseSpec.gaps``)."""
        if self.kernel.startswith("dspine-"):
            return ()
        return (f"its linears run on {self.kernel}, whose blocking (and so rounding) follows the batch's shape",)

    def use_kernels(self, formats: tuple[str, ...] | None = None, cache_key: str | None = None,
                    trust_cache: bool = True) -> Target:
        """Inference only: every fp32 decoder linear and the head through ``dspine.cpu.kernels`` (decode-shaped
        GEMMs that stream each weight once per forward and are batch invariant). A no-op off the CPU, for other
        dtypes, after ``quantize``, or where the kernels cannot be built (then torch's linears stay). Weights
        that are exactly GGUF Q4_1/Q8_0 blocks are stored as such (``formats``: which to try; outputs are the
        fp32 weights' either way, see ``kernels.PackedLinear``). With ``cache_key`` (a digest of the checkpoint)
        the packed weights are kept on disk (``kernels.pack_cache_path``) and reused by the next load, which
        then skips recognising and packing them.

        One copy of each weight, the packed one: on a cache hit the float linears are never read (loaded from a
        memory map, ``checkpoint.load_state(mmap=True)``, their pages never enter memory; they are dropped to
        shapes before the fusion), so no fp32 master copy exists at any point; a cache entry that does not
        match raises ``StalePackCache`` (``load_target`` then reloads and repacks, ``trust_cache=False``). On a
        miss the layers are fused and packed one at a time, each float weight freed once packed."""
        from dspine.cpu.kernels import PackedLinear, load, load_packed, pack_linears, save_packed
        from dspine.models.layers import fuse_norms

        if self.dtype != torch.float32 or self.device.type != "cpu" or hasattr(self, "infer_head"):
            return self
        isa = load()
        if isa is None:
            return self
        fused = any(getattr(m, "qkv_proj", None) is not None for m in self.modules())
        cached = pack_entry(cache_key, formats)
        if cached is not None and trust_cache and not fused and cached.is_file():
            _linears_to_meta(self.layers)
            for lin in self._outside_linears().values():
                _linears_to_meta(lin)
            self.fuse_projections()  # shapes only: the cache holds the fused linears
            with skip_init():
                self.infer_head = torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False, device="meta")
            if not load_packed(self, cached) or any(t.is_meta for t in self.parameters()):
                raise StalePackCache(f"{cached}: does not match this checkpoint's linears")
        elif fused:  # fused before (``load_target(fuse=True)``): the old way, whole
            if cached is not None:  # a shape-only stand-in for the head, so the cache can name and check it
                self.infer_head = torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False, device="meta")
            if cached is None or not trust_cache or not load_packed(self, cached):
                pack_linears(self.layers, formats)
                self._pack_outside(formats)
                self.infer_head = PackedLinear(self.head_weight, formats=formats)
                if cached is not None:
                    save_packed(self, cached)
        else:
            for layer in self.layers:  # one layer's float weights (and fused copies) alive at a time
                for m in layer.modules():
                    if callable(fuse := getattr(m, "fuse", None)):
                        fuse()
                pack_linears(layer, formats)
            self._pack_outside(formats)
            self.infer_head = PackedLinear(self.head_weight, formats=formats)  # a packed copy; the float one
            # stays for embed and the draft
            if cached is not None:
                save_packed(self, cached)
        fuse_norms(self)
        for m in self.modules():
            if hasattr(m, "fast"):
                m.fast = True
        for m in self.modules():  # whole layers in one native call where a block can (``llama.Block.plan_fused``)
            if callable(plan := getattr(m, "plan_fused", None)):
                plan()
        if self.lm_head is not None:
            self.lm_head.requires_grad_(False)
        from dspine.cpu.kernels import BF16DP, INT_FORMATS, bf16_isa, weight_formats

        # the bf16 family rounds (weights and linear inputs to bf16): it is a precision policy, so it is named (its
        # block formats compute the same bits as its bf16 panels, so they share the name); so are the integer ones
        # (inputs quantised to int8 parts; weights on no GGUF grid fall back to the bf16 family or fp32)
        bf16 = bool(formats) and all(f.startswith(BF16DP) for f in formats)
        integer = next((name for name, fmts in INT_FORMATS.items() if formats and formats[0] in fmts), None)
        if any(f.startswith(BF16DP) for f in weight_formats(self)):  # the bf16 family on AMX tiles or on AVX512-BF16
            isa = bf16_isa()  # (other bits, so another name)
        self._kernel = f"dspine-{isa}-{integer or 'bf16'}" if integer or bf16 else f"dspine-{isa}"
        return self

    OUTSIDE_LINEARS: tuple[str, ...] = ()  # linears of the target itself, outside ``layers``, packed with them

    def _outside_linears(self) -> dict[str, nn.Linear]:
        """``OUTSIDE_LINEARS`` that are float32 CPU linears still (not packed yet), by name."""
        return {n: m for n in self.OUTSIDE_LINEARS if isinstance(m := getattr(self, n, None), nn.Linear)
                and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"}

    def _pack_outside(self, formats: tuple[str, ...] | None) -> None:
        """``OUTSIDE_LINEARS`` packed like the layers' (so saved in, and read from, the same cache entry): on torch's
        GEMM their rounding would follow the batch's shape."""
        from dspine.cpu.kernels import PackedLinear

        for name, lin in self._outside_linears().items():
            setattr(self, name, PackedLinear(lin.weight, lin.bias, formats))

    def fuse_projections(self) -> Target:
        """Inference only: merge the projections that read the same input (q/k/v, gate/up, GDN inputs) into one
        GEMM each. On CPU a small model's decode step is dominated by per-call overhead, so fewer, wider GEMMs
        are faster; the parameters are renamed, so fuse after loading a checkpoint, never before."""
        for module in [m for m in self.modules() if m is not self]:
            fuse = getattr(module, "fuse", None)
            if callable(fuse):
                fuse()
        return self

    def new_cache(self, batch: int, capacity: int) -> ModelCache:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(  # pragma: no cover - abstract
        self,
        ids: torch.Tensor,
        cache: ModelCache,
        n_valid: torch.Tensor | None = None,
        speculative: bool = False,
        taps: tuple[int, ...] = (),
    ) -> TargetOutput:
        raise NotImplementedError

    @property
    def packs(self) -> bool:
        """Whether ``forward`` with ``n_valid`` computes only the valid tokens (a ragged verify costs its real
        tokens; rows with ``n_valid`` 0 cost nothing), bit-identical per token to the padded forward."""
        return False

    def commit(self, cache: ModelCache, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` tokens of the pending speculative forward (default: KV-only models)."""
        cache.lengths += n.to(cache.lengths)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [B, T, V] (fp32) with a fresh cache; no padding."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        return self.logits(self.forward(input_ids, cache).hidden)

    def checkpoint_name(self, name: str) -> str | None:
        """The module name a checkpoint tensor loads into; None: a tensor this target does not use."""
        return name

    @classmethod
    def empty(cls, cfg: dict, dtype: torch.dtype, device, path: Path, required: tuple[str, ...] = ()):
        """Build the module uninitialised for loading the checkpoint in ``path``, after checking the checkpoint
        holds the shapes ``cfg`` asks for (``check_checkpoint``): a config is only a claim about its weights."""
        for key in required:
            if key not in cfg:
                raise ModelLoadError(f"{path / 'config.json'}: missing {key!r}")
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"{path / 'config.json'}: {key} must be a positive integer, got {value!r}")
        model = cls.check_checkpoint(cfg, path)
        # allocated where it runs, uninitialised: nothing is touched before the checkpoint (mapped or copied)
        # replaces it
        _materialize(model, device, dtype)
        for m in model.modules():  # the RoPE tables (one per distinct spec)
            if hasattr(m, "spec") and callable(getattr(m, "reset", None)):
                m.reset(device=device)
        return model

    @classmethod
    def check_checkpoint(cls, cfg: dict, path: Path) -> Target:
        """The module ``cfg`` builds, on the meta device (``shaped``), once every tensor's shape in ``path``'s
        safetensors headers is checked against it: a config claiming sizes its weights do not have (a hand-edited
        ``config.json``, a damaged GGUF's metadata: ``intermediate_size`` 2**36 asked for 17.6 TB) fails before
        anything is allocated, in one ``ModelLoadError`` naming the file and the tensor. A layer count beyond the
        tensors the checkpoint holds fails before any module is built (each layer has at least one)."""
        stored = checkpoint_shapes(path)
        layers = cfg.get("num_hidden_layers")
        if isinstance(layers, int) and layers > len(stored):
            raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers is {layers}, but the checkpoint holds "
                                 f"{len(stored)} tensors")
        shaped = cls.shaped(cfg)
        check_shapes({n: t.shape for n, t in shaped.state_dict().items()}, stored, path, shaped.checkpoint_name)
        return shaped

    @classmethod
    def shaped(cls, cfg: dict) -> Target:
        """The module ``cfg`` builds, on the meta device: its parameters' names and shapes, and no memory. Nothing
        computes there (``Rotary`` leaves its tables to ``reset``): arithmetic on meta tensors goes through torch's
        reference ops, whose first call imports torch._dynamo (1-2 s and ~150 MB at start-up)."""
        with torch.device("meta"), skip_init():
            return cls(cfg)

    def default_tap_ids(self, n: int = 5) -> list[int]:
        return default_tap_ids(self.num_layers, n)


def pack_entry(cache_key: str | None, formats: tuple[str, ...] | None) -> Path | None:
    """The packed-weights cache entry of a checkpoint (``cache_key``) packed in ``formats``; None without a key."""
    if cache_key is None:
        return None
    from dspine.cpu.kernels import pack_cache_path

    return pack_cache_path(f"{cache_key}-{','.join(formats or ('default',))}")


class StalePackCache(ValueError):
    """A packed-weights cache entry that does not match the checkpoint it is keyed on (``Target.use_kernels``)."""


def _linears_to_meta(module: nn.Module) -> None:
    """Every float32 CPU ``nn.Linear`` under ``module``: its weight (and bias) replaced by a shape-only meta tensor,
    so fusing them reads nothing (their packed form comes from the cache)."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            m.weight = nn.Parameter(torch.empty(m.weight.shape, device="meta"), requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(torch.empty(m.bias.shape, device="meta"), requires_grad=False)


def _materialize(module: nn.Module, device, dtype: torch.dtype) -> None:
    """Every meta parameter and buffer of ``module`` allocated on ``device``, uninitialised, the floating ones in
    ``dtype`` (``to_empty(device).to(dtype)``, sharing kept), by ``torch.empty``: ``to_empty``'s ``empty_like`` from
    the meta device goes through torch's reference ops, ~2 ms a tensor (~0.5 s for SmolLM2's 272)."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                    made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                store[name] = made[id(t)]


def default_tap_ids(num_layers: int, n: int) -> list[int]:
    """DFlash default taps: ``round(1 + i*(L-4)/(n-1))`` (half-to-even), ``[L//2]`` for one tap."""
    if n == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) < n or min(ids) < 0:
        # tiny targets (L < n + 3): the formula repeats layers; fall back to distinct, evenly spaced
        # inner layers (never the last one, whose HF hidden state is post-norm)
        inner = max(1, num_layers - 1)
        ids = sorted({min(inner - 1, round(i * (inner - 1) / max(1, n - 1))) for i in range(n)})
    return ids
