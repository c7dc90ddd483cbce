"""What checking a checkpoint's shapes before allocating costs a load (issue 51): ``Target.empty`` as it is (the
module built on the meta device, every safetensors header checked against it, then allocated with ``to_empty``)
against building it straight on the CPU without the check (as before issue 51), alternating, on the embedded
SmolLM2-135M target's config and checkpoint; and a whole warm ``load_target`` for scale.

Example::

    python scripts/bench/bench_load_check.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspine import load_target
from dspine.embedded.smollm2 import embedded_target_path
from dspine.models.checkpoint import read_config
from dspine.models.layers import skip_init
from dspine.models.llama import DenseTarget


def unchecked(cfg: dict) -> DenseTarget:
    """The module built where it runs, uninitialised, no shape checked (``Target.empty`` before issue 51)."""
    with skip_init():
        model = DenseTarget(cfg)
    for m in model.modules():
        if hasattr(m, "spec") and callable(getattr(m, "reset", None)):
            m.reset()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    import torch

    path = embedded_target_path()
    cfg = read_config(path)
    load_target(path)  # warm: kernels built, packed weights cached, modules imported
    ways = {"checked": lambda: DenseTarget.empty(cfg, torch.float32, "cpu", path),
            "unchecked": lambda: unchecked(cfg), "load_target": lambda: load_target(path)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(args.repeats):
        for name in (list(ways) if i % 2 == 0 else list(reversed(ways))):
            t = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - t)
    for name, xs in times.items():
        print(f"{name:12s} median {1e3 * statistics.median(xs):7.1f} ms  (min {1e3 * min(xs):.1f}, n={len(xs)})")


if __name__ == "__main__":
    main()
