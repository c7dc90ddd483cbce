#!/usr/bin/env python
"""Memory of a long-prompt batch under each precision policy (issue 26): KV-cache bytes and peak RSS.

``--rows`` unique chat prompts of about ``--tokens`` tokens each (the prompts of bench_prefill.py), ``--new-tokens``
new tokens each, plain greedy decoding of the embedded target with ``--batch`` rows at a time (``dspine.generate``,
no draft, no prefix cache: the KV cache alone). One child process per configuration, so each peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own:

- ``fp32``: the default (Q4_1/Q8_0 blocks, fp32 kernels, fp32 KV);
- ``bf16-kv32``: ``dtype=bfloat16`` with an fp32 KV cache (``load_target(kv_dtype=torch.float32)``);
- ``bf16``: ``dtype=bfloat16`` as loaded now, a bf16 KV cache.

Reported per configuration: KV bytes per token (all layers, K and V), the peak of the live KV caches' bytes (every
``KVCache`` alive, sampled at each target forward), the RSS after loading, the peak RSS while loading, the peak RSS
while decoding (VmHWM reset after the load: packing the weights briefly holds two copies, a peak that would hide
the KV cache's), the process's peak RSS (getrusage), and the wall time.

    python scripts/bench/bench_memory.py --json out/memory.json
    python scripts/bench/bench_memory.py --rows 8 --tokens 600   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_prefill import cpu_line, load_line, prompts  # noqa: E402

CONFIGS = ("fp32", "bf16-kv32", "bf16")


def _rss_mb() -> float:
    """The process's peak RSS so far (getrusage; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mb(field: str) -> float | None:
    """VmRSS (now) or VmHWM (peak since the last reset) from /proc/self/status, in MB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak measured next is the decoding's own, not loading's
    (packing the weights briefly holds two copies, which would otherwise hide the KV cache's difference)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(config: str, rows: int, tokens: int, new_tokens: int, batch: int) -> dict:
    """One configuration, measured in this (fresh) process."""
    import torch

    from dspine import generate, load_target
    from dspine.models import cache as cache_mod
    from dspine_batch.engines.models import open_tokenizer, resolve_model

    path = resolve_model("embedded")
    ids = prompts(open_tokenizer(path), rows, tokens)
    kw = {} if config == "fp32" else {"dtype": torch.bfloat16}
    if config == "bf16-kv32":
        kw["kv_dtype"] = torch.float32
    target = load_target(path, **kw)
    live: list[weakref.ref] = []  # KVCache is an unhashable dataclass: weak references in a list, pruned as we go
    init = cache_mod.KVCache.__init__

    def tracked_init(self, *a, **k):
        init(self, *a, **k)
        live.append(weakref.ref(self))

    cache_mod.KVCache.__init__ = tracked_init
    peak_kv = [0]
    forward = target.forward

    def counting_forward(*a, **k):
        out = forward(*a, **k)
        live[:] = [r for r in live if r() is not None]
        peak_kv[0] = max(peak_kv[0], sum(c.k.nbytes + c.v.nbytes for r in live if (c := r()) is not None))
        return out

    target.forward = counting_forward
    one = target.new_cache(1, 1)
    per_token = sum((c.k.nbytes + c.v.nbytes) for c in one.layers)
    del one
    after_load, load_peak = _status_mb("VmRSS"), _rss_mb()
    reset = _reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        outs = generate(target, None, ids, max_new_tokens=new_tokens, batch_size=batch)
    wall = time.perf_counter() - t0
    return {"config": config, "kernel": target.kernel, "kv_dtype": str(target.kv_dtype).replace("torch.", ""),
            "kv_bytes_per_token": per_token, "peak_live_kv_mb": peak_kv[0] / 2**20, "rss_after_load_mb": after_load,
            "load_peak_rss_mb": load_peak, "decode_peak_rss_mb": _status_mb("VmHWM") if reset else None,
            "peak_rss_mb": _rss_mb(), "seconds": wall, "prompt_tokens": sum(map(len, ids)),
            "new_tokens": sum(len(o.token_ids) for o in outs), "longest_prompt": max(map(len, ids))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1400, help="about this many tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.tokens, args.new_tokens, args.batch)))
        return
    print(f"# {cpu_line()}, {load_line()}; {args.rows} prompts of ~{args.tokens} tokens, {args.new_tokens} new "
          f"tokens, batch {args.batch}", flush=True)
    results = []
    for config in args.configs:
        cmd = [sys.executable, __file__, "--child", config, "--rows", str(args.rows), "--tokens", str(args.tokens),
               "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{config}: child failed\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"# {config} done ({load_line()})", flush=True)
    print("\n| config | kernel | KV | KV bytes/token | peak live KV (MB) | RSS after load (MB) | peak RSS loading (MB) "
          "| peak RSS decoding (MB) | peak RSS, process (MB) | seconds |")
    print("|---|---|---|" + "---:|" * 7)

    def mb(x):
        return "-" if x is None else f"{x:.0f}"

    for r in results:
        print(f"| {r['config']} | {r['kernel']} | {r['kv_dtype']} | {r['kv_bytes_per_token']:,} | "
              f"{r['peak_live_kv_mb']:.0f} | {mb(r['rss_after_load_mb'])} | {mb(r['load_peak_rss_mb'])} | "
              f"{mb(r['decode_peak_rss_mb'])} | {r['peak_rss_mb']:.0f} | {r['seconds']:.0f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_line(), "args": vars(args), "results": results}, indent=1,
                                        default=str))


if __name__ == "__main__":
    main()
