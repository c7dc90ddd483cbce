"""SGLang ``meta_info`` logprobs -> ``Result.logprobs`` (pure Python, no SGLang import).

With ``return_logprob`` SGLang puts one ``[logprob, token_id, text]`` per completion token in
``output_token_logprobs`` and, with ``top_logprobs_num`` k > 0, the k most likely ``[logprob, token_id, text]`` per
position in ``output_top_logprobs`` (most likely first; ``text`` is None without a detokenized answer, and we never
read it: the pipeline names the tokens). They are the raw logits' log-softmax in the engines dspine-batch starts
(``dspine.sglang.sampling``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dspine_batch.engines.base import TokenLogprob


def logprobs(meta: Mapping[str, Any], n_tokens: int) -> list[TokenLogprob]:
    """One ``(token_id, logprob, top)`` per completion token; ValueError when SGLang's answer does not fit."""
    chosen = meta.get("output_token_logprobs")
    if chosen is None:
        raise ValueError("no output_token_logprobs in meta_info")
    if len(chosen) != n_tokens:
        raise ValueError(f"{len(chosen)} output_token_logprobs for {n_tokens} tokens")
    tops = meta.get("output_top_logprobs") or [None] * n_tokens
    if len(tops) != n_tokens:
        raise ValueError(f"{len(tops)} output_top_logprobs for {n_tokens} tokens")
    out: list[TokenLogprob] = []
    for entry, top in zip(chosen, tops, strict=True):
        lp, tid = entry[0], entry[1]
        out.append((int(tid), float(lp), tuple((int(t[1]), float(t[0])) for t in (top or ()))))
    return out


def continuation(out: Mapping[str, Any], cont: tuple[int, ...]) -> list[float]:
    """The log-probability of each token of ``cont``, the tail of a scoring request's ``input_ids``: the last
    ``len(cont)`` of SGLang's ``input_token_logprobs`` (``[logprob, token_id, text]`` per input position from
    ``logprob_start_len`` on; a position without one, the sequence's first, is None). ValueError when they are not
    ``cont``'s tokens. SGLang 0.5.23 reports the id of the vocabulary's last token (and any above: its image hashes)
    as 0 (``logprob_result_processor``), its log-probability still that of the token fed: a 0 matches any id."""
    meta = out.get("meta_info") or {}
    entries = list(meta.get("input_token_logprobs") or ())[-len(cont):]
    got = [None if e is None else int(e[1]) for e in entries]
    if len(got) != len(cont) or any(g not in (t, 0) for g, t in zip(got, cont, strict=True)) \
            or any(e[0] is None for e in entries):
        raise ValueError(f"SGLang's input logprobs are for tokens {got}, not the continuation {list(cont)}")
    return [float(e[0]) for e in entries]
