"""Per-slot logits processing for the DSPINE verify: penalties, ``logit_bias`` and ``min_new_tokens`` with each
slot's own history.

SGLang 0.5.23's DFlash verify (``dflash_utils.apply_dflash_verify_logits_adjustments``) applies one penalty row,
the committed history's, to every slot of a block, and under DFlash the penalizers never even see the generated
tokens (its ``prepare_for_decode`` never feeds them), so a speculative run silently drops presence, frequency and
repetition penalties and keeps stop tokens masked or unmasked regardless of ``min_new_tokens`` (as read from
SGLang's source; not measured without this module). Plain decoding decides slot ``j`` of a block with the committed
tokens *and the proposed tokens before it* as its history; this module gives every slot exactly that, so the
distribution each proposal is verified against is the one plain decoding samples from: greedy outputs equal
plain decoding's, sampled ones keep its distribution (the verify's rejection sampling is exact for any target).

The order and arithmetic are those of plain SGLang with ``dspine.sglang.sampling`` (what the batch tool runs):
the repetition penalty first (CTRL/HF: a seen token's logit divided by p where positive, multiplied where not;
seen = the generated tokens, and the prompt's with the reference semantics), then the additive presence and
frequency penalties over the generated tokens, then ``logit_bias``, then ``min_new_tokens`` (stop ids to -inf
while fewer tokens were generated), then (SGLang's own step, after this) the grammar's mask, then custom logit
processors (the worker's ``_accept_block``: SGLang's sampler applies them last).

Pure torch and duck-typed requests (``Req``-like: ``origin_input_ids``, ``sampling_params``, ``eos_token_ids``,
``tokenizer``), so it is tested without SGLang. The generated history comes from ``rounds.history``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspine.decoding.history import slot_history

from .rounds import to_device

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowParams:
    """What a request asks of its verify slots beyond ``logit_bias`` (applied batch-wide from SGLang's tensor)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    prompt: tuple[int, ...] = ()  # ids the repetition penalty counts as seen before any output (may be empty)


def row_params(req: Any, prompt_repetition: bool) -> RowParams | None:
    """The request's per-slot processing, None when it needs none (the common case: no cost)."""
    sp = req.sampling_params
    presence = float(getattr(sp, "presence_penalty", 0.0) or 0.0)
    frequency = float(getattr(sp, "frequency_penalty", 0.0) or 0.0)
    repetition = float(getattr(sp, "repetition_penalty", 1.0) or 1.0)
    min_tokens = int(getattr(sp, "min_new_tokens", 0) or 0)
    if not (presence or frequency or repetition != 1.0 or min_tokens):
        return None
    prompt = tuple(int(t) for t in req.origin_input_ids) if repetition != 1.0 and prompt_repetition else ()
    return RowParams(presence, frequency, repetition, min_tokens, stop_ids(req) if min_tokens else (), prompt)


def stop_ids(req: Any) -> tuple[int, ...]:
    """The ids ``min_new_tokens`` holds back: SGLang's set (``BatchedMinNewTokensPenalizer``): the request's stop
    ids, the model's EOS ids, the tokenizer's EOS and additional stop ids."""
    ids = set(getattr(req.sampling_params, "stop_token_ids", None) or ())
    ids |= set(getattr(req, "eos_token_ids", None) or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
    return tuple(sorted(int(t) for t in ids if t is not None))


def process_block(logits: torch.Tensor, generated: list[int], drafts: list[int], rp: RowParams,
                  bias: torch.Tensor | None = None) -> None:
    """Process one row's verify logits ``[B, V]`` in place: slot ``j`` decides generated token ``len(generated) + j``
    after ``generated`` (every token generated so far, the block's anchor last) and ``drafts[:j]`` (the block's
    proposed tokens, ``B - 1`` of them). ``bias``: the row's ``logit_bias`` over the vocabulary, or None.

    The arithmetic is SGLang's penalizers', operation for operation, so a slot's processed logits are bit-equal to
    what a plain decode step computes from the same raw logits: a scaling tensor (1, or ``p`` where seen) applied as
    ``where(x < 0, x * s, x / s)``; the frequency term a float32 sum of ``f`` once per occurrence (SGLang's
    ``scatter_add_`` per step; a sum of equal addends does not depend on their order); ``additive = -F - P`` added
    once; then ``logit_bias``; ``min_new_tokens`` is ``-inf`` on the stop ids (SGLang adds ``-inf``: the same)."""
    B, V = logits.shape
    dev = logits.device
    f32 = torch.float32
    if rp.presence or rp.frequency or rp.repetition != 1.0:
        hist = to_device(generated, torch.long, dev)
        # per slot j the history generated + drafts[:j] (``dspine.decoding.history``, the reference engine's too);
        # frequency as float32 sums of `unit` once per occurrence, as SGLang's penalizer accumulates it
        seen_any = torch.zeros(V, dtype=torch.bool, device=dev)
        seen_any[hist] = True
        freq = None
        unit = torch.full((), float(rp.frequency), dtype=f32, device=dev)
        if rp.frequency:
            freq = torch.zeros(V, dtype=f32, device=dev).index_add_(0, hist, unit.expand(len(generated)))
        seen, freq = slot_history(seen_any, freq, list(drafts[: B - 1]), range(B), unit)
        if rp.repetition != 1.0:
            scale_seen = seen.clone()
            if rp.prompt:
                scale_seen[:, to_device(rp.prompt, torch.long, dev)] = True
            one = torch.ones((), dtype=f32, device=dev)
            scaling = torch.where(scale_seen, torch.full((), float(rp.repetition), dtype=f32, device=dev), one)
            x = logits.float()
            logits.copy_(torch.where(x < 0, x * scaling, x / scaling).to(logits.dtype))
        if rp.presence or rp.frequency:
            additive = torch.zeros((B, V), dtype=f32, device=dev)
            if freq is not None:
                additive -= freq
            if rp.presence:
                additive -= torch.where(seen, torch.full((), float(rp.presence), dtype=f32, device=dev),
                                        torch.zeros((), dtype=f32, device=dev))
            logits.add_(additive.to(logits.dtype))
    if bias is not None:
        logits.add_(bias.to(logits.dtype)[None])
    if rp.min_tokens and rp.stop_ids:
        early = rp.min_tokens - len(generated)  # slots 0..early-1 decide a token before min_tokens were generated
        if early > 0:
            stops = to_device([t for t in rp.stop_ids if t < V], torch.long, dev)
            logits[: min(early, B), stops] = NEG_INF
