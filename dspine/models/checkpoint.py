"""Reading and writing Hugging Face–format model directories (config.json + safetensors, sharded or not).

Loading is strict: every tensor the module expects must be present with the right shape, and unknown
tensors are refused, each with one :class:`ModelLoadError` naming the file and the tensor. A silently
half-loaded model produces plausible garbage, which is the worst failure a speculative decoder can have.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and, where relevant, the tensor."""


def read_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a model directory")
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing (a Hugging Face model directory needs config.json)")
    try:
        return json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None


def weight_files(path: str | Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from ``model.safetensors.index.json`` or the ``*.safetensors`` files."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        out = {}
        for name, fname in wmap.items():
            f = path / fname
            if not f.is_file():
                raise ModelLoadError(f"{index}: tensor {name!r} points to missing file {fname}")
            out[name] = f
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def load_state(
    module: nn.Module,
    path: str | Path,
    rename: Callable[[str], str | None] = lambda n: n,
    optional: Iterable[str] = (),
    dtype: torch.dtype | None = None,
) -> None:
    """Copy tensors from a model dir into ``module``'s parameters/buffers, strictly.

    ``rename`` maps a checkpoint name to a module name, or to None to ignore it (e.g. ``lm_head`` of a draft).
    Names in ``optional`` may be absent (their initial values stay).
    """
    path = Path(path)
    files = weight_files(path)
    expected = dict(module.state_dict())
    seen: set[str] = set()
    opened: dict[Path, object] = {}
    try:
        for ckpt_name, f in files.items():
            name = rename(ckpt_name)
            if name is None:
                continue
            if name not in expected:
                raise ModelLoadError(f"{f}: unexpected tensor {ckpt_name!r} (not part of this architecture)")
            if f not in opened:
                opened[f] = safe_open(str(f), framework="pt")
            t = opened[f].get_tensor(ckpt_name)
            want = expected[name]
            if tuple(t.shape) != tuple(want.shape):
                raise ModelLoadError(
                    f"{f}: tensor {ckpt_name!r} has shape {list(t.shape)}, expected {list(want.shape)}"
                )
            with torch.no_grad():
                want.copy_(t.to(want.dtype if want.dtype == torch.bool or dtype is None else want.dtype))
            seen.add(name)
    finally:
        opened.clear()
    optional = set(optional)
    missing = [n for n in expected if n not in seen and n not in optional]
    if missing:
        raise ModelLoadError(
            f"{path}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
        )
