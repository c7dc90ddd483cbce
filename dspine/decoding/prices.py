"""What a round costs on this machine now: prices from the job's own rounds, seeded by the calibration.

A calibration (``cost.py``) is taken once, before the job, on other shapes and in other weather; what a job's
rounds really cost depends on the rows in flight, the kernels, the thread governor, the neighbours on a shared
machine and the bookkeeping each kind of round does in Python. Measured on the 2-core EPYC of issue 35, a
calibrated model underestimated a round by ~1.5x and did not see that a verify of one extra token per row costs
more than a plain step's share (the bf16 GEMM leaves its 8-row register tiles at the 9th token). So every round
is timed as it runs, end to end (planning, proposals, forward, logits, verification, bookkeeping), and the
prices the planner reads are fitted to those times as the job goes:

    round(R, k) = base(R) + jump(R) * [k > 0] + slope(R) * k

``R`` live rows in the forward, ``k`` verified tokens beyond one per row (a plain step has k = 0; a packed verify
``Σ ℓ``; a padded one ``R * W``). Per ``R`` the three numbers are a weighted least-squares fit over every round
timed at ``R``, plain and verify alike, each observation's weight halving after ``HALF_LIFE`` newer ones, so the
prices follow a machine that gets busier or quieter; ``jump`` and ``slope`` are kept >= 0 (more tokens never
cost less). A row count not seen yet starts from pseudo-points on the calibrated curve scaled by the job's
observed/calibrated ratio, worth ``PRIOR_ROUNDS`` observations, which the job's own rounds outweigh at once.
The draft's proposal is timed on its own and priced as its calibrated time times an observed ratio.

Prices never decide a token: they only choose between choices whose tokens are identical (see
``docs/design.md``, "Live prices"). Timing costs a few ``perf_counter`` calls and a handful of float operations
per round (measured with ``scripts/bench/bench_suffix.py --overhead``).

Bounded exploration: a choice that is not taken is not observed, so its price could go stale. When no verify
has run at the current ``R`` for ``EXPLORE_EVERY`` rounds, the planner may run the best speculative plan once
even though it prices it below a plain step, provided it prices it within ``EXPLORE_SLACK`` of it; so exploring
costs at most ``EXPLORE_SLACK / EXPLORE_EVERY`` (0.4 %) of the job's time on top of what the estimates get
wrong. The other way round, when every round has verified for ``EXPLORE_EVERY`` rounds, one plain step runs, so
the base every verify is priced against is re-timed: that forgoes at most one round's gain in ``EXPLORE_EVERY``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from dspine.decoding.cost import CostModel

HALF_LIFE = 24.0  # rounds: the weight of an observation halves after this many newer ones of its kind
PRIOR_ROUNDS = 2.0  # pseudo-observations behind the calibration's prices
EXPLORE_EVERY = 64  # rounds at one row count without any verify before one may be tried to refresh its price
EXPLORE_SLACK = 0.25  # an exploring round may be priced at most this much below a plain step's rate
ENTER_MARGIN = 0.03  # after a plain step, a verify must be priced this much above it (hysteresis: ``hurdle``)
OUTCOME_HALF_LIFE = 8.0  # verify rounds: the weight of a verify's outcome (realised / priced rate) halves after
OUTCOME_PRIOR = 4.0  # pseudo-verifies at "priced right" (ratio 1) behind the outcome check
OUTCOME_FLOOR = 0.5  # the outcome check raises the hurdle at most to 1 / this
_OUTCOME_DECAY = 0.5 ** (1.0 / OUTCOME_HALF_LIFE)
_DECAY = 0.5 ** (1.0 / HALF_LIFE)


class _Fit:
    """Weighted least squares of a round's seconds on ``[1, [k > 0], k]`` (plain base, a verify's fixed
    surcharge, a verified token's price) over exponentially decayed observations: sums of ``x xᵀ`` and ``x y``."""

    __slots__ = ("xx", "xy")

    def __init__(self) -> None:
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xy = [0.0] * 3

    def add(self, k: float, y: float, w: float = 1.0, decay: float = 1.0) -> None:
        x = (1.0, 1.0 if k > 0 else 0.0, float(k))
        for i in range(3):
            self.xy[i] = self.xy[i] * decay + w * x[i] * y
            for j in range(3):
                self.xx[i][j] = self.xx[i][j] * decay + w * x[i] * x[j]

    def solve(self, prior: _Fit | None = None) -> tuple[float, float, float]:
        """(base, jump, per-token) of these observations plus ``prior``'s, with jump and per-token >= 0: more
        tokens never cost less, so a fit that says so is noise; the sub-problem without the offending term is
        solved instead."""
        xx = [[self.xx[i][j] + (prior.xx[i][j] if prior else 0.0) for j in range(3)] for i in range(3)]
        xy = [self.xy[i] + (prior.xy[i] if prior else 0.0) for i in range(3)]
        for free in ((0, 1, 2), (0, 2), (0, 1), (0,)):
            theta = _solve([[xx[i][j] for j in free] for i in free], [xy[i] for i in free])
            if theta is None:
                continue
            full = [0.0, 0.0, 0.0]
            for i, v in zip(free, theta):
                full[i] = v
            if full[1] >= 0 and full[2] >= 0:
                return full[0], full[1], full[2]
        return 0.0, 0.0, 0.0


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a tiny system; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-18:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class _RowsPrice:
    """Prices at one live-row count ``R``: the fit, and how long since each kind of round was timed."""

    fit: _Fit
    since_verify: int = 0  # rounds at this R since a verify last ran
    since_plain: int = 0  # rounds at this R since a plain step last ran
    theta: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the fit, solved when read after an observation
    solve_at: float | None = None  # the job's ratio at the last observation, while theta is not solved for it
    look: float = 0.0  # seconds a round at this R spends looking for proposals and planning (decayed mean)
    look_w: float = 0.0
    outcome: float = OUTCOME_PRIOR  # decayed sums over verify rounds: realised / priced rate, and the weight
    outcome_w: float = OUTCOME_PRIOR


@dataclass
class LivePrices:
    """Live round prices (see the module docstring). ``packed``: a verify costs its real tokens (the target
    computes only valid tokens, ``layers.Packing``); otherwise every row pays the widest row's width."""

    cost: CostModel
    packed: bool
    rows: dict[int, _RowsPrice] = field(default_factory=dict)
    ratio: float = 1.0  # observed / calibrated plain-round time, job-wide (prices rows counts not seen yet)
    ratio_w: float = 0.0
    draft_ratio: float = 1.0  # observed / calibrated draft proposal time
    draft_ratio_w: float = 0.0
    rounds: int = 0

    # -- the calibration's view, as prices -------------------------------------------------------------------

    def _cal_round(self, R: int, k: int) -> float:
        """The calibrated time of a forward at ``R`` rows with ``k`` extra tokens (spread over the rows as the
        calibration measured them: padded rows of ``1 + k / R`` tokens)."""
        return self.cost.target_s(R, 1.0 + k / max(R, 1))

    def _prior(self, R: int, ratio: float | None = None) -> _Fit:
        """Pseudo-points on the calibrated curve at ``R``, at the job's observed scale (``ratio``, default the
        current one), worth ``PRIOR_ROUNDS`` rounds: the shape a row count starts from, and what a fit with few
        points leans on. They do not decay: the job's rounds (worth up to ``1 / (1 - decay)`` ~ 35 at a time)
        outweigh them."""
        fit = _Fit()
        ratio = self.ratio if ratio is None else ratio
        for k in (0, R, 4 * R):
            fit.add(float(k), self._cal_round(R, k) * ratio, PRIOR_ROUNDS / 3)
        return fit

    def _theta(self, R: int, p: _RowsPrice) -> tuple[float, float, float]:
        """The fit at ``R``, solved on first read after observations (with the prior of the last one's ratio: the
        numbers an eager solve after each observation gave). Why lazily: a quiet stream observes every round
        and reads no price; the solve and its prior were ~0.4 % of such a stream."""
        if p.solve_at is not None:
            p.theta, p.solve_at = p.fit.solve(self._prior(R, p.solve_at)), None
        return p.theta

    def _start(self, R: int) -> _RowsPrice:
        return _RowsPrice(_Fit(), solve_at=self.ratio)  # the prior alone, solved when first read (``_theta``)

    def _at(self, R: int) -> _RowsPrice:
        p = self.rows.get(R)
        if p is None:
            p = self.rows[R] = self._start(R)
        return p

    # -- prices ----------------------------------------------------------------------------------------------

    def round_s(self, R: int, k: int | float) -> float:
        """Seconds of a round at ``R`` live rows verifying ``k`` tokens beyond one per row. A verify also pays the
        looking for proposals and planning (``look``): a round that verifies keeps the stream looking every round
        (``rounds._quiet_round`` starts only after rounds that verify nothing), so the looking is the verify's
        cost, not a plain step's."""
        base, jump, per = self.line(R)
        return max(base + (jump + per * k if k > 0 else 0.0), 1e-6)

    def round_many(self, R: int, ks: np.ndarray) -> np.ndarray:
        """``round_s`` for an array of k (all > 0)."""
        base, jump, per = self.line(R)
        return np.maximum(base + jump + per * np.asarray(ks, dtype=np.float64), 1e-6)

    def line(self, R: int) -> tuple[float, float, float]:
        """(base, jump, per-token) at ``R``: ``round_s(R, k) = base + jump + per * k`` for k > 0; ``jump`` holds
        the looking."""
        p = self._at(R)
        base, jump, per = self._theta(R, p)
        return base, jump + p.look, per

    def draft_s(self, R: int, block: int) -> float:
        return self.cost.draft_s(R, block) * self.draft_ratio if block > 1 else 0.0

    def hurdle(self, R: int) -> float:
        """How much better than a plain step a verify must be priced at ``R`` to run: ``1 + ENTER_MARGIN`` when the
        last round timed at ``R`` was a plain step (or none was), 1 when it verified. Hysteresis: a verify priced
        a hair above a plain step (its gain within the prices' own noise) does not start speculation, so one
        noisy round cannot flip a stream between plain steps and verifies; while verifies run and pay they go on
        at any priced gain."""
        p = self._at(R)
        enter = 1.0 if p.since_plain > 0 and p.since_verify == 0 else 1.0 + ENTER_MARGIN
        return enter / self.outcome(R)

    def outcome(self, R: int) -> float:
        """What verifies at ``R`` realised against what they were priced at (committed tokens per second over the
        plan's priced rate), a decayed mean over the last verify rounds (``OUTCOME_HALF_LIFE``) shrunk towards 1,
        at most 1 and at least ``OUTCOME_FLOOR``. Below 1 (verifies priced as paying that did not) it raises the
        hurdle every verify must clear, within a few verify rounds; it never lowers it (that is the estimates'
        own calibration, ``acceptance.JobAcceptance.suffix_scale``, and the fitted prices)."""
        p = self._at(R)
        return min(1.0, max(OUTCOME_FLOOR, p.outcome / p.outcome_w))

    def explore_due(self, R: int) -> bool:
        """No verify has run at ``R`` for ``EXPLORE_EVERY`` rounds: one may run to refresh its price."""
        return self._at(R).since_verify >= EXPLORE_EVERY

    def plain_due(self, R: int) -> bool:
        """No plain step has run at ``R`` for ``EXPLORE_EVERY`` rounds: one runs to refresh the base price that
        every verify is priced against (else a stale or mis-calibrated base could never be corrected)."""
        return self._at(R).since_plain >= EXPLORE_EVERY

    # -- observations ----------------------------------------------------------------------------------------

    def observe(self, R: int, k: int, seconds: float, draft_block: int = 0, draft_seconds: float = 0.0,
                look_seconds: float = 0.0, priced_rate: float = 0.0, committed: int = 0) -> None:
        """A round at ``R`` live rows that verified ``k`` extra tokens took ``seconds`` (the draft's proposal,
        when it ran with ``draft_block``, ``draft_seconds`` of them), and ``look_seconds`` more looking for
        proposals and planning (0: a quiet round that did not look). The looking is fitted apart and priced as a
        verify's (``round_s``): fitted with the rest, a job's mix of quiet and looking plain steps put a share of
        it in a plain step's base and the rest in a verify's surcharge, in proportions the job's quiet stretches
        set.
        ``priced_rate`` (a verify: the plan's priced tokens per second) and ``committed`` (the tokens the round
        committed) check the decision against what it gave (``outcome``)."""
        if R <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self.rounds += 1
        p = self._at(R)
        if look_seconds > 0 and math.isfinite(look_seconds):
            p.look_w = p.look_w * _DECAY + 1.0
            p.look += (look_seconds - p.look) / p.look_w
        if k > 0 and priced_rate > 0 and committed > 0:
            realised = committed / (seconds + max(look_seconds, 0.0))
            # decayed towards the prior's pseudo-verifies at ratio 1, so old outcomes fade into "priced right"
            keep = _OUTCOME_DECAY
            p.outcome = p.outcome * keep + OUTCOME_PRIOR * (1 - keep) + min(realised / priced_rate, 2.0)
            p.outcome_w = p.outcome_w * keep + OUTCOME_PRIOR * (1 - keep) + 1.0
        rest = max(seconds - draft_seconds, 1e-6)
        # the job's scale against the calibration, from every round (seeds row counts not timed yet)
        self.ratio_w = self.ratio_w * _DECAY + 1.0
        self.ratio += (rest / self._cal_round(R, max(k, 0)) - self.ratio) / self.ratio_w
        p.fit.add(float(max(k, 0)), rest, 1.0, _DECAY)
        p.solve_at = self.ratio  # solved when a price is read (``_theta``)
        if k <= 0:
            p.since_verify += 1
            p.since_plain = 0
        else:
            p.since_verify = 0
            p.since_plain += 1
        if draft_block > 1 and draft_seconds > 0:
            cal = self.cost.draft_s(R, draft_block)
            if cal > 0:
                self.draft_ratio_w = self.draft_ratio_w * _DECAY + 1.0
                self.draft_ratio += (draft_seconds / cal - self.draft_ratio) / self.draft_ratio_w

    def summary(self) -> dict:
        """What the prices say now (for logs and the report): per row count, a plain round's ms, a verify's fixed
        surcharge and a verified token's price (ms)."""
        out = {}
        for R, p in sorted(self.rows.items()):
            base, jump, per = self._theta(R, p)
            out[R] = {"plain_ms": round(1e3 * base, 3), "verify_ms": round(1e3 * jump, 3),
                      "token_ms": round(1e3 * per, 4), "look_ms": round(1e3 * p.look, 4),
                      "outcome": round(self.outcome(R), 3)}
        return {"rows": out, "draft_ratio": round(self.draft_ratio, 3), "rounds": self.rounds}


@dataclass
class StaticPrices:
    """The calibration's prices alone, fixed (tests; rules that must not read live prices). ``round_s`` spreads
    ``k`` over the rows as the calibration measured (padded rows of ``1 + k / R`` tokens)."""

    cost: CostModel
    packed: bool = False

    def round_s(self, R: int, k: int | float) -> float:
        return self.cost.target_s(R, 1.0 + max(k, 0) / max(R, 1))

    def round_many(self, R: int, ks: np.ndarray) -> np.ndarray:
        return np.array([self.round_s(R, float(k)) for k in np.asarray(ks).tolist()], dtype=np.float64)

    def line(self, R: int) -> None:
        """No straight line (the calibration's curve is piecewise): planners price every k."""
        return None

    def draft_s(self, R: int, block: int) -> float:
        return self.cost.draft_s(R, block) if block > 1 else 0.0

    def explore_due(self, R: int) -> bool:
        return False

    def hurdle(self, R: int) -> float:
        """No hysteresis: a verify runs whenever it is priced above a plain step (decisions read nothing live)."""
        return 1.0

    def plain_due(self, R: int) -> bool:
        return False

    def observe(self, *args, **kwargs) -> None:
        pass


class Stopwatch:
    """``perf_counter`` marks of one round: its start, the seconds spent in the draft's proposal, those spent on the
    draft's context upkeep (paid whichever choice is made, so priced as neither: left out) and those spent
    looking for proposals and planning (``look_s``: fitted apart and priced as a verify's, ``LivePrices.observe``)."""

    __slots__ = ("t0", "draft_s", "upkeep_s", "look_s", "priced", "committed")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.draft_s = 0.0
        self.upkeep_s = 0.0
        self.look_s = 0.0  # looking for proposals and planning (``rounds.mixed_round``): paid before the choice
        self.priced = 0.0  # the round's verify, as priced by the plan (tokens per second; 0: a plain step)
        self.committed = 0  # tokens the round's verify committed

    def elapsed(self) -> float:
        """The round's seconds, upkeep left out."""
        return time.perf_counter() - self.t0 - self.upkeep_s
