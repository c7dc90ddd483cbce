"""SGLang on a CPU: the bridges that let the real ``sglang.Engine`` run DSPINE on a machine without a GPU.

This is a **test/dev path** (docs/design.md, "The SGLang plugin"): it exists so that CI proves the GPU
product's control flow (scheduler, DFlash-family worker, DSPINE draft model, verify, commit, ``meta_info``,
the batch pipeline) on CPU machines; only the CUDA kernels are left for a GPU. ``apply()`` is called by the
plugin's ``register()``, which SGLang runs in every one of its processes, and does nothing when a CUDA device
is visible (unless ``SGLANG_USE_CPU_ENGINE=1`` asks for the CPU engine explicitly).

What it bridges, and why (SGLang 0.5.23):

* ``SGLANG_USE_CPU_ENGINE=1``: SGLang's ``is_cpu()`` is true only with it (without it, CPU layers go looking
  for vllm). Spawned children inherit it.
* ``sgl_kernel``: the package index only has the CUDA build, whose import fails without a driver; SGLang's CPU
  mode imports four small ops from it. ``stand_in/`` provides them (torch, ``cpu_kernels``) and goes on
  ``sys.path``/``PYTHONPATH`` only when the real package cannot import.
* ``torch_native`` attention for TARGET_VERIFY batches: its ``forward_extend`` reads ``extend_prefix_lens`` /
  ``extend_seq_lens``, which a verify batch lacks (there ``seq_lens`` is the committed prefix); the verify
  block is run as an extend of the block's tokens on that prefix.
* draft attention backend: ``torch_native`` is added to SGLang's draft-backend choices (else the draft
  silently falls back to flashinfer).
* ``Tensor.record_stream`` (called by the DFlash V2 worker on ``seq_lens``) is a no-op for CPU tensors.
* top-k in the DFlash candidate path uses flashinfer whenever it imports: torch top-k for CPU tensors.
* sampled verify: SGLang's chain-acceptance kernel is Triton (no CPU driver): a torch version
  (``cpu_kernels.chain_speculative_sampling``) for CPU tensors.
* Qwen3.5 hybrid targets: the model and its Gated DeltaNet backend bind about ten CPU ops at import time
  (``torch.ops.sgl_kernel.*_cpu``, ``sgl_kernel.mamba``), which the stand-in registers; the GDN output norm
  and the ReplaySSM ring (verify, cursor advance, fold, conv-state rollback) are Triton kernels, replaced by
  their torch versions for CPU tensors (``cpu_kernels``, "GDN ReplaySSM ring").
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
STAND_IN_DIR = str(Path(__file__).with_name("stand_in"))
CPU_ATTENTION_BACKEND = "torch_native"
# The engine keyword arguments the CPU path needs (under the job's own): SGLang's CPU device, the attention
# backend that runs there, no CUDA graphs, float32 (SGLang's "auto" picks a half-precision KV cache on CPU), and
# a KV pool sized for tests (by default SGLang sizes it from free host memory: tens of GB). The overlap scheduler
# stays on, as on a GPU (``OVERLAP_ENV``, ``engine_kwargs``).
CPU_ENGINE_KWARGS = {"device": "cpu", "attention_backend": CPU_ATTENTION_BACKEND,
                     "speculative_draft_attention_backend": CPU_ATTENTION_BACKEND, "disable_cuda_graph": True,
                     "dtype": "float32", "max_total_tokens": 65536, "max_running_requests": 8}
# SGLang 0.5.23 turns its overlap scheduler off for speculative decoding on the CPU by policy only
# (arg_groups/speculative_hook.py, _disable_overlap_schedule_for_cpu: "not implemented"; it is not applied to
# plugin algorithms); the loop itself runs on the CPU (a CPU "stream" is the host's own order). So the CPU path
# runs it, where ``output_ids`` lags a round as on a GPU. DSPINE_SGLANG_OVERLAP=0 runs the plain loop instead
# (CI runs the plugin's end-to-end tests both ways).
OVERLAP_ENV = "DSPINE_SGLANG_OVERLAP"
_applied = False


def overlap(env: dict[str, str] | None = None) -> bool:
    """Whether the CPU path runs SGLang's overlap scheduler (the default, as on a GPU)."""
    return (os.environ if env is None else env).get(OVERLAP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def engine_kwargs(env: dict[str, str] | None = None) -> dict:
    """``CPU_ENGINE_KWARGS`` with the scheduler loop (``overlap``)."""
    return {**CPU_ENGINE_KWARGS, "disable_overlap_schedule": not overlap(env)}


def cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def wanted(env: dict[str, str] | None = None) -> bool:
    """True when SGLang in this process runs on the CPU: the CPU engine was asked for, or there is no GPU."""
    env = os.environ if env is None else env
    if env.get(CPU_ENGINE_ENV) == "1":
        return True
    return not cuda_visible()


def apply() -> bool:
    """Install the CPU bridges in this process if SGLang runs on the CPU here; True if they are in place."""
    global _applied
    if _applied:
        return True
    if not wanted():
        return False
    _set_cpu_engine_env()
    _provide_sgl_kernel()
    _register_hooks()
    _applied = True
    logger.info("dspine: SGLang CPU bridges applied (test/dev path)")
    return True


def _set_cpu_engine_env() -> None:
    os.environ[CPU_ENGINE_ENV] = "1"
    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None and hasattr(common.is_cpu, "cache_clear"):
        common.is_cpu.cache_clear()


def real_sgl_kernel_imports() -> bool:
    if STAND_IN_DIR in sys.path:
        return not getattr(sys.modules.get("sgl_kernel"), "STAND_IN", False)
    try:
        importlib.import_module("sgl_kernel")
    except Exception:  # ImportError / OSError: libcuda.so.1 missing on a CPU-only machine
        sys.modules.pop("sgl_kernel", None)
        return False
    return True


def _provide_sgl_kernel() -> None:
    """Put the stand-in first on the path of this process and of the processes it spawns."""
    if real_sgl_kernel_imports():
        return
    if STAND_IN_DIR not in sys.path:
        sys.path.insert(0, STAND_IN_DIR)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if STAND_IN_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([STAND_IN_DIR, *paths])
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]
    importlib.import_module("sgl_kernel")  # the stand-in: registers its torch.ops.sgl_kernel ops in this process


# -- hooks (SGLang's supported monkeypatch seam: HookRegistry, applied by load_plugins) ---------------------------


def verify_as_extend(original):
    """torch_native ``forward_extend`` that runs a TARGET_VERIFY batch as an extend of the block on the prefix."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify() or forward_batch.extend_seq_lens is not None:
            return original(self, q, k, v, layer, forward_batch, save_kv_cache)
        import torch

        bs = forward_batch.seq_lens.shape[0]
        per_req = q.shape[0] // bs
        fb = copy.copy(forward_batch)
        fb.extend_prefix_lens = forward_batch.seq_lens
        fb.extend_seq_lens = torch.full_like(forward_batch.seq_lens, per_req)
        fb.seq_lens = forward_batch.seq_lens + per_req
        return original(self, q, k, v, layer, fb, save_kv_cache)

    forward_extend._dspine_cpu = True
    return forward_extend


def torch_topk_off_cuda(original):
    """flashinfer's top-k on CUDA tensors only; torch's elsewhere."""

    def radix_topk(scores, k):
        if scores.is_cuda:
            return original(scores, k)
        return scores.topk(k, dim=-1)

    radix_topk._dspine_cpu = True
    return radix_topk


def record_stream_off_cuda(original):
    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream._dspine_cpu = True
    return record_stream


def torch_chain_sampling_off_cuda(original):
    """SGLang's Triton chain-acceptance kernel on CUDA tensors only; the torch version elsewhere."""
    from .cpu_kernels import chain_speculative_sampling

    def chain_speculative_sampling_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                          retrive_next_token, retrive_next_sibling, uniform_samples,
                                          uniform_samples_for_final_sampling, target_probs, draft_probs,
                                          threshold_single, threshold_acc, deterministic, *,
                                          block_verification: bool = False):
        if candidates.is_cuda:
            return original(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                            retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                            draft_probs, threshold_single, threshold_acc, deterministic,
                            block_verification=block_verification)
        if block_verification:
            raise NotImplementedError("block verification has no CPU implementation")
        return chain_speculative_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                          uniform_samples, uniform_samples_for_final_sampling, target_probs,
                                          draft_probs)

    chain_speculative_sampling_triton._dspine_cpu = True
    return chain_speculative_sampling_triton


def _first_tensor(args, kwargs):
    import torch

    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def torch_off_cuda(torch_version):
    """A patch maker: the wrapped Triton function on CUDA tensors, ``torch_version`` (same arguments) otherwise
    (decided by the first tensor argument)."""

    def make(original):
        def dispatch(*args, **kwargs):
            t = _first_tensor(args, kwargs)
            if t is not None and t.is_cuda:
                return original(*args, **kwargs)
            return torch_version(*args, **kwargs)

        dispatch.__name__ = getattr(original, "__name__", torch_version.__name__)
        dispatch.__doc__ = torch_version.__doc__
        dispatch._dspine_cpu = True
        return dispatch

    return make


def gated_rmsnorm_off_cuda(original):
    """``fla.layernorm_gated.RMSNorm.forward`` (a Triton kernel unless the CPU has AMX) in torch for CPU tensors:
    the GDN output norm, ``weight * rmsnorm(x) * silu(z)`` (``cpu_kernels.fused_rmsnorm_gated_cpu``)."""
    from .cpu_kernels import fused_rmsnorm_gated_cpu

    def forward(self, x, z=None):
        if x.is_cuda:
            return original(self, x, z)
        if not (self.norm_before_gate and self.group_size is None and self.activation == "swish"):
            raise NotImplementedError("gated RMSNorm on the CPU: norm before a swish gate, no groups, only")
        return fused_rmsnorm_gated_cpu(x, self.weight, z, self.eps)

    forward._dspine_cpu = True
    return forward


def _kernel(name: str):
    from . import cpu_kernels

    return torch_off_cuda(getattr(cpu_kernels, name))


def wrap(owner, name: str, make) -> None:
    """owner.name = make(owner.name), once."""
    current = getattr(owner, name)
    if not getattr(current, "_dspine_cpu", False):
        setattr(owner, name, make(current))


RING = "sglang.kernels.ops.attention.linear.gdn_replayssm_spec_decode"
# (module, attribute path, wrapper): applied right after the module's import, in the processes that import it.
PATCHES = (
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend.forward_extend", verify_as_extend),
    ("sglang.srt.models.dflash", "_radix_topk", torch_topk_off_cuda),
    # patched in its defining module right after its import, i.e. before any ``from ... import`` of it runs
    ("sglang.kernels.ops.speculative.reject_sampling", "chain_speculative_sampling_triton",
     torch_chain_sampling_off_cuda),
    # Qwen3.5 hybrid: the GDN output norm and the ReplaySSM ring kernels
    ("sglang.kernels.ops.attention.fla.layernorm_gated", "RMSNorm.forward", gated_rmsnorm_off_cuda),
    *((RING, name, lambda original, name=name: _kernel(name)(original))
      for name in ("gdn_replayssm_spec_decode", "commit_gdn_replayssm_spec", "commit_gdn_replayssm_circular")),
    ("sglang.kernels.ops.mamba.mamba_state_scatter_triton", "fused_conv_window_scatter_with_mask",
     lambda original: _kernel("fused_conv_window_scatter_with_mask")(original)),
)


def _patch(attr_path: str, make):
    def callback(module):
        *owners, name = attr_path.split(".")
        owner = module
        for o in owners:
            owner = getattr(owner, o)
        wrap(owner, name, make)

    return callback


def _register_hooks() -> None:
    import torch
    from sglang.srt.arg_groups import choices

    from .after_import import after_import

    if CPU_ATTENTION_BACKEND not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices([CPU_ATTENTION_BACKEND])
    wrap(torch.Tensor, "record_stream", record_stream_off_cuda)
    for module, attr_path, make in PATCHES:
        after_import(module, _patch(attr_path, make))
