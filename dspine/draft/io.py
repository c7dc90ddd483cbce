"""Where a DSpine draft comes from and goes to: a fresh init, a checkpoint on disk, a draft-vocabulary copy.

The checkpoint is ``config.json`` (``draft_config.py``) plus one ``model.safetensors`` whose tensor names are
the module names of ``draft.py``; see ``docs/design.md``, "The DSpine draft". ``decode.json`` beside it
holds decode settings measured for a draft on some hardware (engines use them when the user sets none).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from dspine.draft.config import DraftSpec, make_draft_config, parse_draft_config
from dspine.draft.model import DSpineDraft
from dspine.draft.transfer import compute_transfer_space
from dspine.models.checkpoint import ModelLoadError, load_state, read_config, weight_files
from dspine.models.layers import skip_init
from dspine.models.target import Target


def init_draft(
    target: Target,
    num_layers: int = 5,
    block_size: int = 16,
    seed: int = 0,
    draft_vocab: torch.Tensor | list[int] | None = None,
    **overrides,
) -> DSpineDraft:
    """A randomly initialised DSpine draft for ``target`` (fp32, on the target's device).

    Dimensions default to the target's (heads, KV heads, head_dim, intermediate size, RoPE, RMS eps); see
    ``make_draft_config`` for every override. ``mask_token_id`` defaults to the target config's
    ``mask_token_id`` when it has one, else to ``vocab_size - 1`` (the draft only needs a fixed id whose
    embedding marks "unknown"; a trained draft must keep the id it was trained with). Transfer codes are
    computed from ``target.head_weight`` and stored; readouts start at D^T; writes and G_pred at zero.
    ``draft_vocab`` (target ids) restricts the proposal head to those tokens (sorted and de-duplicated here).
    """
    vocab = None
    if draft_vocab is not None:
        vocab = torch.as_tensor(draft_vocab, dtype=torch.long).unique()  # sorted, no repeats
        overrides["draft_vocab_size"] = len(vocab)
    cfg = make_draft_config(target, num_layers, block_size, **overrides)
    with torch.device("meta"):
        model = DSpineDraft(cfg, where="init_draft")
    model = model.to_empty(device="cpu")
    model.rotary.inv_freq = model.rotary.spec.inv_freq()
    model.reset_parameters(torch.Generator().manual_seed(seed))
    space = compute_transfer_space(target.head_weight.detach(), model.transfer_rank)
    with torch.no_grad():
        model.transfer_codes.copy_(space.codes.cpu())
        model.transfer_ready.fill_(True)
        if vocab is not None:
            model.draft_vocab.copy_(vocab)
        for readout in model.injection.readouts:
            readout.weight.copy_(space.directions.T.float().cpu())  # R_l = D^T
    return model.to(target.device).eval()


def with_draft_vocab(draft: DSpineDraft, vocab: torch.Tensor | list[int]) -> DSpineDraft:
    """A copy of ``draft`` whose proposal head covers only ``vocab`` (target ids): every weight is kept, so a
    draft trained on the full head can be warm-started on a draft vocabulary (the head is the target's)."""
    ids = torch.as_tensor(vocab, dtype=torch.long).unique()
    cfg = copy.deepcopy(draft.config)
    cfg["dspine_config"]["draft_vocab_size"] = len(ids)
    new = DSpineDraft(cfg, confidence_head=draft.confidence_head is not None, where="with_draft_vocab")
    state = {k: v for k, v in draft.state_dict().items() if k != "draft_vocab"}
    missing, unexpected = new.load_state_dict({**state, "draft_vocab": ids}, strict=False)
    if unexpected or [m for m in missing if not m.startswith("rotary.")]:
        raise ValueError(f"with_draft_vocab: state mismatch (missing {missing}, unexpected {unexpected})")
    new.confidence_trained = draft.confidence_trained
    new = new.to(device=draft.device, dtype=draft.dtype).train(draft.training)
    new.rotary.inv_freq = new.rotary.spec.inv_freq(device=draft.device)  # fp32, as load_draft keeps it
    return new


def _checkpoint_name(name: str) -> str | None:
    """Checkpoint tensor name -> module name; None for the borrowed embedding / LM head (ignored)."""
    name = name.removeprefix("model.")
    if name.startswith(("embed_tokens.", "lm_head.")):
        return None
    return name


def read_draft_header(path: str | Path) -> tuple[dict, DraftSpec, bool]:
    """What a draft directory says without reading a tensor: its config, the spec parsed from it, and whether its
    checkpoint holds the confidence head (from the safetensors headers); a config that says the head was trained
    where the checkpoint has none is refused. ``load_draft`` builds the draft from it; ``lazy.LazyDraft`` answers
    from it before the weights are read."""
    path = Path(path)
    cfg_file = path / "config.json"
    cfg = read_config(path)
    spec = parse_draft_config(cfg, str(cfg_file))
    names = [_checkpoint_name(n) for n in weight_files(path)]
    has_head = any(n is not None and n.startswith("confidence_head.") for n in names)
    if spec.confidence_trained and not has_head:
        raise ModelLoadError(
            f"{cfg_file}: dspine_config.confidence_trained is true but {path} has no 'confidence_head.proj.weight'"
        )
    return cfg, spec, has_head


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DSpineDraft:
    """Load a draft saved by ``DSpineDraft.save`` (or a compatible export), strictly.

    Accepts an optional ``model.`` prefix, ignores ``embed_tokens.*``/``lm_head.*``, refuses unknown and
    missing tensors. The confidence head is optional: it exists iff its tensors are in the checkpoint.
    """
    path = Path(path)
    cfg, _, has_head = read_draft_header(path)
    on_cpu = torch.device(device).type == "cpu"
    # on the CPU built in place, uninitialised (the checkpoint overwrites every value): on the meta device the
    # constructor's arithmetic would go through torch's reference ops, whose first call imports torch._dynamo
    with contextlib.nullcontext() if on_cpu else torch.device("meta"), skip_init():
        model = DSpineDraft(cfg, confidence_head=has_head, where=str(path / "config.json"))
    model = (model if on_cpu else model.to_empty(device=device)).to(dtype)
    model.rotary.inv_freq = model.rotary.spec.inv_freq(device=device)
    load_state(model, path, rename=_checkpoint_name, mmap=on_cpu, assign=False)  # converted to fp32 from the map
    model.check_vocab(str(path / "model.safetensors"))
    return model.eval()


DECODE_DEFAULTS = "decode.json"


def read_decode_defaults(path: str | Path) -> dict:
    """Measured decode settings shipped beside a draft (``decode.json``): ``block_size``,
    ``dynamic_threshold`` and/or ``accept_prior`` (the per-slot acceptance cost-aware verification assumes before
    a row has evidence), used by engines when the user sets none. Absent file: ``{}``.

    They live outside ``config.json`` because they describe the hardware the draft was measured on (a CPU
    wants shorter verify blocks than a GPU), not the model; ``BENCHMARKS.md`` holds the measurements.
    """
    f = Path(path) / DECODE_DEFAULTS
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    out: dict = {}
    for key, value in raw.items():
        if key.startswith("_"):  # comments / provenance
            continue
        if key == "block_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ModelLoadError(f"{f}: block_size must be an integer >= 2, got {value!r}")
        elif key in ("dynamic_threshold", "accept_prior"):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ModelLoadError(f"{f}: {key} must be a number in [0, 1], got {value!r}")
        else:
            raise ModelLoadError(f"{f}: unknown key {key!r} (block_size, dynamic_threshold, accept_prior)")
        out[key] = value
    return out
