"""How many drafted tokens each row verifies this round: cost-aware dynamic verification (the DSpark idea).

Each round, for each row, choose ℓ ∈ {0, …, block−1} to maximise expected committed tokens per second:

    tokens(ℓ) = 1 + Σ_{j≤ℓ} a_j        (a_j = probability that drafts 1..j are all accepted: the survival)
    time(ℓ)   = target(rows, width + 1) + [width > 0] · draft(rows, width + 1)

where ``width`` is the longest ℓ in the batch (one ragged forward pads every row to it) and the two times come
from ``cost.CostModel``. ℓ = 0 is a plain decode step; when every row picks 0 the draft is not run.

The survival ``a_j`` comes from two places. Before the draft runs (deciding whether to run it, and how long a
block), only the row's own history is known: ``History`` keeps per-slot accept counts per row (a Beta prior
pulled back in while the row is not speculating, so a row that stopped drafting tries again later). After the
draft ran, a trained confidence head gives ``c_i`` along the drafted path and ``a_j = Π_{i≤j} c_i``.

Losslessness (docs/design.md, "Verification and sampling"): ℓ must be a stopping time, i.e. whether slot j+1 is
verified may depend only on what is known before x_{j+1} is drawn. History is the past; ``c_{j+1}`` is computed
from x_{≤j}; the rules below take the leading run of improvements ("stop at the first non-improvement"), never a
maximum over the finished block, so each row's ℓ is a stopping time.

Greedy rows (T = 0) take a batch-wide choice: any truncation is exact at T = 0, so the width maximising the
batch's tokens per second is used directly. Sampled rows take a rule that is a function of the row alone — its
history, its own draft path, and the cost model evaluated at the stream's nominal ``batch_size`` — so a sampled
request's tokens for a given seed do not depend on which rows share its batch or when it joined (they do
depend on the cost model, i.e. on the machine the calibration ran on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspine.decoding.cost import CostModel
from dspine.decoding.prices import EXPLORE_SLACK

PRIOR_ACCEPT = 0.6  # prior per-slot acceptance (given the previous slot was accepted)
PRIOR_WEIGHT = 3.0  # in pseudo-trials
FORGET = 0.9  # evidence kept per round in which a row did not verify (pulls it back to the prior)


@dataclass
class History:
    """Per-row, per-slot acceptance evidence [rows, block-1] (CPU, float): trials and hits of slot j."""

    trials: torch.Tensor
    hits: torch.Tensor
    prior: float = PRIOR_ACCEPT  # per-slot acceptance assumed before evidence (a draft's measured one, if known)

    @staticmethod
    def empty(rows: int, slots: int, prior: float | None = None) -> History:
        return History(torch.zeros(rows, slots), torch.zeros(rows, slots), PRIOR_ACCEPT if prior is None else prior)

    def select(self, idx: list[int]) -> History:
        return History(self.trials[idx], self.hits[idx], self.prior)

    def assign(self, slots: list[int], other: History) -> None:
        self.trials[slots] = other.trials
        self.hits[slots] = other.hits

    @staticmethod
    def concat(parts: list[History]) -> History:
        return History(torch.cat([p.trials for p in parts]), torch.cat([p.hits for p in parts]), parts[0].prior)

    def survival(self, prior: torch.Tensor | None = None) -> torch.Tensor:
        """a [rows, slots]: estimated probability that drafts 1..j+1 are all accepted. ``prior`` [slots]: the
        per-slot rates a row without evidence is shrunk towards (the job's pooled ones,
        ``acceptance.JobAcceptance``); default the fixed ``self.prior``."""
        p = self.prior if prior is None else prior[None, : self.trials.shape[1]]
        rate = (self.hits + p * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)
        return rate.cumprod(-1)

    def update(self, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """verified ℓ [rows], accepted [rows] (CPU longs): slot j was tried when j < ℓ and slots < j passed."""
        j = torch.arange(self.trials.shape[1])[None, :]
        tried = (j < verified[:, None]) & (j <= accepted[:, None])
        idle = (verified == 0)[:, None]
        self.trials = torch.where(idle, self.trials * FORGET, self.trials + tried.float())
        self.hits = torch.where(idle, self.hits * FORGET, self.hits + (j < accepted[:, None]).float())


def _leading_improvements(obj: torch.Tensor) -> torch.Tensor:
    """obj [rows, n+1] -> ℓ [rows]: how many steps obj[:, 0] -> obj[:, 1] -> ... improve before the first that
    does not (the stopping-time form of "maximise")."""
    if obj.shape[1] == 1:
        return torch.zeros(obj.shape[0], dtype=torch.long, device=obj.device)
    better = obj[:, 1:] > obj[:, :-1]
    return better.long().cumprod(-1).sum(-1)


def _tokens(a: torch.Tensor) -> torch.Tensor:
    """a [rows, n] survival -> expected committed tokens [rows, n+1] for ℓ = 0..n."""
    zero = torch.zeros(a.shape[0], 1, dtype=a.dtype, device=a.device)
    return 1.0 + torch.cat([zero, a.cumsum(-1)], dim=-1)


def row_rule(
    a: torch.Tensor, cost: CostModel, nominal_rows: int, sunk_blocks: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row ℓ from the row's own survival a [rows, n] at ``nominal_rows``: tokens/s improving left to right.

    ``sunk_blocks`` [rows] (after the draft ran): the block each row itself chose before drafting; its draft
    time is paid whatever ℓ is (the row's own choice, not the batch's, so the rule stays a function of the row).
    """
    n = a.shape[1]
    secs = torch.tensor([cost.target_s(nominal_rows, ell + 1) for ell in range(n + 1)], dtype=a.dtype)[None, :]
    if sunk_blocks is None:
        draft = torch.tensor([0.0] + [cost.draft_s(nominal_rows, ell + 1) for ell in range(1, n + 1)], dtype=a.dtype)
        secs = secs + draft[None, :]
    else:
        by_block = torch.tensor([0.0, 0.0] + [cost.draft_s(nominal_rows, b) for b in range(2, n + 2)], dtype=a.dtype)
        secs = secs + by_block[sunk_blocks.clamp(0, n + 1)][:, None]
    return _leading_improvements(_tokens(a) / secs.to(a.device))


def batch_width(
    a: torch.Tensor, floor: int, fixed_tokens: float, cost: CostModel, rows: int, sunk_block: int | None = None
) -> int:
    """Greedy rows' common ℓ (>= ``floor``, the sampled rows' widest): argmax of the batch's tokens/s.

    a [greedy rows, n] survival; ``fixed_tokens`` the sampled rows' expected tokens (their ℓ is set).
    """
    n = a.shape[1]
    tok = _tokens(a).sum(0).tolist() if a.shape[0] else [0.0] * (n + 1)
    best, best_obj = floor, -1.0
    for w in range(floor, n + 1):
        t = cost.target_s(rows, w + 1)
        if sunk_block is not None:
            t += cost.draft_s(rows, sunk_block)
        elif w:
            t += cost.draft_s(rows, w + 1)
        obj = (tok[w] + fixed_tokens) / t
        if obj > best_obj:
            best, best_obj = w, obj
    return best


def plan(
    a: torch.Tensor, greedy: torch.Tensor, cost: CostModel, nominal_rows: int, cap: torch.Tensor | None = None,
    sunk_block: int | None = None, row_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """ℓ [rows] (CPU long) for survival a [rows, n] (CPU): sampled rows by ``row_rule``, greedy rows by
    ``batch_width``; ``cap`` [rows] bounds ℓ (the draft's own stop, or the pre-draft plan). After the draft ran,
    ``sunk_block`` is the block it drafted (greedy rows) and ``row_blocks`` [rows] each row's own pre-draft
    block (sampled rows)."""
    rows, n = a.shape
    ell = torch.zeros(rows, dtype=torch.long)
    sampled = ~greedy
    if bool(sampled.any()):
        own = None if row_blocks is None else row_blocks[sampled]
        ell[sampled] = row_rule(a[sampled], cost, nominal_rows, own)
        if cap is not None:
            ell = torch.minimum(ell, cap)
    floor = int(ell.max()) if rows else 0
    fixed = float(_tokens(a[sampled]).gather(1, ell[sampled][:, None]).sum()) if bool(sampled.any()) else 0.0
    if bool(greedy.any()):
        if cap is not None and bool(greedy.any()):
            # a greedy row's survival beyond its cap is zero: it cannot verify more than it has
            j = torch.arange(n)[None, :]
            a = torch.where(j < cap[:, None], a, torch.zeros_like(a))
        w = batch_width(a[greedy], floor, fixed, cost, rows, sunk_block)
        ell[greedy] = w if cap is None else torch.clamp(cap[greedy], max=w)
    return ell


# -- two sources: the DSpine draft and suffix proposals --------------------------------------------------------

PLAIN, DRAFT, SUFFIX, FORCED = 0, 1, 2, 3  # what a row verifies this round (FORCED: its grammar's forced tokens,
SOURCE_NAMES = ("plain", "dspine", "suffix", "forced")  # then maybe a suffix match chained after them)


@dataclass
class SourcePlan:
    """One round's choice: per row the source and ℓ; whether the draft runs and with what block."""

    source: torch.Tensor  # [rows] long: PLAIN / DRAFT / SUFFIX
    ell: torch.Tensor  # [rows] long: tokens verified (0 for PLAIN)
    draft_block: int  # block the draft proposes (0: the draft does not run this round)
    explore: bool = False  # chosen to refresh a price (``prices.EXPLORE_EVERY``), not because it prices best
    rate: float = 0.0  # the verify's priced tokens per second (0 for a plain plan): checked against the outcome


def _hurdle(prices, R: int) -> float:
    """How far above a plain step's rate a verify must be priced to run (``prices.LivePrices.hurdle``:
    hysteresis); 1 for prices objects without one."""
    hurdle = getattr(prices, "hurdle", None)
    return 1.0 if hurdle is None else float(hurdle(R))


def _plain_plan(rows: int) -> SourcePlan:
    return SourcePlan(torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long), 0)


def plan_sources(
    a_draft: torch.Tensor | None, a_suffix: torch.Tensor, greedy: torch.Tensor, prices
) -> SourcePlan:
    """Choose per row between a plain step, the draft's block and the row's suffix proposal, by expected committed
    tokens per second, for a target whose verify pads every row to the widest (``prices.packed`` false: hybrids,
    torch's GEMMs); a_draft [rows, n_d] (the draft's pre-draft survival, None without a draft), a_suffix
    [rows, n_s] (the suffix proposal's estimated survival, 0 past its length); ``prices``: ``prices.LivePrices``
    or ``StaticPrices``.

    Every row's tokens are exact whatever ℓ it verifies: a greedy row's under any truncation, a sampled row's
    suffix proposal is a point mass verified with the uniforms plain decoding draws (``verify.accept``), so it
    commits exactly plain decoding's tokens for its seed. The choice can therefore be batch-wide: the verify
    width W and whether the draft runs are those that maximise the batch's expected tokens per second, and each
    row verifies as much of its better proposal as fits in W. (Sampled rows never take the draft here: its
    sampled rounds commit tokens that depend on what it proposed; they use it with ``proposers="dspine"``.) An
    earlier rule let each sampled row choose alone at ``nominal_rows``, which ignored that one row's width is
    paid by every row of the forward: at 8-32 rows of ``--num-samples`` siblings it ran wide verifies that one
    row gained from (0.82-0.88x plain).
    """
    rows, n_s = a_suffix.shape
    n_d = 0 if a_draft is None else a_draft.shape[1]
    if rows == 0 or (not bool(a_suffix.any()) and (a_draft is None or not bool(greedy.any()))):
        return _plain_plan(rows)  # nothing to propose: a plain step (the common round, planned cheaply)
    if prices.plain_due(rows):
        return _plain_plan(rows)
    tok_s = _tokens(a_suffix)  # [rows, n_s + 1]
    top = max(n_s, n_d)
    widths = torch.arange(top + 1)
    t_secs = torch.cat([torch.tensor([prices.round_s(rows, 0)], dtype=torch.float64),
                        torch.from_numpy(prices.round_many(rows, (widths[1:] * rows).numpy()))])
    d_secs = torch.tensor([prices.draft_s(rows, min(w, n_d) + 1) if w and n_d else 0.0 for w in range(top + 1)],
                          dtype=torch.float64)
    ts = tok_s[:, widths.clamp(max=n_s)]  # [rows, top + 1]: a row's expected suffix tokens at width w
    options = [(ts, torch.zeros(top + 1, dtype=torch.float64), 0)]
    g = greedy[:, None]
    if a_draft is not None and bool(greedy.any()):  # the draft runs a block of min(w, n_d) + 1; greedy rows
        td = _tokens(a_draft)[:, widths.clamp(max=n_d)]  # take their better source, sampled rows their suffix
        options.append((torch.where(g, torch.maximum(ts, td), ts), d_secs, 1))
    plain_rate = float(ts[:, 0].sum()) / float(t_secs[0])
    best_obj, w, block = -1.0, 0, 0
    for per_row, extra_secs, on in options:
        obj = per_row.sum(0).double() / (t_secs + extra_secs)
        obj[0] = -1.0  # width 0 is the plain step, priced above
        o, x = float(obj.max()), int(obj.argmax())  # argmax: ties keep the narrower width (first maximum)
        if o > best_obj:
            best_obj, w, block = o, x, (min(x, n_d) + 1 if on else 0)
    bar = plain_rate * _hurdle(prices, rows)
    explore = best_obj <= bar and prices.explore_due(rows) and best_obj >= (1 - EXPLORE_SLACK) * plain_rate
    if best_obj <= bar and not explore:
        return _plain_plan(rows)
    ts_w = tok_s[:, min(w, n_s)]
    td_w = _tokens(a_draft)[:, min(w, n_d)] if block else torch.zeros_like(ts_w)
    pick_d = greedy & (td_w > ts_w) & (td_w > 1.0)
    pick_s = ~pick_d & (ts_w > 1.0)
    source = torch.where(pick_d, DRAFT, torch.where(pick_s, SUFFIX, PLAIN))
    # ℓ: as far as the row's own proposal goes within the width (the draft's block caps its rows)
    own = torch.clamp((a_suffix > 0).sum(-1), max=w)
    ell = torch.where(pick_d, min(w, n_d), torch.where(pick_s, own, 0))
    draft_block = block if bool(pick_d.any()) else 0
    return SourcePlan(source, ell, draft_block, explore, best_obj)


def plan_packed(
    a_draft: torch.Tensor | None, a_suffix: torch.Tensor, greedy: torch.Tensor, live: torch.Tensor, prices
) -> SourcePlan:
    """The same choice for a target whose verify costs its real tokens (``prices.packed``: a dense target on the
    CPU kernels computes only each row's ``1 + ℓ`` tokens). A round then costs ``round(R, k)`` for ``k = Σ ℓ``
    (plus the draft's block when it runs), so rows no longer pay for each other's width and each proposed token
    is worth its own survival: every token of every row's proposal is a candidate, taken in order of survival
    (a row's survival falls along its proposal, so a row always takes a leading run), and the count k that
    maximises expected committed tokens per second, ``(R + Σ taken survival) / time(k)``, wins against the plain
    step's ``R / time(0)``. With the draft, each block size is tried: its greedy rows take the draft's curve
    where its expected tokens beat their suffix proposal's. ``live`` [rows] marks the rows still decoding (finished
    rows kept in place compute nothing). Tokens stay exact for any choice (see ``plan_sources``).

    Planned every round, so it is numpy on small arrays, and most rounds end at a bound: with prices on a line
    (``base + jump + per * k``), k tokens of total survival ``S_k <= min(k * a_max, S)`` pay only if
    ``S_k * base > R * (jump + per * k)``, which ``a_max * base <= R * per`` or ``S * base <= R * (jump + per)``
    rule out for every k (free text at 8 rows on a CPU: most rounds)."""
    rows, n_s = a_suffix.shape
    n_d = 0 if a_draft is None else a_draft.shape[1]
    lv = live.numpy()
    R = int(lv.sum())
    s_cur = a_suffix.numpy() * lv[:, None]
    dg = greedy.numpy() & lv
    use_draft = a_draft is not None and n_d > 0 and bool(dg.any())
    if R == 0 or prices.plain_due(R):
        return _plain_plan(rows)
    d_cur = a_draft.numpy() * dg[:, None] if use_draft else None
    a_max = max(float(s_cur.max()) if s_cur.size else 0.0, float(d_cur.max()) if use_draft else 0.0)
    if a_max <= 0:
        return _plain_plan(rows)
    explore = prices.explore_due(R)
    line = prices.line(R)
    if line is not None and not explore:
        base, jump, per = line
        total = float(s_cur.sum()) + (float(d_cur.sum()) if use_draft else 0.0)
        if a_max * base <= R * per or total * base <= R * (jump + per):
            return _plain_plan(rows)  # no count of tokens can pay (see the docstring)
    plain_rate = R / prices.round_s(R, 0)
    width = max(n_s, n_d)
    best: tuple[float, int, np.ndarray, np.ndarray, float] | None = None
    for block in [0] + (list(range(2, n_d + 2)) if use_draft else []):
        curve = np.zeros((rows, width))
        curve[:, :n_s] = s_cur
        take_d = np.zeros(rows, dtype=bool)
        if block:
            d = np.zeros((rows, width))
            d[:, : block - 1] = d_cur[:, : block - 1]
            take_d = dg & (d.sum(-1) > curve.sum(-1))
            curve[take_d] = d[take_d]
        vals = curve[curve > 0]
        if not vals.size:
            continue
        vals = -np.sort(-vals)
        ks = np.arange(1, vals.size + 1)
        rates = (R + np.cumsum(vals)) / (prices.round_many(R, ks) + prices.draft_s(R, block))
        i = int(rates.argmax())
        if best is None or float(rates[i]) > best[0]:
            best = (float(rates[i]), block, curve, take_d, float(vals[i]))
    if best is None:
        return _plain_plan(rows)
    rate, block, curve, take_d, thr = best
    bar = plain_rate * _hurdle(prices, R)
    explore = rate <= bar and explore and rate >= (1 - EXPLORE_SLACK) * plain_rate
    if rate <= bar and not explore:
        return _plain_plan(rows)
    ell = torch.from_numpy(((curve >= thr) & (curve > 0)).sum(-1).astype(np.int64))
    take = torch.from_numpy(take_d)
    source = torch.where(ell > 0, torch.where(take, DRAFT, SUFFIX), PLAIN)
    on = source == DRAFT
    draft_block = int(ell[on].max()) + 1 if bool(on.any()) else 0
    return SourcePlan(source, ell, draft_block, explore, rate)
