"""Why the planner did what it did, in words a user can act on: per source, the rounds it was chosen, its tokens
proposed and accepted, and — only when it never ran, or was stopped (the draft retired) — the numbers behind that:
the cost model's estimate of its τ on this job against the τ a round of it must reach to beat a plain step on this
machine at the rows in flight. Estimates are called estimates, so that a line never sets them beside the measured
counts unnamed. The batch tool logs it once, early, and its report prints it (``dspine_batch``'s ``explain()``)."""

from __future__ import annotations

import torch

from dspine.decoding.acceptance import JobAcceptance
from dspine.decoding.prices import LivePrices, StaticPrices


def _typical_rows(prices: LivePrices | StaticPrices, fallback: int) -> int:
    """The row count the job has spent most rounds at (the prices' buckets), else ``fallback``."""
    rows = getattr(prices, "rows", None)
    if not rows:
        return fallback
    return max(rows, key=lambda R: rows[R].fit.xx[0][0])


def break_even(prices: LivePrices | StaticPrices, R: int, width: int, block: int = 0) -> float:
    """τ (tokens committed per row per round) a round that verifies ``width`` tokens on every one of ``R`` rows
    (and runs the draft's ``block``) must reach to be as fast as a plain step: its time over the plain step's."""
    plain = prices.round_s(R, 0)
    return (prices.round_s(R, R * width) + prices.draft_s(R, block)) / plain


def draft_outlook(job: JobAcceptance, prices: LivePrices | StaticPrices, R: int) -> tuple[float, float, int]:
    """The draft's best block at ``R`` rows on this job: (its expected τ there, the τ a round of it must reach to
    beat a plain step, the block)."""
    surv = torch.cumprod(job.draft_rates(), 0)
    best = max(range(2, job.slots + 2), key=lambda b: (1 + float(surv[: b - 1].sum()))
               / break_even(prices, R, b - 1, b))
    return 1 + float(surv[: best - 1].sum()), break_even(prices, R, best - 1, best), best


def explain(job: JobAcceptance, prices: LivePrices | StaticPrices, draft_on: bool, rows: int,
            row_rounds: int, retired: int | None = None, retired_rows: int = 0) -> dict[str, dict]:
    """Per source (``dspine``, ``suffix``, ``forced``): {rounds, proposed, accepted, ran, why, stopped}; ``why`` only
    for a source that led no round, or the draft once retired (``stopped``). ``rows``: the stream's nominal rows (used
    when no round was priced yet); ``row_rounds``: rounds x rows run so far (kept for callers; a source that ran is
    its counts, however few); ``retired``: the round the draft was retired at (``rounds.retire_draft``; 0: before the
    first prefill, at ``retired_rows`` rows, ``rounds.retire_before_prefill``), if it was."""
    R = _typical_rows(prices, rows)
    out: dict[str, dict] = {}
    for name in ("dspine", "suffix", "forced"):
        rounds, proposed, accepted = job.totals[name]
        stopped = name == "dspine" and retired is not None
        out[name] = {"rounds": rounds, "proposed": proposed, "accepted": accepted, "ran": rounds > 0, "why": None,
                     "stopped": stopped}
        if rounds and not stopped:
            continue  # it ran: its counts say what it did
        if name == "dspine":
            if not draft_on:
                why = "no DSpine draft in this run"
            elif job.slots <= 0:
                why = "the draft's block is 1 (nothing to propose)"
            else:
                at = (retired_rows or R) if retired == 0 else R  # before the prefill: the rows it was decided at
                tau, need, best = draft_outlook(job, prices, at)
                if retired == 0:
                    why = (f"retired before the first prefill: at {at} rows a round of its block {best} must reach "
                           f"tau {need:.2f} to beat a plain step on this CPU, and the cost model's estimate of its "
                           f"tau there is {tau:.2f} (from its prior acceptance), so no prompt was run through it")
                elif retired is not None and tau >= need:
                    why = (f"retired after round {retired}: the plan did not take it for many rounds in a row "
                           f"(the cost model's estimate of its tau, {tau:.2f} at block {best}, against the {need:.2f} "
                           f"a round needs at {R} rows: its rows took suffix proposals or plain steps), so its "
                           "context was no longer kept")
                elif retired is not None:
                    why = (f"retired after round {retired}: the cost model's estimate of its tau, {tau:.2f} at block "
                           f"{best} (acceptance pooled over this job, its prior included), stayed below the "
                           f"{need:.2f} a round of it must reach to beat a plain step at {R} rows on this CPU, so its "
                           "context was no longer kept")
                elif tau < need:
                    why = (f"the cost model's estimate of its tau, {tau:.2f} at block {best} (acceptance pooled over "
                           f"this job), is below the {need:.2f} a round of it must reach to beat a plain step at {R} "
                           "rows on this CPU")
                else:
                    why = (f"the cost model's estimate of its tau, {tau:.2f} at block {best}, beats the {need:.2f} a "
                           "round needs, but its rows were sampled (the draft runs for greedy rows only under "
                           "proposers=auto) or took suffix proposals")
        elif name == "forced":
            why = "no row's grammar forced a token (no row had a grammar, or none left a single continuation)"
        else:
            if not job.suggested:
                why = "no row's text repeated text already seen (no proposal)"
            else:
                rate = job.suffix_rate()
                need = break_even(prices, R, 1)
                why = (f"the cost model's estimate of its proposals' acceptance ({rate:.2f} a token, pooled over this "
                       f"job) did not pay for the {need:.2f} a one-token verify must reach at {R} rows on this CPU")
        out[name]["why"] = why
    return out
