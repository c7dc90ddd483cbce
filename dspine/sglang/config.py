"""Validation of the DSPINE server arguments and draft checkpoint (pure Python + safetensors, no SGLang).

Used by the SGLang algorithm's ``validate_server_args``/``handle_server_args`` (so a bad launch fails at
``ServerArgs`` resolution, before any GPU work) and by the start-up self-check. Every error is a
``DSpineConfigError`` (a ``ValueError``, which SGLang reports as a launch error) whose message names the flag
or file and says what to do.

Block-size semantics (docs/design.md, "The SGLang plugin"): ``--speculative-num-draft-tokens`` is the verify width B
*including* the anchor (bonus) slot, which is also what a DSpine draft's ``block_size`` counts: block 16 =
1 anchor + 15 drafts. A causal draft's slots never depend on later slots, so any 2 <= B <= block_size is
exact; B > block_size would ask the draft for slots it was never trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURE = "DSpineDraftModel"


class DSpineConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DraftInfo:
    path: Path
    config: dict
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    hidden_size: int
    vocab_size: int


def _load_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise DSpineConfigError(f"{what}: {path} does not exist") from e
    except (OSError, json.JSONDecodeError) as e:
        raise DSpineConfigError(f"{what}: cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise DSpineConfigError(f"{what}: {path} is not a JSON object")
    return data


def read_draft(path: str | Path | None, *, check_weights: bool = True) -> DraftInfo:
    """Read and validate a DSpine draft checkpoint directory (docs/design.md, "The DSpine draft")."""
    flag = "--speculative-draft-model-path"
    if path is None:
        raise DSpineConfigError(f"DSPINE needs {flag} (a DSpine draft checkpoint directory)")
    p = Path(path)
    if not p.is_dir():
        raise DSpineConfigError(
            f"{flag} {path}: not a local directory. DSPINE reads the draft config at start-up; download the "
            "checkpoint first (e.g. `huggingface-cli download REPO --local-dir DIR`) and pass DIR")
    cfg = _load_json(p / "config.json", flag)
    archs = cfg.get("architectures") or []
    if ARCHITECTURE not in archs:
        hint = ""
        if any("DFlash" in str(a) for a in archs) or ("dflash_config" in cfg and "dspine_config" not in cfg):
            hint = " It looks like a DFlash draft: use --speculative-algorithm DFLASH for it, or pass a DSpine draft."
        raise DSpineConfigError(
            f"{flag} {path}: config.json architectures = {archs!r}, expected [{ARCHITECTURE!r}] "
            f"(not a DSpine draft checkpoint).{hint}")
    if cfg.get("dflash_config") is None:
        raise DSpineConfigError(
            f"{flag} {path}: config.json has no dflash_config block (block_size, target_layer_ids, "
            "mask_token_id); SGLang reads it for every DFlash-family algorithm")
    from dspine.draft.config import parse_draft_config
    from dspine.models.checkpoint import ModelLoadError

    try:
        spec = parse_draft_config(cfg, where=str(p / "config.json"))
    except ModelLoadError as e:
        raise DSpineConfigError(f"{flag}: {e}") from e
    if check_weights:
        _check_weights(p)
    return DraftInfo(p, cfg, spec.block_size, spec.mask_token_id, tuple(spec.target_layer_ids),
                     spec.num_target_layers, spec.hidden_size, spec.vocab_size)


def _check_weights(p: Path) -> None:
    flag = "--speculative-draft-model-path"
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise DSpineConfigError(f"{flag} {p}: no *.safetensors weights")
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names = set(st.keys())
            for name in ("transfer_ready", "model.transfer_ready"):
                if name in names:
                    if not bool(st.get_tensor(name)):
                        raise DSpineConfigError(
                            f"{flag} {p}: transfer_ready is false in {f.name}: the transfer codes were never "
                            "computed (init_draft computes them from the target head; they must be stored)")
                    return
    raise DSpineConfigError(f"{flag} {p}: no transfer_ready/transfer_codes tensors (not a DSpine checkpoint)")


def resolve_block_size(num_draft_tokens: Any, dflash_block_size: Any, draft: DraftInfo) -> int:
    """The verify width B (anchor slot included) for this launch, or a clear error."""
    if dflash_block_size is not None:
        if num_draft_tokens is not None and int(num_draft_tokens) != int(dflash_block_size):
            raise DSpineConfigError(
                f"--speculative-num-draft-tokens {num_draft_tokens} and --speculative-dflash-block-size "
                f"{dflash_block_size} differ; for DSPINE both are the verify block width (anchor included)")
        num_draft_tokens = dflash_block_size
    if num_draft_tokens is None:
        return draft.block_size
    B = int(num_draft_tokens)
    if not 2 <= B <= draft.block_size:
        raise DSpineConfigError(
            f"--speculative-num-draft-tokens {B} does not fit the draft's block_size {draft.block_size}: the "
            f"value counts the anchor (bonus) slot, so block {draft.block_size} means 1 anchor + "
            f"{draft.block_size - 1} drafts; use --speculative-num-draft-tokens {draft.block_size} "
            f"(or any value from 2 to {draft.block_size} to verify fewer drafts)")
    return B


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def is_hybrid(model_path: Any) -> bool:
    """Whether the target keeps linear-attention (Mamba-style) state: Gated DeltaNet layers in ``layer_types``
    (Qwen3.5/3-Next). False when ``model_path`` is not a local directory with a readable config.json."""
    p = Path(str(model_path)) / "config.json"
    try:
        tcfg = _text_config(json.loads(p.read_text()))
    except (OSError, ValueError):
        return False
    return "linear_attention" in (tcfg.get("layer_types") or ())


def check_target(model_path: Any, draft: DraftInfo) -> None:
    """Draft/target compatibility from the target's config.json (skipped when model_path is not a local dir)."""
    if model_path is None:
        return
    p = Path(str(model_path))
    if not (p / "config.json").is_file():
        return  # a hub id: SGLang resolves it later; the worker's self-check covers it then
    tcfg = _text_config(_load_json(p / "config.json", "--model-path"))
    where = f"--speculative-draft-model-path {draft.path} vs --model-path {model_path}"
    H, V, L = tcfg.get("hidden_size"), tcfg.get("vocab_size"), tcfg.get("num_hidden_layers")
    if H is not None and int(H) != draft.hidden_size:
        raise DSpineConfigError(f"{where}: hidden_size {draft.hidden_size} != target {H} (draft for another model)")
    if V is not None and int(V) != draft.vocab_size:
        raise DSpineConfigError(f"{where}: vocab_size {draft.vocab_size} != target {V} (draft for another model)")
    if L is not None:
        if int(L) != draft.num_target_layers:
            raise DSpineConfigError(
                f"{where}: the draft was trained on a {draft.num_target_layers}-layer target, the target has {L}")
        bad = [i for i in draft.target_layer_ids if not 0 <= i < int(L) - 1]
        if bad or list(draft.target_layer_ids) != sorted(set(draft.target_layer_ids)):
            raise DSpineConfigError(
                f"{where}: target_layer_ids {list(draft.target_layer_ids)} must be strictly increasing and in "
                f"[0, {int(L) - 1}) (SGLang captures the output of layer i as the input of layer i+1)")
