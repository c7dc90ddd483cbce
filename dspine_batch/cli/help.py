"""What ``dspine-batch generate --help`` says beyond each option's own line: the sections its options are grouped
in (``SECTIONS``, in the order a newcomer needs them, the common options of each first; ``cli.generate`` declares
each option under one of them with click-option-group), and the ``--engine-arg`` keys as a table (``ENGINE_ARGS``,
rendered by ``engine_arg_table``). Kept apart from ``cli`` so the command's wiring reads as wiring, and imported by
it alone: no engine is imported to print help (a test checks the table against the engines' own key lists).
"""

from __future__ import annotations

import textwrap

# (title, one line on what the section is for); ``cli.generate``'s options are declared under these, in this order
SECTIONS = (
    ("Inputs", "where the rows come from and which columns hold the prompt"),
    ("What to ask", "the prompt built from the row, the sampling settings and the shape of the answer; a row's own "
                    "fields (max_tokens, temperature, response_format, ...) override these for that row"),
    ("Speculation and engine", "the model, the draft that proposes tokens, and the engine that runs them"),
    ("Output", "what is written to OUTDIR, and how often"),
    ("Run control", "resuming, retrying, sharding, errors, hangs and progress"),
    ("Watching and cost", "Prometheus metrics for dashboards and alerts, and what the job costs (docs/monitoring.md)"),
)

# (key, engine, default, what it does) for ``--engine-arg KEY=VALUE``
ENGINE_ARGS = (
    ("proposers", "both", "auto", "reference, auto: per row and round the draft's block, a suffix match or a plain "
     "step, whichever the cost model prices fastest; sglang, auto: suffix matches on greedy rows where they beat the "
     "draft; suffix: suffix matches only (on sglang wherever one exists, sampled rows too); dspine: the draft only"),
    ("dtype", "reference", "auto", "auto: bfloat16 where our bf16 kernels run the target (a dense model on a CPU with "
     "AVX512-BF16 or AMX), else float32; float32: the exact path; bfloat16. Part of the run's identity"),
    ("quant", "reference", "none", "int8, int4 (weight-only); q8, q16: our integer dot products over GGUF blocks"),
    ("batch_size", "reference", "8", "rows decoded together (at most --max-in-flight)"),
    ("threads", "reference", "all allowed", "CPU threads (the cores this process may use: affinity, cgroup, Slurm)"),
    ("block_size", "both", "the draft's", "tokens in a draft block (2..the draft's; its decode.json may set it)"),
    ("verify", "reference", "cost", "cost: verify as many proposed tokens as pay for themselves, per row and round; "
     "fixed: always the whole block"),
    ("dynamic_threshold", "reference", "off", "stop each proposal at confidence < X (needs a fitted confidence head)"),
    ("accept_prior", "reference", "the draft's", "per-token acceptance assumed before a row has evidence"),
    ("suffix_max", "reference", "16", "tokens a suffix proposal may hold (1..64)"),
    ("suffix_cap", "reference", "262144", "finished-output tokens kept for suffix matches, oldest dropped first "
     "(~130 MB)"),
    ("prefix_cache_mb", "reference", "512", "prompt prefixes kept, so rows sharing a system prompt or template (and "
     "--num-samples siblings) prefill only what is new; 0 = off"),
    ("prefill_chunk", "reference", "512", "prompt tokens per prefill forward: rows in flight decode between a long "
     "prompt's chunks; 0 = whole prompts"),
    ("server_flags", "sglang", "-", "SGLang server flags as one string, e.g. \"--mem-fraction-static 0.8\"; any "
     "other KEY=VALUE is one SGLang server argument"),
    ("poll_seconds", "sglang", "1.0", "how often the adapter polls the engine for finished requests"),
    ("meta_log", "sglang", "-", "append each request's raw meta_info (JSON lines) to this file"),
)


def engine_arg_table(width: int = 108) -> str:
    """``ENGINE_ARGS`` as a plain-text table for the help's epilog (click keeps a ``\\b`` paragraph as written)."""
    key_w = max(len(k) for k, *_ in ENGINE_ARGS)
    eng_w = max(len(e) for _, e, *_ in ENGINE_ARGS)
    def_w = max(len(d) for *_, d, _ in ENGINE_ARGS)
    indent = 2 + key_w + 2 + eng_w + 2 + def_w + 2
    lines = ["\b", "Engine arguments (--engine-arg KEY=VALUE, repeatable; job file: an [engine_args] table):",
             f"  {'key':<{key_w}}  {'engine':<{eng_w}}  {'default':<{def_w}}  what it does"]
    for key, engine, default, what in ENGINE_ARGS:
        wrapped = textwrap.wrap(what, max(30, width - indent)) or [""]
        lines.append(f"  {key:<{key_w}}  {engine:<{eng_w}}  {default:<{def_w}}  {wrapped[0]}")
        lines += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(lines)
