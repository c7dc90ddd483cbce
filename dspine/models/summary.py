"""What a loaded target is, in one dict: its family and shape, which parts of its forward run on our CPU kernels,
which features are on (and why not, where one is off) and the draft taps a new draft would read. ``dspine info``
prints it as JSON, ``dspine-batch info`` as lines a newcomer reads."""

from __future__ import annotations

from typing import Any


def summarize(t: Any) -> dict[str, Any]:
    """``t``: a target from ``dspine.load_target``."""
    summary: dict[str, Any] = {
        "class": type(t).__name__,
        "family": getattr(t, "family", None) or t.config.get("model_type"),
        "model_type": t.config.get("model_type"),
        "layers": t.num_layers,
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "max_position": t.max_position,
    }
    describe = getattr(t, "describe", None)
    if callable(describe):
        summary.update(describe())
    summary["on_our_kernels"] = kernel_summary(t)
    gaps = list(t.invariance_gaps)
    summary["features"] = {
        "speculation": "suffix proposals; a DSpine draft (dspine init-draft / dspine train)",
        "structured_outputs_logprobs_penalties_tools_chat_template": True,
        "prefix_cache": not gaps,
        "chunked_prefill": not gaps and not any(type(c).__name__ == "SSMState" for c in t.new_cache(1, 1).layers),
        "not_batch_invariant_because": gaps,
    }
    summary["default_tap_ids"] = t.default_tap_ids(min(5, t.num_layers))
    summary["parameters"] = sum(p.numel() for p in t.parameters())
    return summary


def kernel_summary(t: Any) -> dict[str, Any]:
    """Which parts of a forward run on ``dspine.cpu.kernels`` (our batch-invariant CPU ops) and which on torch."""
    kernel = t.kernel
    ours = kernel.startswith("dspine-")
    names = {type(m).__name__ for m in t.modules()}
    acts = {getattr(m, "act", None) for m in t.modules() if type(m).__name__ == "SwiGLU"} - {None}
    return {
        "linears": kernel,
        "attention": "dspine (rope_store + attend_cache)" if t.fused_attention() else "torch",
        "norms": "dspine (rms_norm)" if "FusedRMSNorm" in names else "torch",
        "mlp_gate": ", ".join(sorted(("dspine (silu_mul)" if ours and a == "silu" else f"torch ({a}, elementwise)")
                                     for a in acts)) or None,
    }
