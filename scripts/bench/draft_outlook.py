"""Where the draft can pay on this machine: for the embedded pair's calibrated prices (the cost model a run at
each concurrency loads or measures), the tau a round of each draft block must reach to beat a plain step at R rows,
beside the most a block commits (every token accepted) and the draft's prior expected tau. ``cannot pay`` is
``dspine.decoding.rounds.draft_cannot_pay``: the stream retires the draft before its first prefill there.

    python scripts/bench/draft_outlook.py --concurrency 1 8 32 64

Prices, not a timing: the figures come from the calibration (cached per machine; a busy machine's is not cached).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_line, load_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    args = ap.parse_args()
    from dspine.decoding.acceptance import JobAcceptance
    from dspine.decoding.config import StreamConfig
    from dspine.decoding.explain import break_even, draft_outlook
    from dspine.decoding.prices import LivePrices
    from dspine.decoding.rounds import draft_cannot_pay
    from dspine.decoding.schedule import PRIOR_ACCEPT
    from dspine_batch.engines.reference import ReferenceEngine

    print(f"cpu: {cpu_line()}, {load_line()}", flush=True)
    eng = ReferenceEngine.load("embedded", "embedded", {})
    prior = PRIOR_ACCEPT if eng.accept_prior is None else eng.accept_prior
    print(f"draft block {eng.block_size}, prior acceptance {prior}")
    print("| c | R | need tau per block (block: need) | prior tau (block) | cannot pay |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        prices = LivePrices(eng._cost(c), packed=eng.target.packs)  # what a stream at c starts from
        job = JobAcceptance(prior, eng.block_size - 1)
        for R in sorted({r for r in (1, 2, 4, 8, c) if r <= c}):
            needs = ", ".join(f"{b}: {break_even(prices, R, b - 1, b):.2f}" for b in range(2, job.slots + 2))
            tau, _, best = draft_outlook(job, prices, R)
            cfg = StreamConfig(eng.draft, eng.block_size, None, "cost", None, c, (1,), prices=prices, job=job)
            print(f"| {c} | {R} | {needs} | {tau:.2f} ({best}) | {'yes' if draft_cannot_pay(cfg, R) else 'no'} |")


if __name__ == "__main__":
    main()
