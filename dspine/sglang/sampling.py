"""SGLang's plain sampling brought to the request contract of ``dspine_batch`` (the reference engine's semantics),
in the processes of an engine the batch tool starts (``DSPINE_SGLANG_SAMPLING=reference``, set by
``dspine_batch.engines.sglang``; SGLang launched by hand keeps its own behaviour).

Four differences between SGLang 0.5.23 and what OpenAI, vLLM, HF and the reference engine mean by the same
request fields, each fixed at one seam:

* **The repetition penalty counts the prompt.** SGLang's ``BatchedRepetitionPenalizer`` marks only generated
  tokens; HF, vLLM and the reference engine mark the prompt's too. Its ``_prepare`` also marks the request's
  prompt (and, after a retraction, the tokens generated before it).
* **One order for the penalties.** Without overlap scheduling SGLang applies its penalizers in the iteration order
  of a ``set`` of classes (it differs between processes), so a row with both a repetition and a presence or
  frequency penalty got either order; with overlap, additive then multiplicative. Here always the repetition
  penalty first, then the additive ones, as the reference engine (and the DSPINE verify, ``processing.py``) do.
* **The stop ids are the request's.** SGLang also ends a row (and makes ``min_new_tokens`` hold back) the
  tokenizer's "additional stop tokens" (``<|eom_id|>`` and two others, where a tokenizer has them:
  ``attach_additional_stop_token_ids``); the batch tool sends every stop id it means (EOS ids of the tokenizer and
  the model's configs, single-token stop strings), as the reference engine stops on, so that list is left empty.
* **Logprobs of the model's own logits.** SGLang reports the log-softmax of the *processed* logits (penalties,
  grammar mask, logit bias; and temperature unless ``SGLANG_RETURN_ORIGINAL_LOGPROB``). The contract is the raw
  logits' log-softmax (``dspine_batch.engines.base.TokenLogprob``): ``ModelRunner.sample`` keeps the raw logits of
  a batch that returns logprobs and the sampler reports from them (its own ``logprob_logits`` seam, used by
  SGLang's watermarking), with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (no temperature). The DSPINE verify restores
  its raw logits before SGLang reads the chain's logprobs (``worker.py``).
"""

from __future__ import annotations

import os
import threading

from .after_import import after_import
from .cpu import _patch

SAMPLING_ENV = "DSPINE_SGLANG_SAMPLING"
REFERENCE = "reference"
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
_raw = threading.local()  # the raw logits of the batch being sampled (ModelRunner.sample -> Sampler.forward)
_applied = False


def engine_env() -> dict[str, str]:
    """The environment the batch tool's SGLang engine starts its processes with."""
    return {SAMPLING_ENV: REFERENCE, ORIGINAL_LOGPROB_ENV: "1"}


def active(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(SAMPLING_ENV) == REFERENCE


def prompt_repetition() -> bool:
    """Whether the repetition penalty counts the prompt (the reference semantics) in this process."""
    return active()


def apply() -> bool:
    """Install the patches in this process when asked for (idempotent); True if they are in place."""
    global _applied
    if _applied:
        return True
    if not active():
        return False
    for module, attr_path, make in PATCHES:
        after_import(module, _patch(attr_path, make))
    _applied = True
    return True


def _marked(fn):
    fn._dspine_cpu = True  # dspine's "already wrapped" marker (cpu.wrap)
    return fn


def prompt_counts(original):
    """``BatchedRepetitionPenalizer._prepare`` that also marks each request's prompt as seen."""

    def _prepare(self):
        import torch

        original(self)
        rows, cols = [], []
        for i, req in enumerate(self.orchestrator.reqs()):
            if req.sampling_params.repetition_penalty == 1.0:
                continue
            ids = [*req.origin_input_ids, *req.output_ids]
            rows += [i] * len(ids)
            cols += ids
        if rows:
            pen = self.cumulated_repetition_penalties
            r = torch.tensor(rows, dtype=torch.long, device=pen.device)
            c = torch.tensor(cols, dtype=torch.long, device=pen.device)
            pen[r, c] = self.repetition_penalties[r, 0]

    return _marked(_prepare)


def scaling_first(original):
    """``SamplingBatchInfo._apply_pre_grammar_logits_transforms``: the multiplicative penalties, then the
    additive ones (summed into one tensor first), whichever scheduling loop runs."""

    def transforms(self, logits):
        import torch

        scaling, additive = self.acc_scaling_penalties, self.acc_additive_penalties
        orch = self.penalizer_orchestrator
        if orch is not None and orch.is_required:
            scaling = orch.accumulate_scaling_penalties()
            additive = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            orch.accumulate_additive_penalties(additive)
        if scaling is not None:
            logits.copy_(torch.where(logits < 0, logits * scaling, logits / scaling))
        if additive is not None:
            logits.add_(additive.to(logits.dtype))

    return _marked(transforms)


def keep_raw_logits(original):
    """``ModelRunner.sample`` keeping the raw logits of a batch that returns logprobs for the sampler."""

    def sample(self, logits_output, forward_batch):
        if forward_batch.return_logprob and logits_output.next_token_logits is not None:
            _raw.logits = logits_output.next_token_logits.clone()
        try:
            return original(self, logits_output, forward_batch)
        finally:
            _raw.logits = None

    return _marked(sample)


def raw_logprobs(original):
    """``Sampler.forward`` reporting logprobs from the kept raw logits (unless a caller passes its own)."""

    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs,
                positions, **kwargs):
        raw = getattr(_raw, "logits", None)
        if return_logprob and raw is not None and kwargs.get("logprob_logits") is None:
            kwargs["logprob_logits"] = raw
        return original(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                        token_ids_logprobs, positions, **kwargs)

    return _marked(forward)


def no_additional_stops(original):
    """``attach_additional_stop_token_ids`` leaving the tokenizer without SGLang's extra stop ids."""

    def attach(tokenizer):
        tokenizer.additional_stop_token_ids = None

    return _marked(attach)


PATCHES = (
    ("sglang.srt.sampling.penaltylib.repetition_penalty", "BatchedRepetitionPenalizer._prepare", prompt_counts),
    ("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo._apply_pre_grammar_logits_transforms",
     scaling_first),
    ("sglang.srt.model_executor.model_runner", "ModelRunner.sample", keep_raw_logits),
    ("sglang.srt.layers.sampler", "Sampler.forward", raw_logprobs),
    ("sglang.srt.utils.hf_transformers.tokenizer", "attach_additional_stop_token_ids", no_additional_stops),
)
