"""``DSpineWorkerV2``: SGLang 0.5.23's DFlash V2 worker, driven through its selector seam, plus the GDN commit.

Everything DFlash does per round is reused unchanged (docs/design.md, "The SGLang plugin"): prefill with FULL aux-hidden
capture and draft-KV materialisation, the draft block ``[bonus, MASK x (B-1)]`` in TARGET_VERIFY mode, the
target verify, greedy accept (exact match) or sampled accept, the overlap relay, CUDA graphs. The DSpine
proposal itself enters where DFlash runs a DFlash2 candidate selector: because ``DSpineDraftModel`` exposes
``candidate_selector``, the worker calls ``compute_candidates`` / ``build_lattice`` / ``sample_path`` (in the
draft CUDA graph via ``_SelectorDraftSampler``, or eagerly via ``_propose_selector_block``), i.e. top-k,
last-write refinement and the walk. Greedy rows are verified by exact match; sampled rows through
``_selector_sampling_accept`` with the q rows of the walk (DSpark's q-aware chain rejection): lossless.

Overrides:

* ``__init__``: refuses devices other than CUDA and the CPU test path, a hybrid target on the CPU without the GDN
  ReplaySSM ring (``cpu_hybrid_problem``), non-DSpine drafts and a block width above the draft's block (DFlash
  only warns), attaches the target LM head to the draft before any capture.
* ``_update_target_mamba_state_after_verify``: SGLang's DFLASH path commits through
  ``update_mamba_state_after_mtp_verify``, which handles only KDA ReplaySSM (hence its guard refusing
  ``--enable-linear-replayssm-spec`` for DFLASH on GDN targets). With a GDN ReplaySSM ring we commit through
  ``spec_utils.commit_mamba_states_after_verify`` as EAGLE does, with the linear-chain accept index and the
  step indices computed from the *pre-verify* lengths (``draft_math``).
* ``_propose_selector_block``: DFlash's eager proposal step, plus an optional proposal log for tests, plus the
  suffix proposals (``dspine.sglang.suffix``, on with ``DSPINE_PROPOSERS=auto|suffix``; ``auto``: greedy rows
  only): rows whose suffix match
  wins get the match written over their block's draft slots; for the sampled accept their q rows become a point
  mass on those tokens (accept with probability p(x), resample from the residual: still exact speculative
  sampling). The draft's tokens stay in slots past a shorter match (drawn from their own q rows: still exact).
  Eager path only: a captured draft CUDA graph samples in the graph and skips this step (suffix proposals are
  then off; the CPU test path and batches outside the captured sizes run eagerly).
* ``forward_batch_generation`` keeps the batch (its ``Req`` objects carry each row's text) for the proposal step;
  ``_accept_block`` reports each round's accepted drafts per row to the suffix proposer (its estimates and the
  per-source round log, ``DSPINE_SGLANG_ROUND_LOG``).
"""

from __future__ import annotations

import json
import logging
import os
import threading

import torch
from sglang.srt.layers.sampler import apply_custom_logit_processor
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.runtime_context import mamba_track_grid
from sglang.srt.speculative import dflash_worker_v2
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _resolve_dflash_embedding_module
from sglang.srt.speculative.dspark_components.dspark_draft import resolve_greedy_mask
from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify

from . import draft_math as dm
from .models.dspine_draft import DSpineDraftModel
from .processing import Histories, process_block, row_params
from .sampling import prompt_repetition
from .suffix import PROPOSERS_ENV, ROUND_LOG_ENV, SuffixProposer

logger = logging.getLogger(__name__)
# Test/debug aid: append every eagerly proposed block ({"anchor": [...], "tokens": [[...]]}, one JSON line per
# round) to this file, so tests can compare SGLang's proposals with the reference engine's round by round.
# Eager path only (a captured CUDA graph never calls it); costs a host sync per round when set.
PROPOSAL_LOG_ENV = "DSPINE_SGLANG_PROPOSAL_LOG"
_active = threading.local()  # the DSPINE worker running a forward in this thread (the verify hook's dispatch)


def install_verify_hook() -> None:
    """Route DFlash's verify-logits step (``apply_dflash_verify_logits_adjustments``, a module global of
    ``dflash_worker_v2`` called between the target verify and the grammar mask) to the running DSPINE worker's
    per-slot processing; other workers keep SGLang's. Idempotent."""
    current = dflash_worker_v2.apply_dflash_verify_logits_adjustments
    if getattr(current, "_dspine", False):
        return

    def adjust(*, next_token_logits, sampling_info, draft_token_num):
        worker = getattr(_active, "worker", None)
        if worker is None:
            return current(next_token_logits=next_token_logits, sampling_info=sampling_info,
                           draft_token_num=draft_token_num)
        return worker._adjust_verify_logits(next_token_logits, sampling_info, int(draft_token_num))

    adjust._dspine = True
    dflash_worker_v2.apply_dflash_verify_logits_adjustments = adjust


def record_proposals(path: str, anchor: torch.Tensor, tokens: torch.Tensor) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"anchor": anchor.view(-1).tolist(), "tokens": tokens.tolist()}) + "\n")


def gdn_replayssm_active(req_to_token_pool) -> bool:
    """True when the target's mamba pool keeps a GDN (not KDA) ReplaySSM spec ring."""
    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None or getattr(pool, "replayssm_is_kda", False):
        return False
    return bool(getattr(pool, "replayssm_spec_fold", False)) or getattr(pool, "replayssm_cache_base", None) is not None


def cpu_hybrid_problem(device: str, req_to_token_pool) -> str | None:
    """Why DSPINE cannot run this target on the CPU test path, or None: there a hybrid (Mamba-state) target
    verifies only through the GDN ReplaySSM ring; the recurrent verify's per-draft state snapshots and the KDA
    ReplaySSM are GPU kernels without CPU versions (``dspine.sglang.cpu_kernels``)."""
    if not str(device).startswith("cpu") or getattr(req_to_token_pool, "mamba_pool", None) is None:
        return None
    if gdn_replayssm_active(req_to_token_pool):
        return None
    return ("DSPINE on a hybrid (Gated DeltaNet) target on the CPU needs --enable-linear-replayssm-spec: the CPU "
            "path commits linear-attention state only through the GDN ReplaySSM ring")


class DSpineWorkerV2(DFlashWorkerV2):
    _batch = None  # the batch of the running forward (class defaults: DFlash's __init__ warms the proposal step)
    suffix: SuffixProposer | None = None
    histories: Histories | None = None
    _raw_logits = None  # this round's verify logits before processing (rows returning logprobs)
    _processed: list | None = None  # (batch row, Req) of this round's processed rows

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        device = str(getattr(target_worker, "device", "cuda"))
        if not device.startswith(("cuda", "cpu")):
            raise RuntimeError(f"DSPINE runs on CUDA (or the CPU test path), not on {device!r}")
        problem = cpu_hybrid_problem(device, target_worker.model_runner.req_to_token_pool)
        if problem:
            raise RuntimeError(problem)
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        if not isinstance(self.draft_model, DSpineDraftModel):
            raise RuntimeError(
                f"DSPINE needs a DSpineDraftModel draft, got {type(self.draft_model).__name__} (check the draft "
                "config's architectures and that the dspine plugin registered the model)")
        draft_block = int(self.draft_model.spec.block_size)
        if not 2 <= int(self.block_size) <= draft_block:
            raise RuntimeError(
                f"DSPINE block width {self.block_size} (--speculative-num-draft-tokens, anchor slot included) "
                f"must be in 2..{draft_block} (the draft's block_size)")
        lm_head = unwrap_lora_layer(getattr(self._target_worker.model_runner.model, "lm_head", None))
        if lm_head is None or getattr(lm_head, "weight", None) is None:
            raise RuntimeError("DSPINE needs the target's dense lm_head weight (quantized heads unsupported)")
        self.draft_model.lm_head = lm_head
        self.draft_model.target_embed = self._block_embedding()
        proposer = SuffixProposer(os.environ.get(PROPOSERS_ENV) or "dspine", int(self.block_size) - 1,
                                  log_path=os.environ.get(ROUND_LOG_ENV))
        self.suffix = proposer if proposer.active else None
        self.histories = Histories(4 * int(self.block_size))
        install_verify_hook()
        logger.info("DSPINE worker ready: block=%d (1 anchor + %d drafts), top_k=%d, rank=%d, proposers=%s",
                    int(self.block_size), int(self.block_size) - 1, self.selector.top_k,
                    self.draft_model.transfer_rank, proposer.mode)

    def _block_embedding(self):
        """ids -> the rows the worker feeds the draft block (the target's embedding, as DFlash embeds it)."""
        embed = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model,
                                                                   self._target_worker.model_runner.model))
        scale = float(self._noise_embed_scale)
        table = self._full_embed_gpu

        def block_embedding(ids):
            rows = torch.nn.functional.embedding(ids, table) if table is not None else embed(ids)
            return rows if scale == 1.0 else rows * scale

        return block_embedding

    def _propose_selector_block(self, *, draft_logits_output, bs, lm_head, anchor_token_ids, sampling_info):
        tokens = super()._propose_selector_block(draft_logits_output=draft_logits_output, bs=bs, lm_head=lm_head,
                                                 anchor_token_ids=anchor_token_ids, sampling_info=sampling_info)
        if PROPOSAL_LOG_ENV in os.environ:
            record_proposals(os.environ[PROPOSAL_LOG_ENV], anchor_token_ids, tokens)
        batch = self._batch
        if self.suffix is not None and batch is not None and len(batch.reqs) == bs:
            tokens = self._apply_suffix(batch.reqs, anchor_token_ids, tokens, sampling_info)
        return tokens

    def _apply_suffix(self, reqs, anchor_token_ids: torch.Tensor, tokens: torch.Tensor,
                      sampling_info) -> torch.Tensor:
        """Write each chosen suffix proposal over its row's draft slots (and a point mass over its q rows)."""
        bs = tokens.shape[0]
        if sampling_info is None or sampling_info.is_all_greedy:
            greedy = [True] * bs
        else:
            greedy = resolve_greedy_mask(bs=bs, sampling_info=sampling_info, device=tokens.device).tolist()
        picks = self.suffix.choose(list(reqs), anchor_token_ids.view(-1).tolist(), greedy)
        if not any(picks):
            return tokens
        tokens = tokens.clone()
        sample = self._selector_sample
        if sample is not None:
            cand, q = sample[0].clone(), sample[1].clone()
        for b, pick in enumerate(picks):
            if not pick:
                continue
            ids = torch.tensor(pick, dtype=tokens.dtype, device=tokens.device)
            n = len(pick)
            tokens[b, :n] = ids
            if sample is not None:  # every candidate slot names the token, with q 1: a point mass (no ties)
                cand[b, :n] = ids.to(cand.dtype)[:, None]
                q[b, :n] = 1.0
        if sample is not None:
            self._selector_sample = (cand, q)
        return tokens

    def forward_batch_generation(self, batch, *args, **kwargs):
        self._batch = batch
        _active.worker = self
        try:
            return super().forward_batch_generation(batch, *args, **kwargs)
        finally:
            self._batch = None
            _active.worker = None
            self._raw_logits = self._processed = None

    def _can_skip_verify_logits(self, batch, sampling_info) -> bool:
        # DFlash looks for penalties where overlap scheduling no longer keeps them; ask the requests instead
        if any(row_params(req, False) is not None for req in batch.reqs):
            return False
        return super()._can_skip_verify_logits(batch, sampling_info)

    def _adjust_verify_logits(self, logits: torch.Tensor, sampling_info, block: int) -> None:
        """Every verify slot's processed logits (``processing.py``): penalties and ``min_new_tokens`` with the slot's
        own history (the committed tokens and the proposed tokens before it), ``logit_bias``; custom logit
        processors as DFlash applies them. Keeps the raw logits when the batch returns logprobs."""
        batch = self._batch
        bs = logits.shape[0] // block
        if batch.return_logprob:
            self._raw_logits = logits.clone()
        if sampling_info.has_custom_logit_processor:
            apply_custom_logit_processor(logits, sampling_info, num_tokens_in_batch=block)
        rep_prompt = prompt_repetition()
        rows = [(b, req, rp) for b, req in enumerate(batch.reqs) if (rp := row_params(req, rep_prompt)) is not None]
        bias = getattr(sampling_info, "logit_bias", None)
        by_row = logits.view(bs, block, -1)
        if rows:
            idx = torch.tensor([b for b, _, _ in rows], device=batch.seq_lens.device)
            chains = self._draft_block_tokens_buf[:bs][idx.to(self._draft_block_tokens_buf.device)].tolist()
            for (b, req, rp), chain, seq_len in zip(rows, chains, batch.seq_lens[idx].tolist(), strict=True):
                generated = self.histories.of(req, seq_len, chain[0])
                process_block(by_row[b], generated, chain[1:], rp, None if bias is None else bias[b])
            self._processed = [(b, req) for b, req, _ in rows]
        if bias is not None:
            done = {b for b, _, _ in rows}
            rest = [b for b in range(bs) if b not in done]
            if rest:
                by_row[rest] += bias[rest].to(logits.dtype)[:, None, :]

    def _accept_block(self, **kwargs):
        out = super()._accept_block(**kwargs)
        if self.suffix is not None:
            self.suffix.record(out[0].view(-1).tolist())
        if self._processed:
            commit, tokens = out[1].view(-1).tolist(), out[3]
            for b, req in self._processed:
                self.histories.record(req, tokens[b, : commit[b]].tolist())
            self.histories.prune()
            self._processed = None
        if self._raw_logits is not None:  # SGLang reads the chain's logprobs from these next: the model's own
            kwargs["next_token_logits"].copy_(self._raw_logits)
            self._raw_logits = None
        return out

    def _update_target_mamba_state_after_verify(self, *, batch, seq_lens_pre_verify, seq_lens_post_verify,
                                                commit_lens) -> None:
        if not self._need_mamba_verify_commit:
            return
        model_runner = self.target_worker.model_runner
        if not gdn_replayssm_active(model_runner.req_to_token_pool):
            return super()._update_target_mamba_state_after_verify(
                batch=batch, seq_lens_pre_verify=seq_lens_pre_verify, seq_lens_post_verify=seq_lens_post_verify,
                commit_lens=commit_lens)
        B = int(self.block_size)
        interval = mamba_track_grid(batch.tree_cache.page_size) if batch.mamba_track_indices is not None else None
        steps = dm.replayssm_step_indices(seq_lens_pre_verify, commit_lens, interval)
        commit_mamba_states_after_verify(
            self.target_worker, batch,
            accept_lens=commit_lens.to(torch.int32),  # includes the bonus token
            accept_index=dm.chain_accept_index(commit_lens, B),
            draft_token_num=B,
            prepared_step_indices=steps,
        )
