"""Cost of a DSpine training step on this machine: fp32 vs bf16 autocast, side by side in one process.

Same target (the embedded SmolLM2), same draft (the shipped one, loaded in fp32), same batch of sequences,
same anchors; only ``TrainConfig.autocast`` differs. Steps alternate between the two settings so machine
load hits both alike. Captures are made once up front (fp32 target) and shared, so the timings are the
draft's forward + backward + optimiser step, what every epoch after the first costs. Also reports the loss
of the first step in both settings (bf16 GEMMs change the numbers, not the objective).

Example::

    python scripts/bench/bench_train.py --steps 12 --batch-size 4 --anchors 96 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per setting (after 2 warm-up steps)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=300, help="tokens per sequence (half prompt, half response)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dspine import load_target
    from dspine.draft.io import load_draft
    from dspine.embedded.smollm2 import embedded_draft_path, embedded_target_path
    from dspine.training.train import TrainConfig, capture, make_example, train_step

    target = load_target(embedded_target_path()).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    half = args.seq_len // 2
    exs = [
        make_example(torch.randint(100, 8000, (half,), generator=g).tolist(),
                     torch.randint(100, 8000, (args.seq_len - half,), generator=g).tolist())
        for _ in range(args.batch_size)
    ]  # fmt: skip
    runs = {}
    for mode in ("fp32", "bfloat16"):
        draft = load_draft(embedded_draft_path()).train()
        params = [p for p in draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        cfg = TrainConfig(anchors_per_seq=args.anchors, replacement_probability=0.0,
                          autocast=None if mode == "fp32" else mode)  # fmt: skip
        runs[mode] = dict(draft=draft, params=params, opt=opt, cfg=cfg, gen=torch.Generator().manual_seed(1),
                          times=[], loss=None)  # fmt: skip
    caps = [capture(target, ex.ids, runs["fp32"]["draft"].target_layer_ids, torch.bfloat16) for ex in exs]
    batch = list(zip(exs, caps))

    def step(r: dict) -> float:
        t0 = time.perf_counter()
        r["opt"].zero_grad(set_to_none=True)
        stats = train_step(r["draft"], target, batch, 100, r["cfg"], r["gen"])  # cfg.autocast applies inside
        torch.nn.utils.clip_grad_norm_(r["params"], 1.0)
        r["opt"].step()
        if r["loss"] is None:
            r["loss"] = stats["loss"]
        return time.perf_counter() - t0

    for i in range(args.steps + 2):
        for r in runs.values():
            dt = step(r)
            if i >= 2:
                r["times"].append(dt)
    out = {}
    for mode, r in runs.items():
        out[mode] = {"median_step_s": round(statistics.median(r["times"]), 3), "min_step_s": round(min(r["times"]), 3),
                     "first_loss": round(r["loss"], 4)}  # fmt: skip
    out["speedup"] = round(out["fp32"]["median_step_s"] / out["bfloat16"]["median_step_s"], 2)
    out["setup"] = {k: v for k, v in vars(args).items() if k != "json"}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
