"""Scoring without decoding: the log-probability of given continuations after a prompt, planned as few forwards as
the requests allow (the engines' ``score``: ``base.Scorer``).

A request's continuations (a label set, or one reference text) become sequences to run through the model:
- when every continuation is one token (``["Yes", "No"]`` on most tokenizers), the prompt alone, once: each label's
  log-probability is read at the prompt's last position (one prefill for the whole label set: the prompt is
  shared by construction);
- otherwise one sequence per continuation, prompt + continuation, its tokens read teacher-forced.
Sequences of the same length run together in batches (the reference engine's forward takes no padding), so a
batch of rows costs about one prefill each. ``Piece`` says where each number is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dspine_batch.engines.base import Request, Result


@dataclass(frozen=True)
class Piece:
    """One sequence to run: ``ids`` (prompt, then continuation ``k``'s tokens, or the prompt alone for a request of
    one-token continuations: ``k`` None), its request ``i`` and where its prompt ends (``start``)."""

    i: int
    k: int | None
    ids: list[int]
    start: int


def plan(requests: list[Request], max_tokens: int) -> tuple[list[Piece], dict[int, str]]:
    """The sequences the requests need, and each refused request's error (empty prompt or continuation, or longer
    than ``max_tokens``)."""
    pieces: list[Piece] = []
    refused: dict[int, str] = {}
    for i, r in enumerate(requests):
        conts = r.continuations or ()
        if not r.prompt_ids:
            refused[i] = "scoring: the prompt has no tokens"
        elif not conts or any(not c for c in conts):
            refused[i] = "scoring: a continuation renders to no tokens"
        elif len(r.prompt_ids) + max(map(len, conts)) - (1 if all(len(c) == 1 for c in conts) else 0) > max_tokens:
            refused[i] = (f"scoring: prompt and continuation are {len(r.prompt_ids) + max(map(len, conts))} tokens, "
                          f"over the model's context ({max_tokens})")
        elif all(len(c) == 1 for c in conts):
            pieces.append(Piece(i, None, list(r.prompt_ids), len(r.prompt_ids)))
        else:
            pieces.extend(Piece(i, k, [*r.prompt_ids, *c], len(r.prompt_ids)) for k, c in enumerate(conts))
    return pieces, refused


def batches(pieces: list[Piece], size: int) -> Iterator[list[Piece]]:
    """Pieces of equal length together, at most ``size`` at a time (longest first: the batch's memory peaks early)."""
    by_len: dict[int, list[Piece]] = {}
    for p in pieces:
        by_len.setdefault(len(p.ids), []).append(p)
    for n in sorted(by_len, reverse=True):
        group = by_len[n]
        for j in range(0, len(group), max(1, size)):
            yield group[j:j + size]


def score_requests(requests: list[Request], max_tokens: int, size: int,
                   run: Callable[[list[Piece], list[list[list[int]]]], list[list[list[float]]]]) -> list[Result]:
    """Every request scored through ``run``: a batch of pieces and, per piece, the token ids to read at each
    position from ``start - 1`` on (``wanted``) -> their log-probabilities, in the same shape."""
    pieces, refused = plan(requests, max_tokens)
    got: list[list[list[float] | None]] = [[None] * len(r.continuations or ()) for r in requests]
    for batch in batches(pieces, size):
        asked = [wanted(p, requests[p.i]) for p in batch]
        for piece, values in zip(batch, run(batch, asked), strict=True):
            if piece.k is None:  # one row of every label's log-probability at the prompt's last position
                for k, lp in enumerate(values[0]):
                    got[piece.i][k] = [lp]
            else:
                got[piece.i][piece.k] = [v[0] for v in values]
    out = []
    for i, r in enumerate(requests):
        if i in refused:
            out.append(Result(r.row_id, r.sample_index, prompt_tokens=len(r.prompt_ids), error=refused[i]))
            continue
        res = Result(r.row_id, r.sample_index, [], None, "stop", len(r.prompt_ids), 0)
        res.continuation_logprobs = [list(v or ()) for v in got[i]]
        out.append(res)
    return out


def wanted(piece: Piece, request: Request) -> list[list[int]]:
    """The token ids ``run`` reads for ``piece``, per position from ``start - 1``: every label at the prompt's last
    position (a prompt alone), else the continuation's next token at each of its positions."""
    conts = request.continuations or ()
    if piece.k is None:
        return [[c[0] for c in conts]]
    return [[t] for t in conts[piece.k]]
