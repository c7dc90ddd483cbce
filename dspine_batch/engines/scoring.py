"""Scoring without decoding, the engine side (``base.Scorer``): a batch of scoring requests checked (a request
that cannot be scored is that row's error, never its neighbours'), cut into the engine's batch size, scored by the
engine's own function, answered as ``Result``s with ``continuation_logprobs``. The reference engine scores with
``dspine.decoding.score`` (its prefill, prefix cache included); the scripted engine with made-up numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from dspine_batch.engines.base import Request, Result

# a batch of requests -> per request, per continuation, each token's log-probability
ScoreFn = Callable[[list[Request]], list[list[list[float]]]]


def refusal(r: Request, max_tokens: int) -> str | None:
    """Why ``r`` cannot be scored (None: it can): an empty prompt or continuation, or more tokens than the model
    reads (the prompt and every continuation token but the last are fed)."""
    conts = r.continuations or ()
    if not r.prompt_ids:
        return "scoring: the prompt has no tokens"
    if not conts or any(not c for c in conts):
        return "scoring: a continuation renders to no tokens"
    fed = len(r.prompt_ids) + max(map(len, conts)) - 1
    if fed > max_tokens:
        return f"scoring: prompt and continuation are {fed + 1} tokens, over the model's context ({max_tokens})"
    return None


def score_requests(requests: list[Request], max_tokens: int, size: int, run: ScoreFn) -> list[Result]:
    """Every request answered, in order: scored through ``run``, at most ``size`` at a time, or refused."""
    refused = {i: why for i, r in enumerate(requests) if (why := refusal(r, max_tokens)) is not None}
    ok = [i for i in range(len(requests)) if i not in refused]
    got: dict[int, list[list[float]]] = {}
    for j in range(0, len(ok), max(1, size)):
        batch = ok[j:j + size]
        got.update(zip(batch, run([requests[i] for i in batch]), strict=True))
    out = []
    for i, r in enumerate(requests):
        if i in refused:
            out.append(Result(r.row_id, r.sample_index, prompt_tokens=len(r.prompt_ids), error=refused[i]))
        else:
            out.append(Result(r.row_id, r.sample_index, [], None, "stop", len(r.prompt_ids), 0,
                              continuation_logprobs=got[i]))
    return out
