"""SGLang ``meta_info`` -> our per-request stats columns (pure Python, no SGLang import).

SGLang reports speculative stats per request in ``meta_info`` only when the request finished, speculation
was on and at least one verify round ran (``TokenizerManager._calculate_spec_decoding_metrics`` in 0.5.23):

====================================  =============================================================
``spec_verify_ct``                    verify rounds
``spec_num_correct_drafts``           accepted drafts, bonus excluded (scheduler adds accept_len-1)
``spec_num_proposed_drafts``          ``spec_verify_ct * (speculative_num_draft_tokens - 1)``
``spec_accept_rate``                  correct / proposed
``spec_accept_length``                ``completion_tokens / spec_verify_ct`` (bonus *and* prefill token)
``spec_correct_drafts_histogram``     index j = rounds that accepted j drafts
====================================  =============================================================

By source: the DSPINE worker adds each request's verify rounds and drafted tokens by source (the DSpine draft, a
suffix match) to ``meta_info["dspine_source_counts"]`` (``dspine.sglang.suffix.SourceCounts``); ``by_source`` sums
them into the ``dspine_*`` / ``suffix_*`` columns, the same columns the reference engine fills.

``cached_tokens`` (present for every finished request) is the part of ``prompt_tokens`` the radix cache served
(``Req.cached_tokens``: the matched prefix length at the request's first prefill, ``ScheduleBatch.prepare_for_extend``
in 0.5.23); it becomes ``cached_prompt_tokens``. ``cached_tokens_details`` (HiCache tiers) is not read.

Older releases spelled them ``spec_accept_token_num``/``spec_draft_token_num`` and later
``spec_accepted_drafts``/``spec_proposed_drafts``; ``ALIASES`` reads every vintage, current name first.

Our columns follow the reference engine (``dspine.decoding.decode.SpecStats``, docs/design.md, "Verification and
sampling"):
``accept_length`` is tau per verify round *with the bonus token* and *without* the first token (which
comes from the prefill, not from a verify round): ``(completion_tokens - 1) / verify_steps``. SGLang's own
``spec_accept_length`` counts the prefill token too; ``ACCEPT_LENGTH_SGLANG`` keeps that convention for
callers who want SGLang's number (``accept_length(..., convention=ACCEPT_LENGTH_SGLANG)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dspine.sglang import SOURCE_COUNTS_KEY

# Our name -> SGLang names, current (0.5.23) first, then older spellings.
ALIASES: dict[str, tuple[str, ...]] = {
    "verify_steps": ("spec_verify_ct", "spec_verify_count", "spec_num_verify"),
    "accepted": ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num",
                 "spec_num_accepted_tokens"),
    "proposed": ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num",
                 "spec_num_draft_tokens"),
    "histogram": ("spec_correct_drafts_histogram", "spec_accept_histogram", "spec_accepted_drafts_histogram"),
    "accept_length": ("spec_accept_length",),
    "accept_rate": ("spec_accept_rate",),
}

ACCEPT_LENGTH_OURS = "verify_rounds"  # (completion - 1) / verify_steps: bonus counted, prefill token not
ACCEPT_LENGTH_SGLANG = "sglang"  # completion / verify_steps (SGLang's spec_accept_length)


@dataclass(frozen=True, slots=True)
class SpecStats:
    verify_steps: int
    draft_tokens_proposed: int | None
    draft_tokens_accepted: int | None
    accept_length: float
    accept_histogram: list[int] | None


def _first(meta: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        value = meta.get(name)
        if value is not None:
            return value
    return None


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"meta_info {name}: expected a number, got {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta_info {name}: expected a number, got {value!r}") from e
    if f != int(f) or f < 0:
        raise ValueError(f"meta_info {name}: expected a non-negative integer, got {value!r}")
    return int(f)


def spec_stats(meta: Mapping[str, Any], *, block_size: int | None = None,
               convention: str = ACCEPT_LENGTH_OURS) -> SpecStats | None:
    """Speculative stats of one finished request, or None when no verify round ran / speculation was off.

    ``block_size`` (the verify width B, anchor slot included = ``speculative_num_draft_tokens``) fills
    ``proposed`` when an old SGLang omits it and pads the histogram to ``B + 1`` entries like the reference
    engine's. Raises ``ValueError`` on a malformed field (a version we do not understand must not be read
    silently as zeros).
    """
    steps_raw = _first(meta, ALIASES["verify_steps"])
    if steps_raw is None:
        return None
    steps = _int(steps_raw, "spec_verify_ct")
    if steps == 0:
        return None
    accepted_raw = _first(meta, ALIASES["accepted"])
    proposed_raw = _first(meta, ALIASES["proposed"])
    accepted = None if accepted_raw is None else _int(accepted_raw, "accepted drafts")
    proposed = None if proposed_raw is None else _int(proposed_raw, "proposed drafts")
    if proposed is None and block_size is not None:
        proposed = steps * (block_size - 1)
    hist_raw = _first(meta, ALIASES["histogram"])
    hist: list[int] | None = None
    if hist_raw is not None:
        if isinstance(hist_raw, Mapping):  # {"j": count} in some serialisations
            width = 1 + max((int(k) for k in hist_raw), default=-1)
            hist = [0] * width
            for k, c in hist_raw.items():
                hist[int(k)] = _int(c, "histogram")
        else:
            hist = [_int(c, "histogram") for c in hist_raw]
        if block_size is not None and len(hist) < block_size + 1:
            hist += [0] * (block_size + 1 - len(hist))
        if sum(hist) not in (0, steps):
            raise ValueError(f"meta_info histogram counts {sum(hist)} rounds but spec_verify_ct = {steps}")
        if accepted is None and sum(hist):
            accepted = sum(j * c for j, c in enumerate(hist))
    return SpecStats(steps, proposed, accepted, accept_length(meta, steps, convention), hist)


def accept_length(meta: Mapping[str, Any], steps: int, convention: str = ACCEPT_LENGTH_OURS) -> float:
    """tau for one request. Ours: committed tokens per verify round (bonus included, prefill token not)."""
    completion = meta.get("completion_tokens")
    if completion is None:  # only SGLang's own number is there
        raw = _first(meta, ALIASES["accept_length"])
        if raw is None:
            raise ValueError("meta_info has spec_verify_ct but neither completion_tokens nor spec_accept_length")
        tau = float(raw)
        return tau if convention == ACCEPT_LENGTH_SGLANG else tau - 1.0 / steps
    completion = _int(completion, "completion_tokens")
    if convention == ACCEPT_LENGTH_SGLANG:
        return completion / steps
    if convention != ACCEPT_LENGTH_OURS:
        raise ValueError(f"unknown accept-length convention {convention!r}")
    return max(completion - 1, 0) / steps


def finish(meta: Mapping[str, Any]) -> tuple[str, str | None]:
    """(finish_reason in stop/length/abort/error, error message or None) from ``meta_info["finish_reason"]``.

    0.5.23: ``{"type": "length", "length": N}``, ``{"type": "stop", "matched": id|str}``,
    ``{"type": "abort", "message": ..., "status_code": ...}``, ``None`` while running. Older releases sent a
    bare string.
    """
    fr = meta.get("finish_reason")
    if fr is None:
        return "error", "the engine returned an unfinished request (no finish_reason)"
    kind = fr.get("type") if isinstance(fr, Mapping) else str(fr)
    if kind in ("stop", "length"):
        return kind, None
    if kind == "abort":
        msg = fr.get("message") if isinstance(fr, Mapping) else None
        code = fr.get("status_code") if isinstance(fr, Mapping) else None
        detail = f"{msg}" + (f" (status {code})" if code is not None else "") if msg else "no reason given"
        return "abort", f"aborted by the engine: {detail}"
    return "error", f"unknown finish_reason {fr!r}"


def apply(meta: Mapping[str, Any], result: Any, *, block_size: int | None = None, dspine: bool = True) -> Any:
    """Fill a ``dspine_batch.engines.base.Result`` (or anything with the same attributes) from ``meta``; the
    by-source columns only where the rounds are DSPINE's (``dspine``; not with another speculative algorithm)."""
    if meta.get("prompt_tokens") is not None:
        result.prompt_tokens = _int(meta["prompt_tokens"], "prompt_tokens")
    if meta.get("completion_tokens") is not None:
        result.completion_tokens = _int(meta["completion_tokens"], "completion_tokens")
    if meta.get("cached_tokens") is not None:  # absent: this SGLang does not say, the column stays null
        cached = _int(meta["cached_tokens"], "cached_tokens")
        if meta.get("prompt_tokens") is not None and cached > result.prompt_tokens:
            raise ValueError(f"meta_info cached_tokens {cached} > prompt_tokens {result.prompt_tokens}")
        result.cached_prompt_tokens = cached
    if meta.get("e2e_latency") is not None:
        result.latency_s = float(meta["e2e_latency"])
    st = spec_stats(meta, block_size=block_size)
    if st is not None:
        result.verify_steps = st.verify_steps
        result.draft_tokens_proposed = st.draft_tokens_proposed
        result.draft_tokens_accepted = st.draft_tokens_accepted
        result.accept_length = st.accept_length
        result.accept_histogram = st.accept_histogram
    if st is not None and dspine:
        by = by_source(meta, st, block_size)
        (result.dspine_verify_steps, result.dspine_tokens_proposed, result.dspine_tokens_accepted) = by[DSPINE]
        (result.suffix_verify_steps, result.suffix_tokens_proposed, result.suffix_tokens_accepted) = by[SUFFIX]
    return result


DSPINE, SUFFIX = "dspine", "suffix"


def by_source(meta: Mapping[str, Any], st: SpecStats,
              block_size: int | None) -> dict[str, tuple[int, int | None, int | None]]:
    """(verify rounds, tokens proposed, tokens accepted) by source for one request: the DSPINE worker's counts
    (``meta_info[SOURCE_COUNTS_KEY]``, a per-token list whose non-null entries each hold ``{source: [rounds,
    proposed, accepted]}``: ``dspine.sglang.suffix.SourceCounts``), and the rounds they do not cover taken as the
    draft's whole blocks (the worker counts only where suffix proposals are on; with ``proposers=dspine``, or on a
    captured CUDA graph, every round is the draft's)."""
    got = {DSPINE: [0, 0, 0], SUFFIX: [0, 0, 0]}
    for entry in meta.get(SOURCE_COUNTS_KEY) or ():
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise ValueError(f"meta_info {SOURCE_COUNTS_KEY}: expected per-token entries {{source: counts}}, "
                             f"got {entry!r}")
        for src, counts in entry.items():
            if not isinstance(counts, list | tuple) or len(counts) != 3:
                raise ValueError(f"meta_info {SOURCE_COUNTS_KEY}[{src!r}]: expected [rounds, proposed, accepted]")
            acc = got.setdefault(str(src), [0, 0, 0])
            for k, v in enumerate(counts):
                acc[k] += _int(v, SOURCE_COUNTS_KEY)
    rest = st.verify_steps - sum(c[0] for c in got.values())
    if rest < 0:
        raise ValueError(f"meta_info {SOURCE_COUNTS_KEY} counts more rounds than spec_verify_ct = {st.verify_steps}")
    out: dict[str, tuple[int, int | None, int | None]] = {k: (v[0], v[1], v[2]) for k, v in got.items()}
    if rest:  # the draft's whole blocks
        rounds, proposed, accepted = got[DSPINE]
        accepted_rest = None if st.draft_tokens_accepted is None else \
            st.draft_tokens_accepted - sum(c[2] for c in got.values())
        out[DSPINE] = (rounds + rest, None if block_size is None else proposed + rest * (block_size - 1),
                       None if accepted_rest is None else accepted + accepted_rest)
    return out


def stats_from_sglang_meta(meta: Mapping[str, Any], result: Any, block_size: int | None = None) -> Any:
    """Fill ``result``'s token counts and speculative stats from an SGLang-shaped ``meta_info`` dict.

    One normalisation for every backend that reports SGLang-style stats (``apply``: all name
    vintages, our accept-length convention); without speculation the stats stay null."""
    return apply(meta, result, block_size=block_size)
