#!/usr/bin/env python
"""Our engine beside its peers in one run: the same chat-templated token ids, greedy, the same new-token budget.

Columns (each skipped with a note when its software is missing):

- ours, plain and speculative (the embedded pair), at each ``--concurrency`` and each ``--settings`` precision,
  through ``ReferenceEngine`` (``batch_size`` = concurrency, every request queued);
- ``dspine-batch generate`` at its defaults (only ``--max-new-tokens`` and ``--save-token-ids`` given), timed
  end to end as a user runs it (model load included);
- HF transformers ``generate`` (``--hf-dtype``, fp32 by default), one prompt at a time and in batches of 8 (or of
  the concurrency) with left padding;
- llama.cpp through ``llama-cpp-python`` with the shipped Q4_1 GGUF and an F32 GGUF written from it with the
  ``gguf`` package, one prompt at a time, run by ``--llamacpp-python`` (its own virtualenv: see BENCHMARKS.md);
- llama.cpp's own ``llama-server`` (``--llamacpp-server BIN``, a build of llama.cpp for this machine) with the shipped
  Q4_1 GGUF on a loopback port, ``concurrency`` parallel slots (continuous batching), the prompts as token ids.

``--prompt-reading N``: also prompt tokens/s over N unique ~1,390-token chat prompts (``bench_prefill.prompts``), one
new token each: ours per setting (plain, the engine's default batch), llama-server (one slot) and HF (one at a time).
With ``--interleave`` the columns run concurrency by concurrency (ours, llama-server, HF at c=1, then at c=8, ...).

For each column: tokens/s (generated tokens, up to and including the first stop token, over wall time, model
load excluded except for the CLI column), the ratio to our plain fp32 engine at the same concurrency, and how
many outputs are token-for-token identical to our plain fp32 run at concurrency 1. The CPU model, thread count
and load average are printed with the table, since absolute numbers depend on them.

    python scripts/bench/bench_peers.py --quick
    python scripts/bench/bench_peers.py --n 16 --new-tokens 128 --concurrency 1 8 32 --json peers.json
    python scripts/bench/bench_peers.py --settings bf16 q16 q8 --skip cli llamacpp --hf-dtype bfloat16 \
        --llamacpp-server /tmp/llama.cpp/build/bin/llama-server --prompt-reading 8 --interleave
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LLAMACPP_PYTHON = Path.home() / ".cache" / "dspine" / "venv-llamacpp" / "bin" / "python"

if __name__ == "__main__":
    sys.path.insert(0, str(REPO))


@dataclass
class Column:
    name: str
    concurrency: int
    seconds: float = 0.0
    tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    note: str = ""
    own_plain: Column | None = field(default=None, repr=False)  # speculative columns: plain at the same setting
    kind: str = "decode"  # or "prompt": tokens are prompt tokens read (one new token each)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def load_prompts(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows if isinstance(r.get("prompt"), str)]
    if not prompts:
        raise SystemExit(f"{path}: no rows with a 'prompt' string")
    return prompts[:n]


def cut(ids: list[int], stops: set[int], limit: int) -> list[int]:
    """Generated ids up to and including the first stop id, at most ``limit``: how every column is counted."""
    out = []
    for t in ids[:limit]:
        out.append(int(t))
        if t in stops:
            break
    return out


def finish(col: Column, outs: list[list[int]], seconds: float, stops: set[int], limit: int) -> Column:
    col.outputs = [cut(o, stops, limit) for o in outs]
    col.tokens = sum(len(o) for o in col.outputs)
    col.seconds = seconds
    return col


# ---- ours ---------------------------------------------------------------------------------------------------


def run_ours(prompt_ids, stops, new, concurrency, draft, setting, label) -> Column:
    from machine import fresh_job

    from dspine_batch.engines.base import Request, SamplingParams
    from dspine_batch.engines.reference import ReferenceEngine

    args = {"batch_size": str(concurrency)}
    if setting != "fp32":
        args |= {"bf16": {"dtype": "bfloat16"}, "int8": {"quant": "int8"}, "int4": {"quant": "int4"},
                 "q8": {"quant": "q8"}, "q16": {"quant": "q16"}}[setting]
    engine = ReferenceEngine.load("embedded", "embedded" if draft else "none", args)
    params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_token_ids=tuple(sorted(stops)))
    reqs = [Request(f"p{i}", 0, list(ids), params) for i, ids in enumerate(prompt_ids)]
    # warm-up with the timed run's window: first-call allocations, lazy caches and the cost model's calibration for
    # the batch the timed run decodes (``min(concurrency, requests)`` rows: 16 at c = 32 with 16 prompts), which
    # must not land inside the timed run. A warm-up window of ``concurrency`` calibrated 32 rows there, so the
    # timed run calibrated 16 itself on any machine whose cache did not hold it (a busy one never writes it)
    list(engine.run(iter(reqs[:1]), len(reqs)))
    fresh_job(engine)  # the draft not loaded, the warm-up's prompt out of the prefix cache (``machine``)
    t0 = time.perf_counter()
    results = {r.row_id: list(r.token_ids) for r in engine.run(iter(reqs), len(reqs))}
    dt = time.perf_counter() - t0
    engine.close()
    return finish(Column(label, concurrency), [results[r.row_id] for r in reqs], dt, stops, new)


def run_cli_defaults(prompts: list[str], stops, new, tmp: Path) -> Column:
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i:03d}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp / "cli_out"
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", str(src), "-o", str(out), "--max-new-tokens",
           str(new), "--save-token-ids"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    col = Column("dspine-batch generate (defaults, load included)", 0)
    if proc.returncode != 0:
        col.note = f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
        return col
    import pyarrow.dataset as ds

    rows = sorted(ds.dataset(str(out), format="parquet").to_table().to_pylist(), key=lambda r: r["row_id"])
    col.note = f"concurrency = the CLI's default batch size; {len(rows)} rows"
    return finish(col, [list(r.get("output_token_ids") or []) for r in rows], dt, stops, new)


# ---- HF transformers ----------------------------------------------------------------------------------------


def run_hf(model_dir: Path, prompt_ids, stops, new, batch: int, dtype: str = "float32") -> Column:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    pad = min(stops)
    short = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)
    name = f"HF transformers {short} generate" + (" (one at a time)" if batch == 1 else f" (batches of {batch})")
    col = Column(name, batch)

    def gen(chunk):
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 eos_token_id=sorted(stops), pad_token_id=pad)
        return [row[width:].tolist() for row in out]

    gen(prompt_ids[:1])  # warm-up
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompt_ids), batch):
        outs += gen(prompt_ids[i : i + batch])
    return finish(col, outs, time.perf_counter() - t0, stops, new)


# ---- llama.cpp ----------------------------------------------------------------------------------------------

LLAMACPP_JOB = r"""
import json, sys, time
from llama_cpp import Llama
job = json.loads(sys.stdin.read())
llm = Llama(model_path=job["gguf"], n_ctx=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
            verbose=False)
stops = set(job["stops"])

def gen(ids):
    llm.reset()
    out = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok in stops or len(out) >= job["new"]:
            break
    return out

gen(job["prompts"][0][:8])
t0 = time.perf_counter()
outs = [gen(p) for p in job["prompts"]]
print(json.dumps({"seconds": time.perf_counter() - t0, "outputs": outs}))
"""


def write_f32_gguf(src: Path, dst: Path) -> None:
    """An F32 GGUF with ``src``'s metadata and every tensor dequantized (gguf's reference dequantizer)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        value = 0 if key == "general.file_type" else f.contents()  # 0 = all F32
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_llamacpp(python: Path, gguf_path: Path, label: str, prompt_ids, stops, new, threads: int) -> Column:
    col = Column(label, 1)
    job = {"gguf": str(gguf_path), "prompts": prompt_ids, "stops": sorted(stops), "new": new, "threads": threads}
    proc = subprocess.run([str(python), "-c", LLAMACPP_JOB], input=json.dumps(job), capture_output=True, text=True)
    if proc.returncode != 0:
        col.note = f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}"
        return col
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return finish(col, res["outputs"], res["seconds"], stops, new)


def llamacpp_python(path: str | None) -> Path | None:
    """The interpreter that can import llama_cpp: --llamacpp-python, else the dspine venv, else this one."""
    for cand in ([Path(path)] if path else []) + [LLAMACPP_PYTHON, Path(sys.executable)]:
        if cand.exists():
            ok = subprocess.run([str(cand), "-c", "import llama_cpp"], capture_output=True).returncode == 0
            if ok:
                return cand
    return None


# ---- llama.cpp's server ------------------------------------------------------------------------------------


class LlamaServer:
    """``llama-server`` on a free loopback port with ``slots`` parallel sequences (continuous batching); requests
    carry token ids, so every system reads the same prompt tokens."""

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int, ctx_per_slot: int = 2048):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([binary, "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np",
                                      str(slots), "-c", str(ctx_per_slot * slots), "--host", "127.0.0.1", "--port",
                                      str(self.port), "--no-webui"], stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not come up")

    def complete(self, ids: list[int], new: int) -> dict:
        body = json.dumps({"prompt": list(ids), "n_predict": new, "temperature": 0.0, "top_k": 1,
                           "return_tokens": True, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_llama_server(binary: str, gguf: Path, prompt_ids, stops, new, threads: int, concurrency: int) -> Column:
    col = Column(f"llama.cpp Q4_1 GGUF (llama-server, {concurrency} slots)", concurrency)
    try:
        server = LlamaServer(binary, gguf, threads, concurrency)
    except (OSError, RuntimeError) as e:
        col.note = f"failed: {e}"
        return col
    try:
        server.complete(prompt_ids[0][:8], 4)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(lambda ids: server.complete(ids, new)["tokens"], prompt_ids))
        return finish(col, outs, time.perf_counter() - t0, stops, new)
    finally:
        server.close()


# ---- prompt reading ------------------------------------------------------------------------------------------


def read_ours(long_ids, setting: str) -> Column:
    """Our engine, plain, the default batch, one new token per prompt: prompt tokens over wall time."""
    col = run_ours(long_ids, set(), 1, 8, False, setting, f"ours {setting}: prompt reading")
    col.tokens, col.kind = sum(map(len, long_ids)), "prompt"
    return col


def read_server(binary: str, gguf: Path, long_ids, threads: int) -> Column:
    col = Column("llama.cpp Q4_1 (llama-server): prompt reading", 1, kind="prompt")
    server = LlamaServer(binary, gguf, threads, 1, ctx_per_slot=4096)
    try:
        server.complete(long_ids[0][:64], 1)
        t0 = time.perf_counter()
        for ids in long_ids:
            server.complete(ids, 1)
        col.seconds, col.tokens = time.perf_counter() - t0, sum(map(len, long_ids))
    finally:
        server.close()
    return col


def read_hf(model_dir: Path, long_ids, dtype: str) -> Column:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    col = Column(f"HF transformers {dtype}: prompt reading", 1, kind="prompt")
    with torch.no_grad():
        model(torch.tensor([long_ids[0][:64]]), logits_to_keep=1)
        t0 = time.perf_counter()
        for ids in long_ids:
            model(torch.tensor([ids]), logits_to_keep=1)
    col.seconds, col.tokens = time.perf_counter() - t0, sum(map(len, long_ids))
    return col


# ---- report -------------------------------------------------------------------------------------------------


def table(cols: list[Column], ref: Column, plain_at: dict[int, Column]) -> str:
    """``plain_at``: our plain column of the first setting per concurrency (0: prompt reading), the ratios' base."""
    base_name = ref.name.removeprefix("ours ")
    lines = [f"| system | concurrency | tok/s | vs {base_name} (same concurrency) | identical to {base_name} c=1 |"
             " speculative = its plain | note |", "|---|---|---|---|---|---|---|"]
    for c in cols:
        if not c.seconds:
            lines.append(f"| {c.name} | {c.concurrency or '-'} | — | — | — | — | {c.note} |")
            continue
        base = plain_at.get(0 if c.kind == "prompt" else c.concurrency) or plain_at.get(1)
        ratio = f"{c.tok_s / base.tok_s:.2f}×" if base and base.tok_s else "—"
        same = sum(a == b for a, b in zip(c.outputs, ref.outputs))
        same = "—" if c.kind == "prompt" else f"{same}/{len(ref.outputs)}"
        own = "—"
        if c.own_plain is not None:
            own = f"{sum(a == b for a, b in zip(c.outputs, c.own_plain.outputs))}/{len(c.outputs)}"
        tok_s = f"{c.tok_s:.1f}" + (" (prompt)" if c.kind == "prompt" else "")
        lines.append(f"| {c.name} | {c.concurrency or '-'} | {tok_s} | {ratio} | {same} | {own} | {c.note} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=REPO / "examples" / "prompts.jsonl")
    ap.add_argument("--n", type=int, default=16, help="number of prompts")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--settings", nargs="+", default=["fp32"], choices=["fp32", "bf16", "int8", "int4", "q8", "q16"],
                    help="precisions of our engine (each gets plain and speculative columns); the first is the base")
    ap.add_argument("--skip", nargs="*", default=[], choices=["cli", "hf", "llamacpp", "spec"])
    ap.add_argument("--llamacpp-python", help=f"python with llama_cpp importable (default: {LLAMACPP_PYTHON})")
    ap.add_argument("--llamacpp-server", help="a llama-server binary built for this machine (columns per concurrency)")
    ap.add_argument("--llamacpp-threads", type=int, default=0,
                    help="llama-server threads (0: ours; 1 keeps it off barrier waits beside busy neighbours)")
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-reading", type=int, default=0, metavar="N", help="also read N ~1,390-token prompts")
    ap.add_argument("--interleave", action="store_true", help="run the columns concurrency by concurrency")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 32 new tokens, concurrency 1 and 4")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each of our columns (order alternating; the "
                    "median run is reported, the per-pair speculative / plain ratios printed)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.n, args.new_tokens, args.concurrency = min(args.n, 4), min(args.new_tokens, 32), [1, 4]

    import torch

    from dspine.cpu.threads import configure_torch
    from dspine.embedded.smollm2 import embedded_gguf_path, embedded_target_path
    from dspine.models.tokenizer import HFTokenizer

    threads = configure_torch()
    model_dir = Path(embedded_target_path())
    tok = HFTokenizer(model_dir)
    prompts = load_prompts(args.prompts, args.n)
    prompt_ids = [list(tok.render_chat([{"role": "user", "content": p}])) for p in prompts]
    stops = set(tok.stop_token_ids([]))
    new = args.new_tokens
    header = {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__, "prompts": len(prompts),
              "prompt_tokens_mean": round(sum(map(len, prompt_ids)) / len(prompt_ids), 1), "new_tokens": new,
              "load_before": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(header), flush=True)

    cols: list[Column] = []

    def add(col: Column) -> Column:
        cols.append(col)
        print(json.dumps({"column": col.name, "concurrency": col.concurrency, "tok_s": round(col.tok_s, 2),
                          "seconds": round(col.seconds, 2), "note": col.note}), flush=True)
        return col

    plain_at: dict[int, Column] = {}
    server = args.llamacpp_server if "llamacpp" not in args.skip else None
    server_threads = args.llamacpp_threads or threads
    header["llamacpp_threads"] = server_threads

    def median(runs: list[Column]) -> Column:
        """The run of median time (the lower middle for an even count)."""
        return sorted(runs, key=lambda col: col.seconds)[(len(runs) - 1) // 2]

    def ours_at(c: int) -> None:
        for setting in args.settings:
            kinds = ["plain"] + (["spec"] if "spec" not in args.skip else [])
            runs: dict[str, list[Column]] = {k: [] for k in kinds}
            for rep in range(args.repeats):  # the order alternating, so a load that moves lands on both
                for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                    runs[kind].append(run_ours(prompt_ids, stops, new, c, kind == "spec", setting,
                                               f"ours {'speculative' if kind == 'spec' else 'plain'} {setting}"))
            col = add(median(runs["plain"]))
            plain_at.setdefault(c, col)
            if "spec" in runs:
                spec = median(runs["spec"])
                spec.own_plain = col
                add(spec)
                if args.repeats > 1:
                    pairs = [p.seconds / q.seconds for p, q in zip(runs["plain"], runs["spec"])]
                    print(json.dumps({"concurrency": c, "setting": setting, "speculative_vs_plain_pairs":
                                      [round(x, 3) for x in pairs]}), flush=True)

    def peers_at(c: int) -> None:
        if server:
            add(run_llama_server(server, embedded_gguf_path(), prompt_ids, stops, new, server_threads, c))
        if "hf" not in args.skip and c in (1, 8):
            try:
                add(run_hf(model_dir, prompt_ids, stops, new, c, args.hf_dtype))
            except ImportError as e:
                add(Column("HF transformers", 0, note=f"skipped: {e}"))

    if args.interleave:
        for c in args.concurrency:
            ours_at(c)
            peers_at(c)
    else:
        for c in args.concurrency:
            ours_at(c)
        for c in args.concurrency:
            peers_at(c)
    ref = plain_at.get(1) or next(c for c in cols if c.name.startswith("ours plain"))
    if args.prompt_reading:
        from bench_prefill import prompts as long_prompts

        long_ids = long_prompts(tok, args.prompt_reading, 1390)
        for setting in args.settings:
            plain_at.setdefault(0, add(read_ours(long_ids, setting)))
        if server:
            add(read_server(server, embedded_gguf_path(), long_ids, server_threads))
        if "hf" not in args.skip:
            add(read_hf(model_dir, long_ids, args.hf_dtype))
    with tempfile.TemporaryDirectory() as tmp:
        if "cli" not in args.skip:
            add(run_cli_defaults(prompts, stops, new, Path(tmp)))
        if "llamacpp" not in args.skip and not server:
            py = llamacpp_python(args.llamacpp_python)
            if py is None:
                add(Column("llama.cpp (llama-cpp-python)", 1, note="skipped: llama_cpp not importable"))
            else:
                q4 = embedded_gguf_path()
                add(run_llamacpp(py, q4, "llama.cpp Q4_1 GGUF (one at a time)", prompt_ids, stops, new, threads))
                f32 = Path(tmp) / "smollm2-f32.gguf"
                write_f32_gguf(q4, f32)
                add(run_llamacpp(py, f32, "llama.cpp F32 GGUF (one at a time)", prompt_ids, stops, new, threads))
    header["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\nCPU: {header['cpu']}, {threads} threads, torch {header['torch']}; load average before "
          f"{header['load_before']}, after {header['load_after']}; {len(prompts)} prompts (chat template, mean "
          f"{header['prompt_tokens_mean']} tokens), greedy, {new} new tokens\n")
    print(table(cols, ref, plain_at))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "columns": [
            {k: v for k, v in asdict(c).items() if k != "own_plain"} | {"tok_s": c.tok_s} for c in cols]}, indent=1))


if __name__ == "__main__":
    main()
