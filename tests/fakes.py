"""Kept for test files not yet moved to ``tests/helpers.py``: re-exports its draft test doubles, plus the
continuous-batching variant of ``ScriptedDraft``."""

import torch
from helpers import LookaheadDraft, Proposal, RandomDraft, ScriptedDraft

from dspine.cache import KVCache, ModelCache


class JoiningScriptedDraft(ScriptedDraft):
    """``ScriptedDraft`` for continuous batching: each ``new_cache`` call numbers its rows after the previous
    ones, so a row keeps its request index when it is prefilled late and written into a freed slot (requests
    are prefilled in input order). Never let a calibration call ``new_cache`` on it: pass a cost model."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.next_row = 0

    def new_cache(self, batch, capacity):
        rid = torch.arange(self.next_row, self.next_row + batch, dtype=torch.float32).view(batch, 1, 1, 1)
        self.next_row += batch
        return ModelCache(torch.zeros(batch, dtype=torch.long), [KVCache(rid, rid.clone())])


__all__ = ["JoiningScriptedDraft", "LookaheadDraft", "Proposal", "RandomDraft", "ScriptedDraft"]
