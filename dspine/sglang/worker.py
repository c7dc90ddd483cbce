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

* ``__init__``: refuses devices other than CUDA and the CPU test path, non-DSpine drafts and a block width above the
  draft's block (DFlash only warns); attaches the target LM head to the draft and builds its draft-vocabulary
  caches before any warm-up or capture. ``init_attention_backends`` (the target's memory pools exist by then)
  refuses a hybrid target on the CPU without the GDN ReplaySSM ring (``cpu_hybrid_problem``).
* ``_update_target_mamba_state_after_verify``: SGLang's DFLASH path commits through
  ``update_mamba_state_after_mtp_verify``, which handles only KDA ReplaySSM (hence its guard refusing
  ``--enable-linear-replayssm-spec`` for DFLASH on GDN targets). With a GDN ReplaySSM ring we commit through
  ``spec_utils.commit_mamba_states_after_verify`` as EAGLE does, with the linear-chain accept index and the
  step indices computed from the *pre-verify* lengths (``draft_math``).
* ``forward_batch_generation``: chooses the round's suffix offers on the host (``dspine.sglang.suffix``, on with
  ``DSPINE_PROPOSERS=auto|suffix``; ``auto``: greedy rows only) before DFlash's round, and records the round's
  committed tokens per request on the device afterwards (``rounds.Tails``). The pre-verify step (``_before_verify``,
  reached through ``install_verify_hook`` on the eager and the captured draft path alike) aligns the offers on the
  device with the tokens the host has not seen yet (overlap scheduling), writes the matches over the draft slots
  (and a point mass over their q rows for the sampled accept: still exact speculative sampling) and queues the
  round's facts for the host. ``on_verify_complete_cpu`` (SGLang's hook once the accept lengths are on the host)
  settles them: per-source counts and estimates, the round and proposal logs. No round reads the device from the
  host unless a row needs it (penalties and ``min_new_tokens``: ``_histories``).
* ``_adjust_verify_logits`` (DFlash's verify-logits step): per-slot penalties, ``min_new_tokens`` and
  ``logit_bias`` (``processing``); ``_accept_block`` then applies custom logit processors, after the grammar mask,
  as SGLang's own sampler orders them, and restores the raw logits for logprobs.
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
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _resolve_dflash_embedding_module,
    _SelectorDraftSampler,
)
from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify

from . import draft_math as dm
from .models.dspine_draft import DSpineDraftModel
from .processing import process_block, row_params
from .rounds import Deferred, SyncCounter, Tails, history, settled, to_device, unseen_tokens
from .sampling import prompt_repetition
from .suffix import PROPOSERS_ENV, ROUND_LOG_ENV, SuffixProposer, align

logger = logging.getLogger(__name__)
# Test/debug aid: append every proposed block ({"anchor": [...], "tokens": [[...]]}, one JSON line per round, the
# draft's own tokens before any suffix match) to this file, so tests can compare SGLang's proposals with the
# reference engine's round by round. Written once SGLang has the round on the host (no sync; graphs included).
PROPOSAL_LOG_ENV = "DSPINE_SGLANG_PROPOSAL_LOG"
# The CPU path runs the draft-graph branch of DFlash's round (the selector folded into the captured draft forward,
# ``_SelectorDraftSampler``) eagerly, as a GPU runs it captured: "0" takes the eager selector path instead.
GRAPH_TWIN_ENV = "DSPINE_SGLANG_GRAPH_TWIN"
_active = threading.local()  # the DSPINE worker running a forward in this thread (the hooks' dispatch)


def _running():
    return getattr(_active, "worker", None)


def install_verify_hook() -> None:
    """Route three module globals of ``dflash_worker_v2`` to the running DSPINE worker (other workers keep SGLang's):
    the verify-logits step (``apply_dflash_verify_logits_adjustments``, between the target verify and the grammar
    mask) to its per-slot processing; and the two calls that read the draft block right after both proposal paths
    (eager and captured graph), ``GrammarTree.from_linear_chain`` (grammar batches, which copies the block) and
    ``DFlashVerifyInput``, run its pre-verify step first (suffix proposals, the proposal log). Idempotent."""
    dw = dflash_worker_v2
    current = dw.apply_dflash_verify_logits_adjustments
    if getattr(current, "_dspine", False):
        return

    def adjust(*, next_token_logits, sampling_info, draft_token_num):
        worker = _running()
        if worker is None:
            return current(next_token_logits=next_token_logits, sampling_info=sampling_info,
                           draft_token_num=draft_token_num)
        return worker._adjust_verify_logits(next_token_logits, sampling_info, int(draft_token_num))

    adjust._dspine = True
    verify_input, tree = dw.DFlashVerifyInput, dw.GrammarTree

    def make_verify_input(*args, **kwargs):
        worker = _running()
        if worker is not None:
            worker._before_verify()
        return verify_input(*args, **kwargs)

    class ChainTree(tree):
        @classmethod
        def from_linear_chain(cls, verify_ids_2d):
            worker = _running()
            if worker is not None:
                worker._before_verify()
            return tree.from_linear_chain(verify_ids_2d)

    dw.DFlashVerifyInput = make_verify_input
    dw.GrammarTree = ChainTree
    dw.apply_dflash_verify_logits_adjustments = adjust


def gdn_replayssm_active(req_to_token_pool) -> bool:
    """True when the target's mamba pool keeps a GDN (not KDA) ReplaySSM spec ring."""
    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None or getattr(pool, "replayssm_is_kda", False):
        return False
    return bool(getattr(pool, "replayssm_spec_fold", False)) or getattr(pool, "replayssm_cache_base", None) is not None


def cpu_hybrid_problem(device: str, req_to_token_pool) -> str | None:
    """Why DSPINE cannot run this target on the CPU test path, or None: there a hybrid (Mamba-state) target
    verifies only through the GDN ReplaySSM ring; the recurrent verify's per-draft state snapshots and the KDA
    ReplaySSM are GPU kernels without CPU versions (``dspine.sglang.cpu_kernels``). Asked once the target's memory
    pools exist (``init_attention_backends``): SGLang builds the speculative worker before them."""
    if not str(device).startswith("cpu") or getattr(req_to_token_pool, "mamba_pool", None) is None:
        return None
    if gdn_replayssm_active(req_to_token_pool):
        return None
    return ("DSPINE on a hybrid (Gated DeltaNet) target on the CPU needs --enable-linear-replayssm-spec: the CPU "
            "path commits linear-attention state only through the GDN ReplaySSM ring")


def greedy_request(req) -> bool:
    """SGLang's greedy rows (``resolve_greedy_mask``: top_k <= 1; temperature 0 becomes top_k 1), from the host."""
    return int(getattr(req.sampling_params, "top_k", 1) or 1) <= 1


class DSpineWorkerV2(DFlashWorkerV2):
    _batch = None  # the batch of the running forward (class defaults: DFlash's __init__ warms the proposal step)
    suffix: SuffixProposer | None = None
    tails: Tails | None = None
    deferred: Deferred | None = None
    sync_counter: SyncCounter | None = None
    proposal_log: str | None = None
    _offer = None  # this round's suffix offer: (picks, device tensors or None)
    _verify_ready = False  # the pre-verify step ran this round
    _raw_logits = None  # this round's verify logits before processing (rows returning logprobs)
    _warned_history = False
    _eager_ran = False  # this round's block came from the eager selector (else from the draft-graph branch)

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        device = str(getattr(target_worker, "device", "cuda"))
        if not device.startswith(("cuda", "cpu")):
            raise RuntimeError(f"DSPINE runs on CUDA (or the CPU test path), not on {device!r}")
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
        self.draft_model.prepare_vocab()  # the draft-vocabulary caches, before any warm-up or capture
        self.draft_model.target_embed = self._block_embedding()
        proposer = SuffixProposer(os.environ.get(PROPOSERS_ENV) or "dspine", int(self.block_size) - 1,
                                  log_path=os.environ.get(ROUND_LOG_ENV))
        self.suffix = proposer if proposer.active else None
        self.deferred = Deferred()
        self.sync_counter = SyncCounter.from_env()
        self.proposal_log = os.environ.get(PROPOSAL_LOG_ENV)
        install_verify_hook()
        logger.info("DSPINE worker ready: block=%d (1 anchor + %d drafts), top_k=%d, rank=%d, proposers=%s",
                    int(self.block_size), int(self.block_size) - 1, self.selector.top_k,
                    self.draft_model.transfer_rank, proposer.mode)

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        if (self._draft_sampler is None and str(self.device).startswith("cpu")
                and os.environ.get(GRAPH_TWIN_ENV, "1") != "0"):
            self._graph_twin()

    def _graph_twin(self) -> None:
        """The captured draft branch without a capture (CPU path): the same ``_SelectorDraftSampler`` a GPU folds into
        its draft graph runs right after each eager block forward, and the forward reports ``can_run_graph``, so
        DFlash's round takes the graph branch (the sampler's static buffers, ``_selector_sample`` from them)."""
        max_bs = int(getattr(self.server_args, "max_running_requests", None) or 48)
        sampler = _SelectorDraftSampler(draft_model=self.draft_model, block_size=self.block_size, max_bs=max_bs,
                                        device=self.device, sampling_enabled=self._selector_sampling_enabled)
        runner = self.draft_model_runner
        forward = runner.forward

        def forward_then_sample(forward_batch, *args, **kwargs):
            out = forward(forward_batch, *args, **kwargs)
            hidden = getattr(getattr(out, "logits_output", None), "hidden_states", None)
            if forward_batch.forward_mode.is_target_verify() and hidden is not None:
                sampler(hidden, forward_batch.input_ids)
                out.can_run_graph = True
            return out

        runner.forward = forward_then_sample
        self._draft_sampler = sampler
        logger.info("DSPINE: the CPU path runs the draft-graph branch eagerly (%s=0: the eager selector)",
                    GRAPH_TWIN_ENV)

    def init_attention_backends(self):
        problem = cpu_hybrid_problem(str(self.device), self.model_runner.req_to_token_pool)
        if problem:
            raise RuntimeError(problem)
        super().init_attention_backends()

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

    # -- one forward ---------------------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, *args, **kwargs):
        mode = batch.forward_mode
        decode = not (mode.is_extend() or batch.is_extend_in_batch or mode.is_idle())
        self._batch, self._verify_ready, self._eager_ran = batch, False, False
        _active.worker = self
        if self.sync_counter is not None:
            self.sync_counter.start()
        try:
            if decode and self.suffix is not None:
                self._offer = self._offer_suffix(batch)
            result = super().forward_batch_generation(batch, *args, **kwargs)
            if not mode.is_idle():
                self._record_tails(batch, result, decode)
            return result
        finally:
            self._batch = self._offer = self._raw_logits = None
            _active.worker = None
            if self.sync_counter is not None:
                self.sync_counter.stop("decode" if decode else "extend")

    def _tails(self) -> Tails:
        if self.tails is None:
            slots = self.model_runner.req_to_token_pool.req_to_token.shape[0]
            self.tails = Tails(slots, int(self.block_size), self.device)
        return self.tails

    def _record_tails(self, batch, result, decode: bool) -> None:
        """The round's committed tokens per request slot, on the device (``rounds.Tails``)."""
        ids = result.next_token_ids
        bs = len(batch.reqs)
        if not isinstance(ids, torch.Tensor) or bs == 0:
            return
        if decode and result.accept_lens is not None and ids.numel() == bs * int(self.block_size):
            self._tails().record(batch.req_pool_indices, ids.view(bs, -1), result.accept_lens)
        elif not decode and ids.numel() == bs:  # a prefill: its one token
            self._tails().record(batch.req_pool_indices, ids.view(bs, 1), torch.ones_like(ids))

    def _offer_suffix(self, batch):
        """This round's suffix offers, chosen on the host (``SuffixProposer.choose``): (picks, device tensors)."""
        reqs = list(batch.reqs)
        picks = self.suffix.choose(reqs, [greedy_request(r) for r in reqs])
        if not any(picks):
            return picks, None
        offered, lens = self.suffix.offer(picks, self.device)
        known = to_device([len(r.origin_input_ids) + len(r.output_ids) for r in reqs], torch.int64, self.device)
        return picks, (offered, lens, known)

    def _propose_selector_block(self, **kwargs):
        self._eager_ran = True  # the eager branch (the captured one never calls this)
        return super()._propose_selector_block(**kwargs)

    def _before_verify(self) -> None:
        """Right after the draft block is final (eager or captured path), before anything reads it: the suffix
        proposals over the draft slots, and this round's facts queued for the host (``rounds.Deferred``)."""
        batch = self._batch
        if self._verify_ready or batch is None:
            return
        self._verify_ready = True
        bs = len(batch.reqs)
        block = self._draft_block_tokens_buf[:bs]
        facts = {}
        if self.proposal_log:
            facts["proposal"] = block.clone()
        if self.suffix is not None and self._offer is not None and self._offer[1] is not None:
            facts["suffix"] = self._apply_suffix(batch, block, *self._offer[1])
        if facts or self.suffix is not None:
            self.deferred.push(batch.reqs, facts, "eager" if self._eager_ran else "graph")

    def _apply_suffix(self, batch, block: torch.Tensor, offered, lens, known) -> torch.Tensor:
        """Write the aligned suffix proposals (``suffix.align``) over the draft slots, and a point mass over their q
        rows for the sampled accept (accept with probability p(x), else resample the residual: exact). Returns the
        suffix tokens used per row (device)."""
        width = block.shape[1] - 1
        tail, tail_len = self._tails().of(batch.req_pool_indices)
        unseen, ok = unseen_tokens(batch.seq_lens + 1, known, tail, tail_len)
        tokens, n = align(offered, lens, unseen, ok, tail, tail_len, width)
        use = torch.arange(width, device=block.device)[None, :] < n[:, None]
        block[:, 1:] = torch.where(use, tokens.to(block.dtype), block[:, 1:])
        if self._selector_sample is not None:  # every candidate names the token with q 1: a point mass
            cand, q = self._selector_sample
            cand = torch.where(use[:, :, None], tokens[:, :, None].to(cand.dtype), cand)
            q = torch.where(use[:, :, None], torch.ones_like(q), q)
            self._selector_sample = (cand, q)
        return n

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        """SGLang has this round's accept lengths on the host: settle the round's queued facts (suffix statistics
        and per-source counts, the round and proposal logs) without any wait of our own."""
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
        rec = self.deferred.pop(batch_size) if self.deferred is not None and self.deferred.queue else None
        if rec is None:
            return
        proposal = rec.read("proposal")
        if proposal is not None and self.proposal_log:
            # rows SGLang settles this round (a finished or retracted row's overshoot round under overlap is dropped)
            rows = [r for r, req in zip(proposal, rec.reqs, strict=True) if settled(req)]
            if rows:
                with open(self.proposal_log, "a") as f:
                    f.write(json.dumps({"anchor": [r[0] for r in rows], "tokens": [r[1:] for r in rows],
                                        "path": rec.path}) + "\n")
        if self.suffix is not None:
            used = rec.read("suffix") or [0] * len(rec.reqs)
            self.suffix.record(rec.reqs, used, list(num_correct_drafts_per_req))

    # -- the verify's logits ---------------------------------------------------------------------------------------
    def _can_skip_verify_logits(self, batch, sampling_info) -> bool:
        # DFlash looks for penalties where overlap scheduling no longer keeps them; ask the requests instead
        if any(row_params(req, False) is not None for req in batch.reqs):
            return False
        return super()._can_skip_verify_logits(batch, sampling_info)

    def _adjust_verify_logits(self, logits: torch.Tensor, sampling_info, block: int) -> None:
        """Every verify slot's processed logits (``processing.py``): penalties and ``min_new_tokens`` with the slot's
        own history (the committed tokens and the proposed tokens before it), ``logit_bias``. Custom logit
        processors come later, as in SGLang's sampler (``_accept_block``). Keeps the raw logits when the batch
        returns logprobs."""
        batch = self._batch
        bs = logits.shape[0] // block
        if batch.return_logprob:
            self._raw_logits = logits.clone()
        rep_prompt = prompt_repetition()
        rows = [(b, req, rp) for b, req in enumerate(batch.reqs) if (rp := row_params(req, rep_prompt)) is not None]
        bias = getattr(sampling_info, "logit_bias", None)
        by_row = logits.view(bs, block, -1)
        if rows:
            for (b, _req, rp), (generated, chain) in zip(rows, self._histories(batch, [b for b, _, _ in rows])):
                process_block(by_row[b], generated, chain[1:], rp, None if bias is None else bias[b])
        if bias is not None:
            done = {b for b, _, _ in rows}
            rest = [b for b in range(bs) if b not in done]
            if rest:
                by_row[rest] += bias[rest].to(logits.dtype)[:, None, :]

    def _histories(self, batch, idx: list[int]) -> list[tuple[list[int], list[int]]]:
        """(generated tokens, the block's chain) of rows ``idx`` on the host: one device read, which these rows need.
        The generated tokens are ``output_ids`` completed from the device tail (``rounds.history``); should the tail
        not cover the gap, the row is processed with what is known and a warning (never an error in the scheduler)."""
        bs = len(batch.reqs)
        ix = to_device(idx, torch.int64, batch.seq_lens.device)
        tail, tail_len = self._tails().of(batch.req_pool_indices[ix])
        chain = self._draft_block_tokens_buf[:bs][ix.to(self._draft_block_tokens_buf.device)].to(torch.int64)
        facts = torch.cat([(batch.seq_lens[ix].to(torch.int64) + 1)[:, None], tail_len[:, None], chain, tail], 1)
        if self.sync_counter is not None:
            self.sync_counter.need(len(idx))
        B = chain.shape[1]
        out = []
        for b, row in zip(idx, facts.tolist(), strict=True):
            req = batch.reqs[b]
            total, tl, ch, tl_tokens = row[0], row[1], row[2 : 2 + B], row[2 + B :]
            generated, ok = history(req.output_ids, total - len(req.origin_input_ids), tl_tokens, tl)
            ok = ok and bool(generated) and generated[-1] == ch[0]  # the anchor is the last committed token
            if not ok and self.sync_counter is not None:
                self.sync_counter.fell_back()
            if not ok and not self._warned_history:
                self._warned_history = True
                logger.warning("DSPINE: request %s: its generated tokens could not be rebuilt for penalties "
                               "(%d known, %d committed); this round uses what is known", req.rid,
                               len(req.output_ids), total - len(req.origin_input_ids))
            out.append((generated, ch))
        return out

    def _accept_block(self, **kwargs):
        sampling_info = kwargs.get("sampling_info")
        if sampling_info is not None and sampling_info.has_custom_logit_processor:
            # SGLang's sampler applies a custom logit processor last, after the penalties, the grammar mask and
            # logit_bias (ModelRunner._preprocess_logits, then Sampler._preprocess_logits): so does the verify
            apply_custom_logit_processor(kwargs["next_token_logits"], sampling_info,
                                         num_tokens_in_batch=int(self.block_size))
        out = super()._accept_block(**kwargs)
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
