"""SGLang server arguments for the batch engine: ``sglang serve`` flags and ``--engine-arg`` values -> typed
``ServerArgs`` keyword arguments (SGLang's own argument parser types them), and our sampling settings ->
SGLang ``sampling_params``.

Precedence: our defaults (``model_path``, ``DSPINE`` with the draft; compact JSON under a schema,
``constrained_json_disable_any_whitespace``, as the reference engine compiles schemas; on a machine without a GPU
the CPU test path's settings, see ``dspine.sglang.cpu``), then ``--engine-arg server_flags="..."``, then single
``KEY=VALUE`` args.

``proposers`` (``auto`` default, ``dspine``, ``suffix``; DSPINE only) is not a server argument: SGLang's
``ServerArgs`` has no field for it, so the engine passes it to the DSPINE worker through the
``DSPINE_PROPOSERS`` environment variable, set while the engine starts its processes (``dspine.sglang.suffix``).

We tokenize and render chat templates ourselves and send token ids, as with the reference engine, but SGLang loads
the tokenizer too (``skip_tokenizer_init`` off): its grammar backend (xgrammar over the vocabulary) and
``min_new_tokens`` (the stop ids) refuse to run without one.
"""

from __future__ import annotations

import difflib
import json
import shlex
import sys
from typing import Any

from dspine.decoding.grammar import choice_ebnf
from dspine_batch.engines.base import SamplingParams, Structure
from dspine_batch.engines.sglang.processes import on_sigquit
from dspine_batch.errors import UsageError

ADAPTER_KEYS = ("server_flags", "block_size", "poll_seconds", "meta_log", "proposers")
PROPOSERS = ("auto", "dspine", "suffix")  # dspine.sglang.suffix.PROPOSERS
PROPOSERS_ENV = "DSPINE_PROPOSERS"  # dspine.sglang.suffix.PROPOSERS_ENV
# ServerArgs that change how fast, not what: left out of the run fingerprint so they can change on resume.
OPERATIONAL_KEYS = frozenset({
    "mem_fraction_static", "max_running_requests", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill",
    "cuda_graph_bs_decode", "cuda_graph_bs_prefill", "disable_cuda_graph", "min_free_slots_delay",
    "max_mamba_cache_size", "log_level", "custom_sigquit_handler", "port", "host", "chunked_prefill_size",
    "max_prefill_tokens", "enable_metrics", "tool_call_parser", "reasoning_parser", "disable_overlap_schedule",
    "attention_backend", "speculative_draft_attention_backend", "sampling_backend", "linear_attn_backend",
    "max_total_tokens", "schedule_policy", "mamba_radix_cache_strategy",
})
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" (sampling_params.TOP_K_ALL)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Refused on SGLang's CPU test path (docs/design.md, "The CPU test path"): the prefix cache's Mamba state
# snapshots need GPU kernels (SGLang asserts platform support; its CPU prefill kernel returns no chunk states).
CPU_REFUSED_MAMBA_STRATEGIES = ("extra_buffer", "extra_buffer_lazy")


def _sglang_parser():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang", add_help=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # we parse fragments (one flag at a time); --model-path is ours anyway
        action.required = False
    return parser


def parse_server_flags(argv: list[str], parser=None) -> dict[str, Any]:
    """``sglang serve``-style flags -> {ServerArgs field: typed value}, only for the flags actually given."""
    parser = parser or _sglang_parser()
    if argv[:2] == ["sglang", "serve"]:
        argv = argv[2:]
    opt_to_dest = {o: a.dest for a in parser._actions for o in a.option_strings}
    given = []
    for a in argv:
        if a.startswith("--"):
            opt = a.split("=", 1)[0]
            if opt not in opt_to_dest:
                close = difflib.get_close_matches(opt, list(opt_to_dest), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise UsageError(f"SGLang flag {opt}: unknown{hint}")
            given.append(opt_to_dest[opt])
    try:
        ns, extra = parser.parse_known_args(argv)
    except (Exception, SystemExit) as e:  # argparse.ArgumentError (exit_on_error=False) or its error() exit
        raise UsageError(f"SGLang flags {shlex.join(argv)!r}: {e}") from e
    if extra:
        raise UsageError(f"SGLang flags: cannot parse {shlex.join(extra)!r}")
    return {d: getattr(ns, d) for d in given}


def _typed_value(key: str, value: Any, parser) -> dict[str, Any]:
    """One ``KEY=VALUE`` engine arg -> {ServerArgs field: value typed by SGLang's own parser}."""
    opt = "--" + key.replace("_", "-")
    action = next((a for a in parser._actions if opt in a.option_strings), None)
    if action is None:
        names = [o[2:].replace("-", "_") for a in parser._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(key, names, n=3)
        raise UsageError(f"--engine-arg {key}: not an SGLang server argument"
                         + (f" (did you mean {', '.join(close)}?)" if close else "")
                         + f"; adapter keys: {', '.join(ADAPTER_KEYS)}")
    if action.nargs == 0:  # a switch: the field takes the boolean the user gave
        if isinstance(value, bool):
            return {action.dest: value}
        v = str(value).strip().lower()
        if v not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise UsageError(f"--engine-arg {key}={value}: expected true or false")
        return {action.dest: v in ("1", "true", "yes", "on")}
    return parse_server_flags([opt, str(value)], parser)


def cpu_defaults(speculative: bool) -> dict[str, Any]:
    """SGLang's CPU test path (no GPU here): CPU device, torch_native attention (draft too), no CUDA graphs."""
    from dspine.sglang.cpu import engine_kwargs

    kw = engine_kwargs()
    if not speculative:
        kw.pop("speculative_draft_attention_backend")
    return kw


def build_server_kwargs(model_path: str, draft_path: str | None, engine_args: dict[str, Any],
                        parser=None, on_cpu: bool = False, gpu_dtype: str | None = None
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ServerArgs kwargs, adapter options). Precedence: defaults < server_flags < single KEY=VALUE args.
    ``gpu_dtype``: what ``dtype=auto`` resolves to on this GPU (``readiness.gpu_dtype``; bfloat16 when not given)."""
    parser = parser or _sglang_parser()
    args = {k.replace("-", "_"): v for k, v in engine_args.items()}
    opts: dict[str, Any] = {"poll_seconds": 1.0, "meta_log": None, "proposers": None}
    kwargs: dict[str, Any] = {"model_path": str(model_path), "skip_tokenizer_init": False, "log_level": "error",
                              "constrained_json_disable_any_whitespace": True}
    if on_cpu:
        kwargs.update(cpu_defaults(draft_path is not None))
    else:  # dtype=auto as both engines resolve it (never the checkpoint's own: fp16/fp32 checkpoints exist)
        kwargs["dtype"] = gpu_dtype if gpu_dtype is not None else "bfloat16"
    if draft_path is not None:
        kwargs.update(speculative_algorithm="DSPINE", speculative_draft_model_path=str(draft_path))
    flags = args.pop("server_flags", None)
    if flags:
        parsed = parse_server_flags(shlex.split(str(flags)), parser)
        for key in ("model_path", "speculative_draft_model_path"):  # --model / --draft decide these
            if key in parsed and parsed.pop(key) != kwargs.get(key):
                print(f"dspine-batch: note: server_flags {key} ignored (--model/--draft decide it)", file=sys.stderr)
        kwargs.update(parsed)
    if "block_size" in args:
        args["speculative_num_draft_tokens"] = args.pop("block_size")
    if "meta_log" in args:  # append each request's raw meta_info (JSON lines) to this file: audits, tests
        opts["meta_log"] = str(args.pop("meta_log"))
    proposers = str(args.pop("proposers", "auto")).strip().lower()
    if proposers not in PROPOSERS:
        raise UsageError(f"--engine-arg proposers={proposers}: expected one of {', '.join(PROPOSERS)}")
    if "poll_seconds" in args:
        try:
            opts["poll_seconds"] = float(args.pop("poll_seconds"))
        except ValueError as e:
            raise UsageError(f"--engine-arg poll_seconds: {e}") from e
    if str(args.get("dtype", "")).strip().lower() == "auto":  # the batch tool's auto, resolved above
        args.pop("dtype")
    for key, value in args.items():
        if key in ("model_path", "speculative_draft_model_path"):
            raise UsageError(f"--engine-arg {key}: use --model/--draft instead")
        kwargs.update(_typed_value(key, value, parser))
    if on_cpu and kwargs.get("mamba_radix_cache_strategy") in CPU_REFUSED_MAMBA_STRATEGIES:
        raise UsageError(f"mamba_radix_cache_strategy={kwargs['mamba_radix_cache_strategy']}: SGLang 0.5.23 keeps "
                         "no Mamba state snapshots on the CPU (no GPU here); use no_buffer or leave it unset")
    if on_cpu and _cpu_hybrid_overlap(model_path, kwargs):
        # SGLang's auto strategy would pick extra_buffer for overlap scheduling, which the CPU cannot snapshot
        kwargs["disable_radix_cache"] = True
        print("dspine-batch: note: a hybrid target on the CPU with overlap scheduling runs without the prefix "
              "cache (SGLang keeps Mamba state snapshots on GPUs only)", file=sys.stderr)
    if draft_path is None and kwargs.get("speculative_algorithm"):
        raise UsageError(f"--engine-arg speculative_algorithm={kwargs['speculative_algorithm']} needs --draft PATH")
    if str(kwargs.get("speculative_algorithm") or "").upper() == "DSPINE":
        opts["proposers"] = proposers  # the DSPINE worker's DSPINE_PROPOSERS (None: no DSPINE, nothing to set)
    kwargs["custom_sigquit_handler"] = on_sigquit
    return kwargs, opts


def _cpu_hybrid_overlap(model_path: str, kwargs: dict[str, Any]) -> bool:
    """A hybrid target about to run the overlap scheduler on the CPU with SGLang choosing its Mamba cache strategy."""
    from dspine.sglang.config import is_hybrid

    return (not kwargs.get("disable_overlap_schedule") and not kwargs.get("disable_radix_cache")
            and kwargs.get("mamba_radix_cache_strategy") in (None, "auto") and is_hybrid(model_path))


def sampling_params(p: SamplingParams) -> dict[str, Any]:
    """Our per-request sampling settings -> SGLang ``sampling_params`` (stop strings applied afterwards, as the
    reference engine does). Structures become SGLang's grammar fields: ``json_object`` the schema
    ``{"type": "object"}`` (as the reference engine compiles it; SGLang's own ``$$ANY$$`` also allows arrays),
    ``choice`` an EBNF alternation of the strings (``dspine.decoding.grammar.choice_ebnf``, the reference
    engine's translation)."""
    sp: dict[str, Any] = {"max_new_tokens": int(p.max_new_tokens), "temperature": float(p.temperature),
                          "top_p": float(p.top_p), "top_k": int(p.top_k) if p.top_k > 0 else TOP_K_ALL,
                          "stop_token_ids": list(p.stop_token_ids), "skip_special_tokens": False}
    if p.temperature > 0:
        sp["sampling_seed"] = int(p.seed)
    if p.presence_penalty:
        sp["presence_penalty"] = float(p.presence_penalty)
    if p.frequency_penalty:
        sp["frequency_penalty"] = float(p.frequency_penalty)
    if p.repetition_penalty != 1.0:
        sp["repetition_penalty"] = float(p.repetition_penalty)
    if p.min_tokens:
        sp["min_new_tokens"] = int(p.min_tokens)
    if p.logit_bias:
        sp["logit_bias"] = {str(int(t)): float(b) for t, b in p.logit_bias}
    if p.structure is not None:
        sp.update(grammar_params(p.structure))
    return sp


def grammar_params(structure: Structure) -> dict[str, str]:
    kind, spec = structure.kind, structure.spec
    if kind == "json_schema":
        return {"json_schema": spec}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "regex":
        return {"regex": spec}
    if kind == "choice":
        return {"ebnf": choice_ebnf(json.loads(spec))}
    return {"ebnf": spec}


def logprob_args(p: SamplingParams) -> dict[str, Any]:
    """``generate`` arguments for a request's logprobs: the completion's only (``logprob_start_len=-1``)."""
    if not p.logprobs:
        return {}
    return {"return_logprob": True, "top_logprobs_num": int(p.top_logprobs), "logprob_start_len": -1}
