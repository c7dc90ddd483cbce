"""A custom logit processor for the SGLang end-to-end tests, in its own module so SGLang's scheduler processes (which
inherit the test process's ``sys.path``) can load it by reference from the serialized request."""

from __future__ import annotations

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class BanArgmax(CustomLogitProcessor):
    """Bans each row's current argmax: which token that is depends on whether penalties and ``logit_bias`` were
    applied before it, so outputs show the order (SGLang's sampler applies custom processors last)."""

    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        return logits.scatter(1, logits.argmax(dim=1, keepdim=True), float("-inf"))
