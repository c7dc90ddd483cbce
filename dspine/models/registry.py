"""Which Hugging Face architectures load as which reference target: ``load_target``.

The interface (``target.py``) knows no architecture; this module knows them all, so adding one is a new file
beside ``llama.py`` / ``qwen3_5.py`` plus one branch here, and no module imports back up into this one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from dspine.models.checkpoint import ModelLoadError, read_config
from dspine.models.families import FAMILIES, family_of
from dspine.models.gemma4 import Gemma4Target
from dspine.models.llama import DenseTarget
from dspine.models.qwen3_5 import Qwen35Target
from dspine.models.target import StalePackCache, Target, pack_entry


def load_target(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quant: str = "none",
    fuse: bool = False,
    kernels: bool = True,
    kv_dtype: torch.dtype | None = None,
) -> Target:
    """Load a Hugging Face model directory of a supported family (``families.FAMILIES``: Llama, Qwen3, Qwen2/2.5,
    Mistral, Gemma 3, SmolLM3, OLMo 2, Granite, Phi-3), Gemma 4's dense text decoder or the Qwen3.5 hybrid as a
    reference target.

    ``fuse`` merges projections that share an input (see ``Target.fuse_projections``): off by default, since on
    the 2-core AVX-512 EPYC it measured 0.76-0.96x on one-token steps and 0.88-1.42x on 8-token verifies
    (``scripts/bench/bench_step.py``, a loaded machine); ``quant`` ("none", "int8", "int4") makes the linears
    weight-only quantized (``dspine.cpu.quant``; CPU kernels). ``kernels`` (fp32 on CPU, no quant) runs the linears
    through ``dspine.cpu.kernels`` where they build (``Target.use_kernels``); the model is then inference-only.
    ``kv_dtype``: the KV cache's element type; None is the policy's (bf16 under the bf16 family of linears, else the
    model's dtype); another is honoured where attention is ours (``Target.set_kv_dtype``), else a ValueError.
    """
    path = Path(path)
    cfg = read_config(path)
    cls = _target_class(cfg, path)
    # dense targets only (and Gemma 4's): there every op around the linears is our fp32 kernels; the hybrid's GDN
    # and gated attention are torch modules, which keep their bf16 path
    bf16_tiles = cls in _OURS and kernels and quant == "none" and dtype == torch.bfloat16 and _bf16_tiles(device)
    q8 = quant in ("q8", "q16")
    if q8 and not (cls in _OURS and kernels and _q8_tiles(device)):
        raise ValueError(f"{path}: quant={quant} runs on our CPU kernels over a dense target or Gemma 4; "
                         f"use quant=none or int8 here")
    model = cls.from_pretrained(path, cfg, dtype=torch.float32 if bf16_tiles or q8 else dtype, device=device)
    if fuse:
        model.fuse_projections()
    model.quantize("none" if q8 else quant)
    if bf16_tiles or q8:
        from dspine.cpu import kernels as k

        # q8/q16: the GGUF-block weights on integer dot products, any other weight in the bf16 family where it runs
        formats = (*k.INT_FORMATS[quant], *(k.BF16_FORMATS if k.bf16dp_ok() else ())) if q8 else k.BF16_FORMATS
        model = _use_kernels(model, cls, path, cfg, device, formats)
        # the bf16 policy's KV cache is bf16 too (half the memory; attention still computes in fp32)
        model.set_kv_dtype(torch.bfloat16 if kv_dtype is None else kv_dtype)
    else:
        if kernels and quant == "none":
            model = _use_kernels(model, cls, path, cfg, device, None)
        if kv_dtype is not None:
            model.set_kv_dtype(kv_dtype)
    return model


_OURS = (DenseTarget, Gemma4Target)  # every op around the linears on our kernels: the bf16 / q8 / q16 policies run


def _use_kernels(model: Target, cls: type[Target], path: Path, cfg: dict, device, formats) -> Target:
    """``model.use_kernels`` with the packed cache; an entry that does not match the checkpoint (``StalePackCache``)
    costs a reload and a repack, which writes a good entry over it."""
    key = checkpoint_key(path)
    entry = pack_entry(key, formats)
    hit = entry is not None and entry.is_file()
    try:
        packed = model.use_kernels(formats=formats, cache_key=key)
    except StalePackCache:
        model = cls.from_pretrained(path, cfg, dtype=torch.float32, device=device)
        packed = model.use_kernels(formats=formats, cache_key=key, trust_cache=False)
    if not hit and entry is not None and entry.is_file() and packed.kernel.startswith("dspine-"):
        # packed here: every float linear was read, and those pages stay resident while the checkpoint's map lives
        # (the embeddings are views of it); loaded again from the entry just written, the old map goes with them
        del model, packed
        model = cls.from_pretrained(path, cfg, dtype=torch.float32, device=device)
        packed = model.use_kernels(formats=formats, cache_key=key)
    return packed


def auto_dtype(path: str | Path, quant: str = "none", device: str | torch.device = "cpu") -> str:
    """``dtype=auto``: "bfloat16" where this target would run our bf16 family of linears (a dense target on a CPU
    with AVX512-BF16, kernels on), else "float32". Why not bf16 wherever the CPU has it: elsewhere bf16 means
    torch's bf16 modules, which are neither faster than our fp32 kernels on small batches nor batch invariant
    (the prefix cache and chunked prefill then turn off). Weight-only quantization computes in bf16."""
    if quant != "none":
        return "bfloat16"
    path = Path(path)
    dense = _target_class(read_config(path), path) in _OURS
    return "bfloat16" if dense and _bf16_tiles(device) else "float32"


def _target_class(cfg: dict, path: Path) -> type[Target]:
    arch = (cfg.get("architectures") or [None])[0]
    model_type = cfg.get("model_type")
    if model_type in ("qwen3_5", "qwen3_5_text") or arch in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"):
        return Qwen35Target
    if model_type in ("gemma4_text", "gemma4") or arch in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):
        return Gemma4Target
    if family_of(cfg) is not None:
        return DenseTarget
    raise ModelLoadError(
        f"{path / 'config.json'}: unsupported architecture "
        f"(model_type={model_type!r}, architectures={cfg.get('architectures')!r}); "
        f"supported: {supported_families()}"
    )


def supported_families() -> str:
    """The families ``load_target`` reads, as one line (for refusals and ``dspine info``)."""
    return ", ".join([*(f"{f.title} [{'/'.join(f.model_types)}]" for f in FAMILIES),
                      "Gemma 4 text, dense [gemma4_text/gemma4]", "Qwen3.5 hybrid [qwen3_5/qwen3_5_text]"])


def _q8_tiles(device) -> bool:
    """quant=q8/q16 run wherever our kernels build on the CPU (``csrc/gemm_q8.cpp``: AVX512-VNNI, AVX2 or portable
    integer dot products, the same bits)."""
    if torch.device(device).type != "cpu":
        return False
    from dspine.cpu import kernels

    return not kernels.disabled() and kernels.load() is not None


def _bf16_tiles(device) -> bool:
    """bfloat16 on a CPU with AVX512-BF16 runs as our bf16 family of linears (``csrc/gemm_bf16.cpp``: bf16 weights
    and linear inputs, fp32 sums; GGUF blocks kept as blocks; a bf16 KV cache; norms, attention arithmetic and the
    residual stream fp32) instead of torch's bf16
    modules: ~2x the fp32 GEMM rate on prompts, and batch invariant, so the prefix cache stays exact. Elsewhere
    bf16 stays torch's (emulated bf16 is slower than our fp32 kernels; it is not a policy worth choosing there)."""
    if torch.device(device).type != "cpu":
        return False
    from dspine.cpu import kernels

    return not kernels.disabled() and kernels.load() is not None and kernels.bf16dp_ok()


PACK_CACHE_MIN_BYTES = 16 << 20  # smaller checkpoints pack in a blink: not worth a cache file each


def checkpoint_key(path: Path) -> str | None:
    """A digest of a checkpoint directory's files (names, sizes, modification times); None if unreadable or
    smaller than ``PACK_CACHE_MIN_BYTES``."""
    try:
        files = [(p, p.stat()) for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".json", ".bin")]
    except OSError:
        return None
    if sum(st.st_size for _, st in files) < PACK_CACHE_MIN_BYTES:
        return None
    parts = [f"{p.name}:{st.st_size}:{st.st_mtime_ns}" for p, st in files]
    return hashlib.sha256("|".join([str(path.resolve()), *parts]).encode()).hexdigest()[:20]
