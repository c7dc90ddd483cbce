#!/usr/bin/env python
"""The decode step against the machine's roof, in one run (issue 53): what this CPU can do, what a step must move and
compute, and how far our step and our engine are from that.

1. The machine, measured here: read bandwidth (an fp32 tensor summed by torch with this run's threads, at the size
   of the weights a step streams and at 1 GiB) and GEMM rates by row count (torch's bf16 linear, which oneDNN runs on
   AMX tiles where the CPU has them and on AVX-512 otherwise; torch's int8 x int8 -> int32 ``_int_mm`` where it
   runs: VNNI / AMX-int8; torch's fp32 linear).
2. The target (``--model``, the embedded SmolLM2-135M by default) in each ``--settings`` precision: the bytes a
   one-token step reads (every weight as our kernels store it, plus the KV cache it attends over) and the
   multiply-adds a token costs (the linears, the head, attention over ``--ctx`` keys).
3. The roof of a forward of ``rows`` x ``tokens``: the larger of bytes / bandwidth and rows x tokens x MACs / the
   best GEMM rate measured (torch's, or our own prefill's in the first engine setting: 4.) among the arithmetics that
   compute the setting's products exactly (``arithmetic``:
   fp32 for the fp32 settings; bf16 or fp32 for bf16 ones, since bf16 operands are exact in fp32 and a CPU without
   bf16 instructions emulates them slower than fp32; int8, bf16 or fp32 for the integer ones). Then the one-token
   step and the 2/4-token verifies (``bench_step.make_step``: ~``--ctx`` tokens of context, the head included) at
   ``--rows``, timed with the settings alternating rep by rep, as ms and as a multiple of that roof.
4. The reference engine's plain decoding (``bench_peers.run_ours``: ``--n`` chat prompts, greedy, ``--new-tokens``
   each, ``batch_size`` = rows, every request queued) at ``--engine-rows``, as tok/s against the roof's tok/s
   (rows / the one-token roof) and against the bare step's (rows / the measured step); and the same prompts read in
   one packed forward (the prefill the engine's run also does, which the roof's tok/s does not count), in GMAC/s
   against the measured peak.

    python scripts/bench/bench_roofline.py
    python scripts/bench/bench_roofline.py --settings bf16 q8 --rows 1 8 32 64 --engine-rows 8 32 64 --json r.json
    python scripts/bench/bench_roofline.py --skip-engine --rows 8 32 --reps 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import SETTINGS, make_step  # noqa: E402
from machine import cpu_line, load_line, write_json  # noqa: E402

INTEGER = ("q8", "q16", "int8", "int4")  # settings whose linears multiply on integer dot products (or claim to)
FP32 = ("fp32", "fp32_torch", "fp32_fused")  # settings whose linears multiply in fp32


def arithmetic(setting: str) -> tuple[str, ...]:
    """The GEMM kinds whose rate may bound a setting's multiply-adds: those that compute its products exactly."""
    if setting in FP32:
        return ("fp32",)
    return ("int8", "bf16", "fp32") if setting in INTEGER else ("bf16", "fp32")


def best_time(fn, reps: int) -> float:
    """The fastest of ``reps`` calls (after one warm-up): what the machine can do, which load only ever slows."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ---- the machine ---------------------------------------------------------------------------------------------


def read_bandwidth(nbytes: int, reps: int) -> float:
    """GB/s of torch summing an fp32 tensor of ``nbytes`` (read once per sum; nothing written but the sum)."""
    import torch

    x = torch.ones(nbytes // 4)
    return nbytes / best_time(lambda: x.sum(), reps) / 1e9


def gemm_rate(kind: str, m: int, k: int, n: int, reps: int) -> float | None:
    """GMAC/s of torch's ``kind`` GEMM, [m, k] x [k, n], the operands in cache; None where torch cannot run it."""
    import torch

    g = torch.Generator().manual_seed(m)
    try:
        if kind == "bf16":
            x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
            fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
        elif kind == "fp32":
            x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
            fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
        else:  # int8 x int8 -> int32 (oneDNN: AMX-int8 / VNNI where the CPU has them)
            x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
            w = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
            fn = lambda: torch._int_mm(x, w)  # noqa: E731
        fn()
    except (RuntimeError, AttributeError):
        return None
    return m * k * n / best_time(fn, reps) / 1e9


def machine(weight_bytes: int, reps: int, shape: tuple[int, int], rows: list[int]) -> dict:
    """Bandwidth at the weights' size and at 1 GiB (the roof takes the larger: a step may find its weights in a
    large last-level cache), GEMM rates by rows at the model's (k, n) shape and at 256/1024 rows (the peak), each
    the best of ``reps``."""
    k, n = shape
    bw = {f"{weight_bytes / 1e6:.0f}MB": read_bandwidth(weight_bytes, reps), "1GiB": read_bandwidth(1 << 30, reps)}
    gemm = {kind: {m: gemm_rate(kind, m, k, n, reps) for m in sorted({*rows, 256, 1024})}
            for kind in ("bf16", "int8", "fp32")}
    return {"read_GBps": {k: round(v, 1) for k, v in bw.items()}, "bandwidth_GBps": round(max(bw.values()), 1),
            "gemm_GMACps": {kind: {m: None if r is None else round(r, 1) for m, r in rates.items()}
                            for kind, rates in gemm.items()},
            "peak_GMACps": {kind: round(max(r for r in rates.values() if r is not None), 1)
                            for kind, rates in gemm.items() if any(r is not None for r in rates.values())},
            "gemm_shape": [k, n]}


# ---- the target ------------------------------------------------------------------------------------------------


def linear_cost(module) -> tuple[int, int] | None:
    """(bytes as stored, multiply-adds per row) of one linear of any of our kinds; None for other modules."""
    from torch import nn

    from dspine.cpu.kernels import PackedLinear
    from dspine.cpu.quant import Int4Linear, Int8Linear

    if isinstance(module, PackedLinear):
        stored = module.packed.nbytes + (0 if module.bias is None else module.bias.nbytes)
        return stored, module.in_features * module.out_features
    if isinstance(module, (Int8Linear, Int4Linear)):
        stored = sum(b.nbytes for b in module.buffers())
        return stored, module.in_features * module.out_features
    if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
        return sum(p.nbytes for p in module.parameters()), module.in_features * module.out_features
    return None


def target_cost(target, ctx: int) -> dict:
    """What a one-token step of one row reads and computes: the weights (decoder linears + the head the logits use,
    as stored), the KV cache over ``ctx`` keys, and multiply-adds per token (linears, head, attention)."""
    weights = macs = 0
    for module in target.layers.modules():
        cost = linear_cost(module)
        if cost is not None:
            weights, macs = weights + cost[0], macs + cost[1]
    decoder_macs = macs
    head = getattr(target, "infer_head", None)
    cost = linear_cost(head) if head is not None else (target.head_weight.nbytes, target.head_weight.numel())
    weights, macs = weights + cost[0], macs + cost[1]
    norms = sum(p.nbytes for n, p in target.named_parameters() if "norm" in n)
    a = target.layers[0].self_attn
    kv_elem = torch_dtype_size(target.kv_dtype)
    kv_per_row = target.num_layers * 2 * a.n_kv * a.head_dim * ctx * kv_elem
    attn_macs = target.num_layers * 2 * a.n_heads * a.head_dim * ctx
    return {"weights_bytes": weights + norms, "kv_bytes_per_row": kv_per_row, "linear_macs_per_token": macs,
            "decoder_macs_per_token": decoder_macs,
            "attention_macs_per_token": attn_macs, "macs_per_token": macs + attn_macs,
            "bf16_bytes": 2 * macs + norms}  # every linear weight (the head's included) in bf16


def torch_dtype_size(dtype) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


def torch_peak(mach: dict, setting: str) -> float:
    """The best GEMM rate torch reached here among the arithmetics that compute ``setting``'s products exactly."""
    return max(mach["peak_GMACps"].get(kind) or 0.0 for kind in arithmetic(setting))


def roof_ms(cost: dict, mach: dict, rows: int, tokens: int, setting: str) -> dict:
    """The roof of a forward of rows x tokens: max(bytes / bandwidth, MACs / peak), and which one binds."""
    moved = cost["weights_bytes"] + rows * cost["kv_bytes_per_row"]
    t_bytes = moved / (mach["bandwidth_GBps"] * 1e9)
    peak = max(torch_peak(mach, setting), mach.get("prefill_GMACps", {}).get(setting) or 0.0)
    t_macs = rows * tokens * cost["macs_per_token"] / (peak * 1e9)
    return {"ms": 1e3 * max(t_bytes, t_macs), "bytes_ms": 1e3 * t_bytes, "macs_ms": 1e3 * t_macs,
            "bound": "bytes" if t_bytes >= t_macs else "MACs"}


# ---- steps and the engine ----------------------------------------------------------------------------------------


def variant_switch(target, amx: bool | None, fused: bool, stacked: bool = True, team: bool = True):
    """A function that puts the process in a variant before each of its calls: the bf16 family on AMX tiles or not
    (``kernels.set_bf16_amx``, process-wide; None: leave it), the target's layers fused into one call each or run op
    by op (``llama.Block.plan_fused``) and, fused, all in one call a forward or one call a layer (``stacked``:
    ``DenseTarget.stacked``); stacked, the forwards the team stack covers in one parallel region or as the loop of
    fused layers (``team``: ``kernels.set_team_stack``, process-wide)."""
    from dspine.cpu import kernels

    layers = list(getattr(target, "layers", []))
    plans = [getattr(layer, "fused", None) for layer in layers]

    def switch() -> None:
        if amx is not None:
            kernels.set_bf16_amx(amx)
        for layer, plan in zip(layers, plans):
            if hasattr(layer, "fused"):
                layer.fused = plan if fused else None
        if hasattr(target, "stacked"):
            target.stacked = stacked
        kernels.set_team_stack(team)

    return switch


def time_steps(variants: dict, rows: list[int], verifies: list[int], ctx: int, reps: int) -> dict[tuple, dict]:
    """Median (and best) ms of each (variant, rows, tokens) forward; ``variants``: label -> (target, switch). The
    variants alternate rep by rep (forward, then backward), so load that comes and goes lands on all of them."""
    out: dict[tuple, dict] = {}
    for b in rows:
        for t in (1, *verifies):
            steps = {}
            for name, (tg, switch) in variants.items():
                switch()
                steps[name] = make_step(tg, b, ctx, t)
            times: dict[str, list[float]] = {name: [] for name in steps}
            for name, fn in steps.items():
                variants[name][1]()
                fn()
            for rep in range(reps):
                for name in (list(steps) if rep % 2 == 0 else list(steps)[::-1]):
                    variants[name][1]()
                    t0 = time.perf_counter()
                    steps[name]()
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                out[(name, b, t)] = {"ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts)}
            print(json.dumps({"rows": b, "tokens": t, **{n: round(out[(n, b, t)]["ms"], 2) for n in steps}}),
                  flush=True)
    return out


def engine_tok_s(settings: list[str], rows: list[int], n: int, new: int, repeats: int) -> dict[tuple, float]:
    """Plain decoding through the reference engine (``bench_peers.run_ours``), ``max(n, rows)`` prompts (the chat
    prompts of examples/prompts.jsonl, cycled with a numbered suffix past its end): generated tok/s, the median of
    ``repeats`` runs, settings alternating."""
    from bench_peers import run_ours

    from dspine.embedded.smollm2 import embedded_target_path
    from dspine.models.tokenizer import HFTokenizer

    tok = HFTokenizer(Path(embedded_target_path()))
    stops = set(tok.stop_token_ids([]))
    out: dict[tuple, float] = {}
    for c in rows:
        ids = engine_prompts(tok, max(n, c))
        runs: dict[str, list[float]] = {s: [] for s in settings}
        outputs: dict[str, list[list[int]]] = {}
        for rep in range(repeats):
            for s in (settings if rep % 2 == 0 else settings[::-1]):
                col = run_ours(ids, stops, new, c, False, s, f"ours plain {s}")
                runs[s].append(col.tok_s)
                outputs[s] = col.outputs
        for s, vals in runs.items():
            out[(s, c)] = statistics.median(vals)
            # greedy agreement with the first setting: identical outputs, and the share of tokens before a row's
            # first difference
            ref = outputs[settings[0]]
            same = sum(a == b for a, b in zip(outputs[s], ref))
            prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                         for a, b in zip(outputs[s], ref))
            out[(s, c, "agree")] = f"{same}/{len(ref)} rows identical, {prefix / max(1, sum(map(len, ref))):.2f} " \
                                   f"of tokens before the first difference"
        print(json.dumps({"engine_rows": c, "prompts": len(ids), **{s: round(out[(s, c)], 1) for s in settings},
                          **{f"{s} vs {settings[0]}": out[(s, c, "agree")] for s in settings[1:]}}), flush=True)
    return out


def engine_prompts(tok, count: int) -> list[list[int]]:
    """The engine runs' prompts: the chat prompts of examples/prompts.jsonl, cycled with a numbered suffix past its
    end, rendered with the chat template."""
    from bench_peers import load_prompts

    base = load_prompts(REPO / "examples" / "prompts.jsonl", 10**6)
    texts = [base[i % len(base)] + ("" if i < len(base) else f" (Variant {i // len(base)}.)") for i in range(count)]
    return [list(tok.render_chat([{"role": "user", "content": p}])) for p in texts]


def prefill_rate(target, ids: list[list[int]], macs_per_token: float, reps: int = 3) -> dict:
    """``ids`` read in one packed forward (``n_valid``: each prompt its real tokens), best of ``reps``: the prefill
    an engine run does before its steps, as ms and GMAC/s (``macs_per_token``: the decoder's linears; the forward
    computes no logits, and its attention over ~50 keys is left out, so the rate is if anything low)."""
    import torch

    lens = [len(r) for r in ids]
    x = torch.zeros(len(ids), max(lens), dtype=torch.long)
    for i, r in enumerate(ids):
        x[i, : len(r)] = torch.tensor(r)
    n_valid = torch.tensor(lens)
    best = float("inf")
    with torch.no_grad():
        for _ in range(reps):
            cache = target.new_cache(len(ids), max(lens) + 1)
            t = time.perf_counter()
            target.forward(x, cache, n_valid=n_valid)
            best = min(best, time.perf_counter() - t)
    return {"prompts": len(ids), "tokens": sum(lens), "ms": round(1e3 * best, 1),
            "GMACps": round(sum(lens) * macs_per_token / best / 1e9, 1)}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return load_line()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--settings", nargs="+", default=["bf16", "q8"], choices=list(SETTINGS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--verify", type=int, nargs="*", default=[2, 4], help="tokens per verify forward")
    ap.add_argument("--ctx", type=int, default=100, help="context tokens before the timed forward")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--bw-reps", type=int, default=9)
    ap.add_argument("--engine-rows", type=int, nargs="*", default=[8, 32, 64])
    ap.add_argument("--engine-settings", nargs="*", default=None, help="default: the first of --settings")
    ap.add_argument("--n", type=int, default=16, help="prompts per engine run (at least the rows)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--engine-repeats", type=int, default=2)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true", help="do not time the engine's prompts in one packed "
                    "forward (by default its GMAC/s is printed and the roof takes it when larger than torch's peak)")
    ap.add_argument("--compare", action="store_true", help="also time the first setting as it ran before issue 53: "
                    "the bf16 family on AVX512-BF16 (not AMX) and the layers op by op, and on AMX op by op; and "
                    "the first setting with one fused call a layer instead of one for all layers (per-layer), and "
                    "with the fused layers' loop instead of the team stack (loop)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: ``configure_torch``'s choice); on a "
                    "shared machine 1 thread measures what 2 cannot (a descheduled thread stalls every barrier)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()

    import torch

    from dspine import load_target
    from dspine.cpu.threads import configure_torch

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # configure_torch honours it, in the engine runs too
    threads = configure_torch()
    report: dict = {"cpu": cpu_line(), "threads": threads, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "uptime_before": uptime()}
    print(f"# {report['cpu']}, {threads} threads, {report['uptime_before']}", flush=True)
    path = args.model
    if path == "embedded":
        from dspine.embedded.smollm2 import embedded_target_path

        path = str(embedded_target_path())
    targets = {name: load_target(path, **SETTINGS[name]) for name in args.settings}
    costs = {name: target_cost(tg, args.ctx) for name, tg in targets.items()}
    first = targets[args.settings[0]]
    mlp = first.layers[0].mlp
    shape = (first.hidden_size, getattr(mlp, "gate_up", None).out_features // 2 if getattr(mlp, "gate_up", None)
             is not None else mlp.gate_proj.out_features)
    mach = machine(max(c["weights_bytes"] for c in costs.values()), args.bw_reps, shape, args.rows)
    report |= {"machine": mach, "target": {n: {"kernel": tg.kernel, **costs[n]} for n, tg in targets.items()}}
    print(json.dumps({"machine": mach}), flush=True)
    print(json.dumps({"target": report["target"]}), flush=True)

    # our own prefill of the engine's prompts is a GEMM rate measured on this machine too: on a noisy host torch's
    # fp32 linear has read lower than it, which made every "x roof" flatter
    prefill = {}
    if not args.skip_prefill:
        from dspine.models.tokenizer import HFTokenizer

        tok = HFTokenizer(Path(path))
        s0 = (args.engine_settings or args.settings[:1])[0]
        tg = targets.get(s0) or load_target(path, **SETTINGS[s0])
        cost = costs.get(s0) or target_cost(tg, args.ctx)
        ids = engine_prompts(tok, max([args.n, *args.engine_rows]))
        prefill = prefill_rate(tg, ids, cost["decoder_macs_per_token"])  # a prefill runs no head
        prefill |= {"setting": s0, "torch_peak_GMACps": torch_peak(mach, s0)}
        mach["prefill_GMACps"] = {s0: prefill["GMACps"]}
        print(json.dumps({"prefill": prefill}), flush=True)
    report["prefill"] = prefill

    from dspine.cpu import kernels

    amx = kernels.bf16_isa().endswith("+amx")
    variants = {name: (tg, variant_switch(tg, amx, True)) for name, tg in targets.items()}
    setting_of = {name: name for name in targets}
    if args.compare:
        s0 = args.settings[0]
        per_op = f"{s0} avx512-bf16 per-op" if amx else f"{s0} per-op"  # (AMX or not: only the bf16 family differs)
        variants[f"{s0} loop"] = (targets[s0], variant_switch(targets[s0], amx, True, team=False))
        setting_of[f"{s0} loop"] = s0
        for label, on_amx, fused in ((f"{s0} per-layer", amx, True), (per_op, False, False),
                                     (f"{s0} amx per-op", True, False)):
            if on_amx and not amx:
                continue
            variants[label] = (targets[s0], variant_switch(targets[s0], on_amx, fused, stacked=False))
            setting_of[label] = s0
    steps = time_steps(variants, args.rows, args.verify, args.ctx, args.reps)
    for _, switch in list(variants.values())[: len(targets)]:
        switch()  # the defaults again (AMX where it runs, layers fused) for the engine runs
    table = []
    for (name, b, t), res in steps.items():
        roof = roof_ms(costs[setting_of[name]], mach, b, t, setting_of[name])
        table.append({"setting": name, "rows": b, "tokens": t, "ms": round(res["ms"], 2),
                      "min_ms": round(res["min_ms"], 2), "roof_ms": round(roof["ms"], 2),
                      "x_roof": round(res["ms"] / roof["ms"], 2), "x_roof_min": round(res["min_ms"] / roof["ms"], 2),
                      "bound": roof["bound"], "bytes_ms": round(roof["bytes_ms"], 2),
                      "macs_ms": round(roof["macs_ms"], 2)})
    report["steps"] = table
    engine = {}
    if not args.skip_engine and args.engine_rows:
        eng_settings = args.engine_settings or args.settings[:1]
        tok_s = engine_tok_s(eng_settings, args.engine_rows, args.n, args.new_tokens, args.engine_repeats)
        for key, v in tok_s.items():
            if len(key) == 3:
                continue
            s, c = key
            cost = costs.get(s) or target_cost(load_target(path, **SETTINGS[s]), args.ctx)
            roof = roof_ms(cost, mach, c, 1, s)
            bare = steps.get((s, c, 1))
            engine[f"{s}@{c}"] = {"tok_s": round(v, 1), "roof_tok_s": round(1e3 * c / roof["ms"], 1),
                                  "x_roof": round(v / (1e3 * c / roof["ms"]), 2),
                                  "bare_step_tok_s": None if bare is None else round(1e3 * c / bare["ms"], 1),
                                  "x_bare": None if bare is None else round(v / (1e3 * c / bare["ms"]), 2),
                                  "greedy_vs_first": tok_s[(s, c, "agree")]}
    report["engine"] = engine
    report["uptime_after"] = uptime()
    write_json(args.json, report)

    print(f"\n{report['cpu']}, {threads} threads, torch {report['torch']}, {report['date']}")
    print(f"before: {report['uptime_before']}\nafter:  {report['uptime_after']}")
    bw = ", ".join(f"{k} {v} GB/s" for k, v in mach["read_GBps"].items())
    print(f"read bandwidth: {bw} (roof uses {mach['bandwidth_GBps']})")
    for kind, rates in mach["gemm_GMACps"].items():
        print(f"{kind} GEMM GMAC/s by rows (k, n = {shape}): " + ", ".join(f"{m}: {r}" for m, r in rates.items()))
    for name, c in costs.items():
        print(f"{name} ({targets[name].kernel}): {c['weights_bytes'] / 1e6:.1f} MB of weights a step (bf16 would be "
              f"{c['bf16_bytes'] / 1e6:.1f}), KV {c['kv_bytes_per_row'] / 1e6:.2f} MB a row at ctx {args.ctx}, "
              f"{c['macs_per_token'] / 1e6:.1f} M MACs a token")
    print("\n| setting | rows | tokens | ms median (min) | roof ms (bound) | x roof median (min) |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['setting']} | {r['rows']} | {r['tokens']} | {r['ms']:.2f} ({r['min_ms']:.2f}) | "
              f"{r['roof_ms']:.2f} ({r['bound']}) | {r['x_roof']:.2f} ({r['x_roof_min']:.2f}) |")
    if engine:
        print("\n| engine plain | tok/s | roof tok/s | x roof | bare step tok/s | x bare | greedy vs first |")
        print("|---|---|---|---|---|---|---|")
        for k, e in engine.items():
            print(f"| {k} | {e['tok_s']} | {e['roof_tok_s']} | {e['x_roof']} | {e['bare_step_tok_s']} | "
                  f"{e['x_bare']} | {e['greedy_vs_first']} |")
    if prefill:
        print(f"\nthe engine's prompts in one packed forward ({prefill['setting']}): {prefill['prompts']} prompts, "
              f"{prefill['tokens']} tokens in {prefill['ms']} ms = {prefill['GMACps']} GMAC/s (torch's GEMM peak "
              f"this run {prefill['torch_peak_GMACps']}; the roof takes the larger)")


if __name__ == "__main__":
    main()
