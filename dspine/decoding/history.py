"""What a verify slot has seen: a row's history as each slot of a speculative block must see it.

Slot ``j`` of a verify decides the token after the row's committed tokens *and the ``j`` proposed tokens before
it*, so a history-dependent processor (repetition, presence and frequency penalties) must see, per slot, the
committed history plus ``drafts[:j]``: losslessness under penalties rests on it (plain decoding at that position
sees exactly that). Both verifiers build it here, the reference engine's (``processors.process``) and the SGLang
plugin's (``dspine.sglang.processing.process_block``), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_history(seen: torch.Tensor | None, acc: torch.Tensor | None, drafts: Sequence[int], slots: Sequence[int],
                 unit: float | torch.Tensor = 1.0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per slot (``slots``: which slots, each ``j`` seeing ``drafts[:j]``), the ids seen [n, V] (bool) and the
    occurrence accumulator [n, V]: ``seen`` / ``acc`` [V] are the committed history's (either may be None: not
    needed), each proposed token before a slot sets its id seen and adds ``unit`` to its accumulator entry, once
    per occurrence. ``unit`` 1 counts occurrences (the reference engine multiplies by the frequency penalty
    afterwards); SGLang's penalizer instead accumulates the penalty itself per occurrence (``unit`` = the
    penalty, in the accumulator's dtype), which this keeps addend for addend: a sum of equal float32 addends is
    the same in any order."""
    n = len(slots)
    out_seen = None if seen is None else seen[None].repeat(n, 1)
    out_acc = None if acc is None else acc[None].repeat(n, 1)
    width = min(max(slots, default=0), len(drafts))
    if width == 0 or (out_seen is None and out_acc is None):
        return out_seen, out_acc
    ref = out_seen if out_seen is not None else out_acc
    ids = torch.tensor(list(drafts[:width]), dtype=torch.long, device=ref.device).expand(n, width)
    before = torch.arange(width, device=ref.device)[None, :] < torch.tensor(list(slots), device=ref.device)[:, None]
    if out_seen is not None:
        _mark(out_seen, ids, before)
    if out_acc is not None:
        step = torch.as_tensor(unit, dtype=out_acc.dtype, device=out_acc.device)
        out_acc.scatter_add_(1, ids, torch.where(before, step, torch.zeros((), dtype=out_acc.dtype,
                                                                           device=out_acc.device)))
    return out_seen, out_acc


def _mark(seen: torch.Tensor, ids: torch.Tensor, before: torch.Tensor) -> None:
    """``seen[i, ids[i, k]] = True`` where ``before[i, k]``, in place."""
    rows = torch.arange(seen.shape[0], device=seen.device)[:, None].expand_as(ids)
    seen[rows[before], ids[before]] = True
