"""Log-probabilities of given continuations after prompts, with no decoding: what a judge reads from a model's
own distribution (label probabilities, the likelihood of a reference answer).

The prompts are prefilled exactly as the decoding loop prefills them (``prefill.shared_waves`` and ``fill``: the
prefixes they share computed once, right-padded, in chunks when asked, the prefix cache's hits copied instead of
computed, every prompt kept in the tree for the rows after it), so scoring rows behind one template costs what
their new tokens cost. The prompt's last hidden state gives every continuation's first token (a label set of
one-token labels is read from that one position); a longer continuation runs its other tokens on a copy of its
row's cache, all of them in one right-padded forward. The logits are taken at the positions read only,
log-softmax in fp32.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from dspine.cpu.threads import Governor
from dspine.decoding.config import StreamConfig
from dspine.decoding.prefill import Pace, fill, shared_waves
from dspine.decoding.prefix import PrefixCache
from dspine.models.target import Target


@torch.inference_mode()
def continuation_logprobs(target: Target, prompts: list[list[int]], continuations: list[Sequence[Sequence[int]]],
                          prefix: PrefixCache | None = None, chunk: int = 0,
                          governor: Governor | None = None) -> list[list[list[float]]]:
    """For each prompt, for each of its continuations, the log-probability of each continuation token given the
    prompt and the continuation's tokens before it. Every prompt and continuation must be non-empty. ``governor``
    (``dspine.cpu.threads``) is ticked before every forward, as the decoding loop ticks it every round: on a
    crowded machine a forward on all threads collapses at its barriers (keep one across calls: it decides from
    two samples in a row)."""
    if governor is not None:  # the count in use now: a decode stream's own governor may have set another since
        governor.threads = torch.get_num_threads()
    cfg = StreamConfig(draft=None, block_size=0, dynamic_threshold=None, verify="fixed", cost=None,
                       nominal_rows=len(prompts), taps=(), prefix=prefix, chunk=chunk)
    capacity = max(len(p) + max(len(c) for c in cs) for p, cs in zip(prompts, continuations, strict=True))
    pace = Pace()
    _drive(shared_waves(target, prompts, cfg, pace), governor)
    cache, last, _, _ = _drive(fill(target, prompts, cfg, capacity, pace), governor)
    first = target.logits(last[:, None, :])[:, 0].float().log_softmax(-1)  # [B, V]: each continuation's 1st token
    out = [[[first[b, c[0]].item()] for c in cs] for b, cs in enumerate(continuations)]
    longer = [(b, k) for b, cs in enumerate(continuations) for k, c in enumerate(cs) if len(c) > 1]
    if not longer:
        return out
    dev = target.device
    fed = [list(continuations[b][k][:-1]) for b, k in longer]  # the tokens before each later one
    lens = torch.tensor([len(f) for f in fed], dtype=torch.long, device=dev)
    ids = torch.zeros(len(fed), int(lens.max()), dtype=torch.long, device=dev)
    for j, f in enumerate(fed):
        ids[j, : len(f)] = torch.tensor(f, dtype=torch.long)
    if governor is not None:
        governor.tick()
    hidden = target.forward(ids, cache.select([b for b, _ in longer]), n_valid=lens).hidden
    for j, (b, k) in enumerate(longer):
        want = torch.tensor(continuations[b][k][1:], dtype=torch.long, device=dev)
        lp = target.logits(hidden[j : j + 1, : len(fed[j])])[0].float().log_softmax(-1)
        out[b][k].extend(lp[torch.arange(len(want), device=dev), want].tolist())
    return out


def _drive(job: Generator[None, None, Any], governor: Governor | None) -> Any:
    """A prefill job run to its end (no decode loop to hand turns to), the governor ticked before each forward."""
    while True:
        if governor is not None:
            governor.tick()
        try:
            next(job)
        except StopIteration as done:
            return done.value
