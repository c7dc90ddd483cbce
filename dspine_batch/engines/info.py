"""``dspine-batch info [MODEL]``: what a job on MODEL would run, before running one: the model as ``--model`` resolves
it (the embedded default, an HF directory, a FILE.gguf converted once), its family and shape, what runs on our CPU
kernels, the features on, and the draft ``--draft`` pairs with it. The target's own summary is the library's
(``dspine.models.summary``, what ``dspine info`` prints as JSON); this adds the batch tool's view of the pair."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspine_batch.engines.models import resolve_draft, resolve_model
from dspine_batch.errors import UsageError


def model_info(model: str = "embedded", draft: str = "embedded") -> dict[str, Any]:
    """The summary of ``model`` and of the draft a job would pair with it (None: no draft, plain decoding and
    suffix proposals). A model that cannot be loaded is a ``UsageError`` naming it."""
    from dspine import load_target
    from dspine.cpu.precision import resolve
    from dspine.models.registry import auto_dtype
    from dspine.models.summary import summarize

    path = resolve_model(model)
    try:  # as the reference engine loads it by default (--engine-arg dtype=auto): bf16 where our bf16 kernels run it
        precision = resolve(auto_dtype(path, "none"))
        target = load_target(path, dtype=precision.torch_dtype, device="cpu", quant=precision.quant)
    except (ValueError, OSError) as e:  # ModelLoadError is a ValueError: one line naming what is unsupported
        raise UsageError(f"--model {model}: {' '.join(str(e).split())}") from e
    quant = "" if precision.quant == "none" else f", quant {precision.quant}"
    out = {"model": model, "path": str(path), "precision": precision.dtype + quant, **summarize(target)}
    draft_path = resolve_draft(draft, model)
    out["draft"] = None if draft_path is None else {"draft": draft, "path": str(draft_path), **_draft(draft_path)}
    return out


def _draft(path: Path) -> dict[str, Any]:
    """A draft directory's shape (``config.json``) and the decode settings measured for it (``decode.json``)."""
    cfg = json.loads((path / "config.json").read_text())
    decode = path / "decode.json"
    settings = {k: v for k, v in json.loads(decode.read_text()).items() if not k.startswith("_")} \
        if decode.is_file() else {}
    return {"layers": cfg.get("num_hidden_layers"), "block_size": cfg.get("block_size"), "decode": settings}


def format_info(d: dict[str, Any]) -> str:
    """The summary as a few labelled lines."""
    k, f = d["on_our_kernels"], d["features"]
    name = "" if d["model"] == d["path"] else f" -> {d['path']}"
    lines = [
        f"model       {d['model']}{name}",
        f"family      {d['family']} ({d['class']}): {d['layers']} layers, hidden {d['hidden_size']:,}, vocab "
        f"{d['vocab_size']:,}, context {d['max_position']:,}",
        f"precision   {d['precision']} (--engine-arg dtype=auto on this CPU)",
        f"kernels     linears {k['linears']}; attention {k['attention']}; norms {k['norms']}"
        + (f"; MLP gate {k['mlp_gate']}" if k.get("mlp_gate") else ""),
        f"features    {f['speculation']}; structured outputs, logprobs, penalties, tools, chat template; prefix cache "
        f"{'on' if f['prefix_cache'] else 'off'}, chunked prefill {'on' if f['chunked_prefill'] else 'off'}"
        + (f" (not batch invariant: {'; '.join(f['not_batch_invariant_because'])})"
           if f["not_batch_invariant_because"] else ""),
        f"draft taps  {', '.join(map(str, d['default_tap_ids']))} (the target layers a new draft reads: dspine "
        "init-draft)",
    ]
    dr = d.get("draft")
    if dr is None:
        lines.append("draft       none: suffix proposals only (a draft for this model: dspine init-draft, dspine "
                     "train; then --draft PATH)")
    else:
        decode = ", ".join(f"{key} {value}" for key, value in dr["decode"].items())
        lines.append(f"draft       {dr['draft']} -> {dr['path']}: {dr['layers']} layers, block {dr['block_size']}"
                     + (f"; runs with {decode} (its decode.json)" if decode else ""))
    return "\n".join(lines)
