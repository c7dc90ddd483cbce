"""The DSPINE speculative algorithm for SGLang 0.5.23: ``DSpineAlgo(CustomSpecAlgo)``, argument validation and
defaults, and the worker factory. Imports SGLang; import it only where SGLang is installed.

Why each predicate (docs/design.md, "The SGLang plugin"): ``is_dflash_family`` turns on target aux-hidden capture, the
draft KV pool in the target's slot space and the DFlash request checks; ``supports_target_verify_for_draft``
lets the draft run in TARGET_VERIFY mode (the causal block forward). ``is_dflash`` stays False (it gates
only DFLASH-specific unified-memory/HiCache paths). ``supports_ragged_verify`` is False (DSPARK only).

0.5.23's plugin conformance check covers only ``is_*``/``supports_*``; the scheduler also calls
``create_future_map``, ``carries_draft_hidden_states`` and ``need_topk`` on the algorithm object, which the
base ``CustomSpecAlgo`` lacks, so they are defined here (as the enum answers them for DFLASH).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from . import ALGORITHM_NAME
from .config import DSpineConfigError, check_target, read_draft, resolve_block_size

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 48  # as SGLang's DFLASH default


class DSpineAlgo(CustomSpecAlgo):
    def __repr__(self) -> str:
        return f"DSpineAlgo({self.name!r})"

    # -- family predicates (see module docstring) -------------------------------------------------------------
    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        return True

    def supports_ragged_verify(self) -> bool:
        return False

    def has_draft_kv(self) -> bool:
        return True

    # -- enum methods the base CustomSpecAlgo lacks in 0.5.23 -------------------------------------------------
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def get_platform_worker_cls(self):
        from sglang.srt.platforms import current_platform

        if not current_platform.is_out_of_tree():
            return None
        return current_platform.get_speculative_worker_cls(algorithm=self.name)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        from sglang.srt.speculative.dflash_disaggregation import build_dflash_disagg_draft_input

        return build_dflash_disagg_draft_input(batch, last_tokens_tensor, future_map)

    # -- server args ------------------------------------------------------------------------------------------
    def handle_server_args(self, server_args: Any) -> None:
        """Defaults (runs on SGLang's recording stand-in: plain writes are declared resolutions)."""
        sa = server_args
        draft = read_draft(sa.speculative_draft_model_path, check_weights=False)
        sa.speculative_num_steps = 1
        sa.speculative_eagle_topk = 1
        sa.speculative_num_draft_tokens = resolve_block_size(sa.speculative_num_draft_tokens,
                                                             sa.speculative_dflash_block_size, draft)
        backend = sa.speculative_draft_attention_backend or sa.attention_backend
        if sa.speculative_draft_attention_backend is None and backend is not None:
            # as DFlash's _resolve_dflash_draft_attention_backend: the draft follows the target's backend
            # (validate_server_args refuses one the draft cannot use instead of SGLang's silent fallback)
            sa.speculative_draft_attention_backend = backend
        if sa.max_running_requests is None:
            sa.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
            logger.warning("DSPINE: --max-running-requests unset; using %d", DEFAULT_MAX_RUNNING_REQUESTS)


def validate_server_args(sa: Any) -> None:
    """Everything that can be wrong with a DSPINE launch, checked before any model is loaded.

    The device is not checked here (so CPU tests can resolve ``ServerArgs(device="cpu")``); the worker
    refuses to start without CUDA.
    """
    draft = read_draft(sa.speculative_draft_model_path)
    resolve_block_size(sa.speculative_num_draft_tokens, sa.speculative_dflash_block_size, draft)
    check_target(sa.model_path, draft)
    for flag, value in (("--speculative-num-steps", sa.speculative_num_steps),
                        ("--speculative-eagle-topk", sa.speculative_eagle_topk)):
        if value is not None and int(value) != 1:
            raise DSpineConfigError(f"{flag} {value}: DSPINE verifies one linear chain (leave it unset or 1)")
    if int(sa.pp_size) != 1:
        raise DSpineConfigError(f"--pp-size {sa.pp_size}: DSPINE supports pp_size 1 only (as DFLASH)")
    if int(sa.tp_size) != 1 or bool(sa.enable_dp_attention) or int(sa.dp_size) != 1:
        raise DSpineConfigError(
            f"DSPINE phase 1 runs on one GPU per replica (got tp_size={sa.tp_size}, dp_size={sa.dp_size}, "
            f"enable_dp_attention={sa.enable_dp_attention}): the transition cache reads full lm_head rows of "
            "the top-k candidates. Run one replica per GPU (dspine-batch shards) instead.")
    for flag, value in (("--speculative-accept-threshold-single", sa.speculative_accept_threshold_single),
                        ("--speculative-accept-threshold-acc", sa.speculative_accept_threshold_acc)):
        if value is not None and float(value) != 1.0:
            raise DSpineConfigError(f"{flag} {value}: below 1.0 relaxes acceptance (lossy); DSPINE is lossless only")
    if sa.speculative_adaptive:
        raise DSpineConfigError("--speculative-adaptive is not supported with DSPINE")
    check_draft_attention_backend(sa.speculative_draft_attention_backend or sa.attention_backend)
    unsupported = (("--speculative-use-block-verification", sa.speculative_use_block_verification),
                   ("--enable-lora / --lora-paths", sa.enable_lora or sa.lora_paths))
    for flag, value in unsupported:
        if value:
            raise DSpineConfigError(f"{flag}: not supported with DSPINE (never checked; run without it)")
    ragged = os.environ.get("SGLANG_RAGGED_VERIFY_MODE", "static").strip().lower() or "static"
    if ragged != "static":
        raise DSpineConfigError(f"SGLANG_RAGGED_VERIFY_MODE={ragged}: DSPINE verifies a fixed-width block "
                                "(unset it or set it to 'static')")
    window = sa.speculative_draft_window_size
    B = resolve_block_size(sa.speculative_num_draft_tokens, sa.speculative_dflash_block_size, draft)
    if window is not None and int(window) < B:
        raise DSpineConfigError(f"--speculative-draft-window-size {window} must be >= the block width {B}")


def check_draft_attention_backend(backend: str | None) -> None:
    """Refuse a draft attention backend SGLang's DFlash-family draft cannot use (SGLang would silently fall back
    to flashinfer); None is resolved with the target's backend at start-up."""
    if backend is None:
        return
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

    if backend not in DRAFT_ATTENTION_BACKEND_CHOICES:
        raise DSpineConfigError(
            f"draft attention backend {backend!r} (from --speculative-draft-attention-backend or "
            f"--attention-backend) is not one the DSPINE draft can use: {', '.join(DRAFT_ATTENTION_BACKEND_CHOICES)}; "
            "set --speculative-draft-attention-backend")


def worker_factory(server_args: Any):
    from .worker import DSpineWorkerV2

    return DSpineWorkerV2


def register_algorithm() -> bool:
    """Register DSPINE with SGLang's speculative registry; True if this call registered it (idempotent)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM_NAME) is not None:
        return False
    try:
        SpeculativeAlgorithm.register(ALGORITHM_NAME, supports_overlap=True,
                                      validate_server_args=validate_server_args,
                                      spec_class=DSpineAlgo)(worker_factory)
    except ValueError:  # raced with another registration in this process
        if get_spec(ALGORITHM_NAME) is None:
            raise
        return False
    return True
