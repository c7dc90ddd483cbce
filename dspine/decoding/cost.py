"""What a decoding round costs on this machine: the target forward and the draft proposal, measured.

Cost-aware verification (``schedule.py``) trades expected committed tokens against time, so it needs the time
of a target forward over ``rows x tokens`` (a ragged verify pads every row to the longest) and of a draft
proposal of a given block size. Both are measured at start-up at the four corners rows in {1, R} x tokens in
{1 or 2, block} and interpolated bilinearly (``a + b*rows + c*tokens + d*rows*tokens``, exact at the corners,
linear beyond them): small CPU forwards are weight-bandwidth bound (flat in tokens) and large ones compute
bound (linear in rows x tokens), which the corners capture well enough to rank choices.

Calibration takes a few timed forwards (minimum of repeats, about a second for a small model) and is cached on
disk under ``$DSPINE_CACHE_DIR/cost`` (default ``~/.cache/dspine/cost``), keyed by the model identity the
caller gives, the CPU model, the thread count, the dtype and the calibrated shape, so a second run skips it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspine.cpu.disk_cache import atomic_write, cache_root
from dspine.cpu.kernels import sources_digest

CALIBRATION_CONTEXT = 32  # context tokens per row during calibration (short: attention is not what we rank)
MAX_CALIBRATION_ROWS = 32  # beyond this the cost is extrapolated linearly in rows


@dataclass(frozen=True)
class Grid:
    """Seconds measured at rows in {r0, r1} x tokens in {t0, t1[, t2]}: ``s[i][j]`` at (rows_i, tokens_j).

    Bilinear between the corners; in tokens piecewise linear over the measured points (a third point, when
    measured, covers verifies longer than the draft's block: suffix proposals)."""

    rows: tuple[int, int]
    tokens: tuple[int, ...]
    s: tuple[tuple[float, ...], tuple[float, ...]]

    def __call__(self, rows: int, tokens: int) -> float:
        def frac(x: float, lo: int, hi: int) -> float:
            return 0.0 if hi == lo else (x - lo) / (hi - lo)

        j = 0
        while j + 2 < len(self.tokens) and tokens > self.tokens[j + 1]:
            j += 1  # the segment [tokens[j], tokens[j+1]] holding ``tokens`` (or extrapolated from the last one)
        fr, ft = frac(rows, *self.rows), frac(tokens, self.tokens[j], self.tokens[j + 1])
        a, b = self.s[0][j], self.s[0][j + 1]
        c, d = self.s[1][j], self.s[1][j + 1]
        low = a + (b - a) * ft
        high = c + (d - c) * ft
        return max(1e-6, low + (high - low) * fr)


@dataclass(frozen=True)
class CostModel:
    """Seconds of one target forward (with logits) and one draft proposal, as functions of the batch shape."""

    target: Grid
    draft: Grid | None

    def target_s(self, rows: int, tokens: int) -> float:
        return self.target(rows, tokens)

    def draft_s(self, rows: int, block: int) -> float:
        return 0.0 if self.draft is None else self.draft(rows, block)

    @staticmethod
    def flat(target_s: float = 1.0, per_token_s: float = 0.0, draft_s: float = 0.0) -> CostModel:
        """A synthetic model (tests, or no calibration): target = target_s + per_token_s * rows * tokens."""
        t = Grid((1, 2), (1, 2), ((target_s + per_token_s, target_s + 2 * per_token_s),
                                  (target_s + 2 * per_token_s, target_s + 4 * per_token_s)))
        d = Grid((1, 2), (2, 3), ((draft_s, draft_s), (draft_s, draft_s)))
        return CostModel(t, d)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> CostModel:
        def grid(g: dict | None) -> Grid | None:
            if g is None:
                return None
            s = g["s"]
            return Grid(tuple(g["rows"]), tuple(g["tokens"]), (tuple(s[0]), tuple(s[1])))

        return CostModel(grid(d["target"]), grid(d.get("draft")))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best_of_each(fns: list, reps: int, budget_s: float) -> list[float]:
    """Minimum wall time of each of ``fns`` over up to ``reps`` rounds after one warm-up each (fewer when over
    budget). The shapes take turns within a round, so a burst of load from another process lands on all of them
    rather than on one corner of the grid (which would make its shape look cheap or dear next to the others)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    t_end = time.perf_counter() + budget_s
    for _ in range(reps):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return best


def _grid(rows: tuple[int, int], widths: tuple[int, ...], fn, reps: int, budget_s: float) -> Grid:
    """``fn(rows, width)`` timed at every corner (``_best_of_each``), made monotone (``_monotone``)."""
    shapes = [(n, t) for n in rows for t in widths]
    secs = _best_of_each([lambda n=n, t=t: fn(n, t) for n, t in shapes], reps, budget_s)
    w = len(widths)
    return _monotone(Grid(rows, widths, (tuple(secs[:w]), tuple(secs[w:]))))


def _monotone(g: Grid) -> Grid:
    """More rows or more tokens never cost less: a timing that says so was disturbed (another process took the
    cores during it), and a planner trusting it would verify wide because a wide forward "costs nothing". Each
    corner is raised to the largest time measured at a smaller shape."""
    s = [list(r) for r in g.s]
    for i in range(len(s)):
        for j in range(len(s[i])):
            if j:
                s[i][j] = max(s[i][j], s[i][j - 1])
            if i:
                s[i][j] = max(s[i][j], s[i - 1][j])
    return Grid(g.rows, g.tokens, (tuple(s[0]), tuple(s[1])))


@torch.no_grad()
def calibrate(target, draft, max_rows: int, block_size: int, reps: int = 3, budget_s: float = 2.0,
              long_tokens: int | None = None) -> CostModel:
    """Time the target forward (speculative, with taps and logits) and the draft proposal at the corners;
    ``long_tokens`` adds a third token count for the target (the longest suffix verify)."""
    dev = target.device
    R = max(1, min(int(max_rows), MAX_CALIBRATION_ROWS))
    T = max(2, int(block_size))
    widths = (1, T) if not long_tokens or long_tokens <= T else (1, T, int(long_tokens))
    C = max(CALIBRATION_CONTEXT, widths[-1])
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, target.vocab_size, (R, C), generator=g).to(dev)
    taps = tuple(draft.target_layer_ids) if draft is not None else ()
    per = budget_s / 8
    rows = (1, R)

    def fresh(n: int, cap: int):
        cache = target.new_cache(n, cap)
        out = target.forward(ctx[:n], cache, taps=taps)
        return cache, out

    caches = {n: fresh(n, C + 8 * widths[-1] * (reps + 2))[0] for n in set(rows)}

    def target_step(n: int, t: int):
        cache = caches[n]
        ids = ctx[:n, :t]
        out = target.forward(ids, cache, speculative=True, taps=taps)
        target.logits(out.hidden)
        target.commit(cache, torch.ones(n, dtype=torch.long, device=dev))

    tgt = _grid(rows, widths, target_step, reps, per * len(widths) * 2)
    if draft is None:
        return CostModel(tgt, None)
    dcaches = {}
    for n in set(rows):
        _, out = fresh(n, C)
        dc = draft.new_cache(n, C + T)
        draft.extend_context(dc, out.taps, torch.full((n,), C, dtype=torch.long, device=dev))
        dcaches[n] = dc
    temps = torch.zeros(R, dtype=torch.float32, device=dev)

    def draft_step(n: int, bs: int):
        draft.propose(dcaches[n], ctx[:n, -1], target, temps[:n], [None] * n, block_size=bs)

    drf = _grid(rows, (2, T), draft_step, reps, per * 4)
    return CostModel(tgt, drf)


def cache_dir() -> Path:
    return cache_root() / "cost"


CODE_MODULES = ("models/layers.py", "models/llama.py", "models/families.py", "models/qwen3_5.py", "models/gemma4.py",
                "models/cache.py", "models/target.py", "draft/model.py", "draft/proposal.py", "cpu/kernels.py")


def _code_version(here: Path | None = None) -> str:
    """A digest of the modules a forward's time depends on and of every kernel source (``kernels.sources_digest``:
    the fused layer, the vector helpers and the schedulers as much as the linears), so a change to the step
    invalidates old timings. A list of three kernel files here went stale once: a ``layer.cpp`` change made the 1-row
    step 1.16x faster and the old calibration still priced it (issue 53)."""
    here = here or Path(__file__).resolve().parents[1]  # dspine/
    digest = hashlib.sha256()
    for name in CODE_MODULES:
        try:
            digest.update(name.encode() + b"\0" + (here / name).read_bytes())
        except OSError:
            pass
    digest.update(b"kernels\0" + sources_digest().encode())
    return digest.hexdigest()[:12]


def cache_key(identity: dict, target, max_rows: int, block_size: int, long_tokens: int | None = None) -> str:
    """Everything the measured times depend on: models, CPU, threads, dtype, kernels, our code, the shape."""
    key = {
        "identity": identity,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "dtype": str(target.dtype),
        "device": str(target.device),
        "rows": max(1, min(int(max_rows), MAX_CALIBRATION_ROWS)),
        "block": int(block_size),
        "long": int(long_tokens or 0),
        "torch": torch.__version__,
        "kernel": getattr(target, "kernel", "torch"),
        "code": _code_version(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _busy() -> bool:
    """Is the machine busier than this process alone can make it (1-minute load above the cores + 0.5)? Timings
    taken then are disturbed (measured: a stale busy calibration made a c = 8 job 0.81x plain where a quiet one
    gave 1.16x), so they are not written to the cache."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) + 0.5
    except OSError:
        return False


def load_or_calibrate(target, draft, max_rows: int, block_size: int, identity: dict | None = None,
                      long_tokens: int | None = None) -> CostModel:
    """The cached model for this key, else a fresh calibration (written to the cache when ``identity`` is given;
    without one there is no safe key, so nothing is written)."""
    path = None
    if identity is not None:
        path = cache_dir() / f"{cache_key(identity, target, max_rows, block_size, long_tokens)}.json"
        try:
            return CostModel.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass
    busy = _busy()
    model = calibrate(target, draft, max_rows, block_size, long_tokens=long_tokens)
    busy = busy or _busy()
    if path is not None and not busy:  # a calibration taken while others held the cores is used, not kept
        try:  # whole or not at all: concurrent writers and a writer killed half-way leave a complete file
            atomic_write(path, json.dumps(model.to_json()))
        except OSError:  # a read-only home must not stop generation
            pass
    return model
