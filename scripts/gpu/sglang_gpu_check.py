#!/usr/bin/env python
"""The first-GPU checklist of the SGLang DSPINE backend (docs/design.md, "The first GPU run"): what the CPU test path
cannot show, in the order to run it, one JSON line per check and a summary line; exit 0 iff every check passed.
Needs the sglang venv and a CUDA GPU; nothing here runs on CI.

    bash scripts/setup_sglang_venv.sh
    VENV=~/.cache/dspine/venv-sglang
    $VENV/bin/python scripts/gpu/sglang_gpu_check.py --model /models/Qwen3-4B --make-draft /tmp/d \\
        --hybrid-model /models/Qwen3.5-4B            # all checks (~15 min on an H100)
    $VENV/bin/python scripts/gpu/sglang_gpu_check.py --model ... --draft ... --only greedy,syncs

Checks (``--only`` names):

1. ``greedy``: DSPINE with the defaults (CUDA graphs and the overlap scheduler on, ``proposers=auto``) gives plain
   SGLang's greedy tokens; verify rounds ran and the accept histograms add up.
2. ``eager``: the same with ``proposers=dspine`` and no CUDA graphs (the eager selector path).
3. ``processing``: penalties, ``min_tokens`` and ``logit_bias`` under overlap: DSPINE = plain SGLang token for token.
4. ``syncs``: a profile of the rounds for host synchronisation: dspine's own device->host reads per round
   (``DSPINE_SGLANG_SYNC_LOG``: zero in rounds without penalties) and every synchronising CUDA call from any code
   (``torch.cuda.set_sync_debug_mode``, SGLang's included), counted per round.
5. ``suffix``: a repetitive prompt under ``proposers=auto``: suffix tokens proposed and accepted under graphs and
   overlap (the per-source columns), tokens still plain decoding's.
6. ``sampled``: the second token's law under top-p and top-k at T=0.8 on a tiny random target (exact law from
   transformers), a chi-square test; and one seed twice in different batches (reproducible text: SGLang 0.5.23
   honours per-request seeds only with deterministic inference, so this one is expected to report "differs").
7. ``hybrid``: a Qwen3.5 hybrid target (``--hybrid-model``) with ReplaySSM, the extra_buffer prefix cache, page size
   16 and a track interval of 32, generating past more than two intervals: DSPINE = plain SGLang, and a
   radix-cached continuation equals a full prefill.
8. ``auto``: ``dspine-batch generate --engine auto`` with flashinfer made unimportable: picks SGLang with another
   attention backend (one line says which) and completes.

``--make-draft DIR`` writes an untrained DSpine draft for ``--model`` (``init_draft``; tau ~ 1, enough for identity)
when you have no trained one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CHECKS = ("greedy", "eager", "processing", "syncs", "suffix", "sampled", "hybrid", "auto")
HYBRID_FLAGS = ("--linear-attn-backend triton --enable-linear-replayssm-spec --mamba-ssm-dtype float32 "
                "--mamba-radix-cache-strategy extra_buffer --max-mamba-cache-size 64 --page-size 16 "
                "--mamba-track-interval 32")
TEXTS = ["Explain speculative decoding in two sentences.", "Write a haiku about GPUs.",
         "List three prime numbers and say why they are prime.", "def fibonacci(n):",
         "The capital of France is", "Translate 'good morning' to German and Spanish.",
         "Summarise the rules of chess briefly.", "What is 17 * 23? Show your work."]
REPETITIVE = "Repeat this line ten times, exactly: the quick brown fox jumps over the lazy dog, 1 2 3 4 5."


def _requests(tok, n: int, new: int, texts=TEXTS, prefix: str = "r", **params):
    from dspine_batch.engines.base import Request, SamplingParams

    out = []
    for i in range(n):
        text = texts[i % len(texts)]
        ids = tok.render_chat([{"role": "user", "content": text}]) if tok.has_chat_template else tok.encode(text)
        params.setdefault("stop_token_ids", tuple(tok.eos_ids()))
        out.append(Request(f"{prefix}{i}", 0, ids, SamplingParams(max_new_tokens=new, seed=i, **params)))
    return out


def _run(model: str, draft: str, args: dict, reqs, env: dict | None = None, window: int = 8):
    """Results by row id and seconds, through the batch tool's SGLang adapter (one engine, started and closed)."""
    from dspine_batch.engines.sglang.engine import SGLangEngine

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        eng = SGLangEngine.load(model, draft, args)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        t0 = time.perf_counter()
        res = {r.row_id: r for r in eng.run(reqs, max_in_flight=window)}
        return res, time.perf_counter() - t0
    finally:
        eng.close()


def _same(a: dict, b: dict) -> dict:
    equal = [k for k in a if a[k].token_ids == b[k].token_ids]
    errors = [r.error for r in [*a.values(), *b.values()] if r.error]
    return {"equal": len(equal), "of": len(a), "errors": errors[:3], "ok": len(equal) == len(a) and not errors}


def _spec_stats(res: dict) -> dict:
    steps = sum(r.verify_steps or 0 for r in res.values())
    return {"verify_steps": steps, "tau": round(sum(r.completion_tokens - 1 for r in res.values()) / max(steps, 1), 3),
            "histograms_ok": all(sum(r.accept_histogram or []) == (r.verify_steps or 0) for r in res.values()),
            "suffix_proposed": sum(r.suffix_tokens_proposed or 0 for r in res.values()),
            "suffix_accepted": sum(r.suffix_tokens_accepted or 0 for r in res.values())}


class Checklist:
    def __init__(self, a):
        from dspine.models.tokenizer import HFTokenizer

        self.a = a
        self.tok = HFTokenizer(Path(a.model))
        self.common = {"server_flags": a.server_flags} if a.server_flags else {}
        self.spec = dict(self.common, block_size=str(a.block_size))
        self._base = None

    def base(self):
        if self._base is None:
            self._base = _run(self.a.model, "none", dict(self.common),
                              _requests(self.tok, self.a.prompts, self.a.new_tokens))[0]
        return self._base

    def greedy(self) -> dict:
        spec, secs = _run(self.a.model, self.a.draft, self.spec, _requests(self.tok, self.a.prompts, self.a.new_tokens))
        out = {**_same(self.base(), spec), **_spec_stats(spec), "seconds": round(secs, 2)}
        out["ok"] = out["ok"] and out["verify_steps"] > 0 and out["histograms_ok"]
        return out

    def eager(self) -> dict:
        args = dict(self.spec, proposers="dspine", disable_cuda_graph="true")
        spec, secs = _run(self.a.model, self.a.draft, args, _requests(self.tok, self.a.prompts, self.a.new_tokens))
        out = {**_same(self.base(), spec), **_spec_stats(spec), "seconds": round(secs, 2)}
        out["ok"] = out["ok"] and out["verify_steps"] > 0
        return out

    def processing(self) -> dict:
        eos = tuple(self.tok.eos_ids())
        params = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=24,
                      logit_bias=((eos[0], 5.0),))
        reqs = _requests(self.tok, self.a.prompts, self.a.new_tokens, prefix="p", **params)
        plain, _ = _run(self.a.model, "none", dict(self.common), reqs)
        spec, _ = _run(self.a.model, self.a.draft, self.spec, reqs)
        out = {**_same(plain, spec), **_spec_stats(spec)}
        out["min_tokens_held"] = all(len(r.token_ids) >= 24 for r in spec.values())
        out["ok"] = out["ok"] and out["min_tokens_held"] and out["verify_steps"] > 0
        return out

    def syncs(self) -> dict:
        from dspine.sglang.rounds import SYNC_LOG_ENV

        log = Path(tempfile.mkdtemp()) / "syncs.jsonl"
        reqs = _requests(self.tok, self.a.prompts, 64)
        reqs += _requests(self.tok, 2, 64, prefix="pen", presence_penalty=0.5)
        _run(self.a.model, self.a.draft, self.spec, reqs, env={SYNC_LOG_ENV: str(log)})
        rounds = [json.loads(line) for line in log.read_text().splitlines()]
        decode = [r for r in rounds if r["mode"] == "decode"]
        free = [r for r in decode if not r["needs"]]
        out = {"decode_rounds": len(decode), "rounds_without_needs": len(free),
               "ours_in_free_rounds": sum(r["syncs"] for r in free),
               "ours_in_needing_rounds": sorted({r["syncs"] for r in decode if r["needs"]}),
               "cuda_syncs_per_free_round": sorted({r.get("cuda_syncs", -1) for r in free})[:8]}
        out["ok"] = bool(free) and out["ours_in_free_rounds"] == 0
        return out

    def suffix(self) -> dict:
        reqs = _requests(self.tok, 2, 256, texts=[REPETITIVE], prefix="s")
        plain, _ = _run(self.a.model, "none", dict(self.common), reqs)
        spec, _ = _run(self.a.model, self.a.draft, dict(self.spec, proposers="auto"), reqs, window=1)
        out = {**_same(plain, spec), **_spec_stats(spec)}
        out["ok"] = out["ok"] and out["suffix_accepted"] > 0
        return out

    def sampled(self) -> dict:
        return _sampled_check(self.a)

    def hybrid(self) -> dict:
        if not self.a.hybrid_model:
            return {"ok": None, "skipped": "no --hybrid-model"}
        model = self.a.hybrid_model
        draft = self.a.hybrid_draft or _make_draft(model, Path(tempfile.mkdtemp()) / "hybrid-draft", self.a.block_size)
        flags = " ".join(x for x in (self.a.server_flags, HYBRID_FLAGS) if x)
        from dspine.models.tokenizer import HFTokenizer

        tok = HFTokenizer(Path(model))
        reqs = _requests(tok, 4, 160)  # > 2 track intervals of 32 (and > 2 pages of 16) past the prompt
        plain, _ = _run(model, "none", {"server_flags": flags}, reqs)
        spec, _ = _run(model, draft, {"server_flags": flags, "block_size": str(self.a.block_size)}, reqs)
        out = {**_same(plain, spec), **_spec_stats(spec)}
        again = [reqs[0], type(reqs[0])("again", 0, reqs[0].prompt_ids, reqs[0].params)]
        twice, _ = _run(model, draft, {"server_flags": flags, "block_size": str(self.a.block_size)}, again, window=1)
        out["cached_equals_full_prefill"] = twice["r0"].token_ids == twice["again"].token_ids == spec["r0"].token_ids
        out["cached_prompt_tokens"] = twice["again"].cached_prompt_tokens
        out["ok"] = out["ok"] and out["cached_equals_full_prefill"]
        return out

    def auto(self) -> dict:
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "flashinfer.py").write_text("raise ImportError('flashinfer hidden by the GPU check')\n")
            src, out_dir = Path(d) / "in.jsonl", Path(d) / "out"
            src.write_text("".join(json.dumps({"key": f"k{i}", "prompt": t}) + "\n" for i, t in enumerate(TEXTS)))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([d, str(REPO), os.environ.get("PYTHONPATH", "")])}
            p = subprocess.run([sys.executable, "-m", "dspine_batch.cli", "generate", str(src), "-o", str(out_dir),
                                "--engine", "auto", "--model", self.a.model, "--draft", self.a.draft,
                                "--max-new-tokens", "32", "--progress", "none"],
                               capture_output=True, text=True, env=env, timeout=900)
        line = next((x for x in p.stderr.splitlines() if "--engine auto picked" in x), None)
        return {"ok": p.returncode == 0 and line is not None and "picked sglang" in line, "line": line,
                "rc": p.returncode, "stderr_tail": p.stderr[-600:] if p.returncode else ""}


def _make_draft(model: str, out: Path, block: int) -> str:
    import torch

    from dspine import init_draft, load_target

    target = load_target(model, dtype=torch.float32, device="cpu")
    init_draft(target, num_layers=5, block_size=block).to(torch.bfloat16).save(out)
    return str(out)


def _sampled_check(a) -> dict:
    """Chi-square of the second token under top-p 0.9 / top-k 20 at T=0.8 on a tiny random target (the CPU tests'
    builder), against its exact law; and one seed twice in different batches."""
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import chi2_pvalue, random_pair, run_engine  # the CPU tests' tiny models, runner (CUDA here)

    d = Path(tempfile.mkdtemp())
    target, draft = random_pair(d)
    prompt, n, T, top_p, top_k = [3, 17, 42, 99, 7], 2000, 0.8, 0.9, 20

    def law(logits):
        p = torch.softmax(logits.double() / T, -1)
        keep = torch.zeros_like(p, dtype=torch.bool)
        vals, idx = p.sort(descending=True)
        cum = vals.cumsum(-1)
        mask = (cum - vals) < top_p
        mask[top_k:] = False
        keep[idx[mask]] = True
        q = torch.where(keep, p, torch.zeros_like(p))
        return q / q.sum()

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = law(model(torch.tensor([prompt])).logits[0, -1])
        V = p1.shape[0]
        ids = torch.cat([torch.tensor([prompt]).expand(V, -1), torch.arange(V)[:, None]], 1)
        rows = model(ids).logits[:, -1]
        p2 = torch.stack([law(r) for r in rows])
    expected = (p1 @ p2) * n
    sp = {"max_new_tokens": 2, "temperature": T, "top_p": top_p, "top_k": top_k}

    def workload(engine):
        outs = engine.generate(input_ids=[prompt] * n, sampling_params=[dict(sp, sampling_seed=i) for i in range(n)])
        seeded = {"max_new_tokens": 24, "temperature": T, "top_p": top_p, "top_k": top_k, "sampling_seed": 1234}
        alone = engine.generate(input_ids=prompt, sampling_params=seeded)
        crowd = engine.generate(input_ids=[prompt, [5, 6, 7], [9, 9, 9, 9]], sampling_params=[seeded] * 3)
        return outs, alone["output_ids"], crowd[0]["output_ids"]

    outs, alone, crowd = run_engine(target, workload, draft=draft)
    counts = torch.zeros(V, dtype=torch.float64)
    for o in outs:
        counts[o["output_ids"][1]] += 1
    pval = chi2_pvalue(counts, expected / n)
    return {"ok": pval > 1e-3, "p": pval, "seed_repeats": "same" if alone == crowd else "differs"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a dense target (Qwen3 / Llama family)")
    ap.add_argument("--draft", help="DSpine draft dir for --model")
    ap.add_argument("--make-draft", help="write an untrained DSpine draft for --model here and use it")
    ap.add_argument("--hybrid-model", help="a Qwen3.5 hybrid checkpoint (check 7)")
    ap.add_argument("--hybrid-draft", help="its DSpine draft (default: an untrained one)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--server-flags", default="", help="extra sglang serve flags (e.g. --attention-backend fa3)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    a = ap.parse_args()
    if a.make_draft:
        a.draft = _make_draft(a.model, Path(a.make_draft), a.block_size)
    if not a.draft:
        ap.error("--draft or --make-draft is required")
    wanted = [c.strip() for c in a.only.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CHECKS]
    if unknown:
        ap.error(f"--only: unknown checks {unknown} (choose from {', '.join(CHECKS)})")
    checks = Checklist(a)
    results = {}
    for name in CHECKS:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            res = getattr(checks, name)()
        except Exception as e:  # one broken check must not hide the others' results
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["seconds_total"] = round(time.perf_counter() - t0, 1)
        results[name] = res
        print(json.dumps({"check": name, **res}, default=str), flush=True)
    failed = [k for k, v in results.items() if v.get("ok") is False]
    print(json.dumps({"summary": {k: v.get("ok") for k, v in results.items()}, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
