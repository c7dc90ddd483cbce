"""Reading and writing Hugging Face–format model directories (config.json + safetensors, sharded or not).

Loading is strict: every tensor the module expects must be present with the right shape, and unknown
tensors are refused, each with one :class:`ModelLoadError` naming the file and the tensor. A silently
half-loaded model produces plausible garbage, which is the worst failure a speculative decoder can have.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and, where relevant, the tensor."""


class ShapeMismatch(ModelLoadError):
    """A stored tensor whose shape is not the module's (``check_shapes``): which one, and both shapes."""

    def __init__(self, message: str, name: str, shape: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(message)
        self.name, self.shape, self.expected = name, shape, expected


class MissingTensor(ModelLoadError):
    """A tensor the module needs that the checkpoint lacks (``check_shapes``; ``name``: the module's name)."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


def in_config(e: ModelLoadError, path: Path) -> ModelLoadError:
    """``e`` naming ``path``'s config.json where it says only ``config.json:`` (``families.read_spec`` knows no
    directory); a message that names its file already stays as it is."""
    msg = str(e)
    bare = msg.startswith("config.json:")
    return ModelLoadError(f"{path / 'config.json'}{msg[len('config.json'):]}" if bare else msg)


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
    return {name: f for name, (f, _) in _headers(files).items()}


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of a model directory: its file and shape, from the safetensors headers (no tensor is read)."""
    files = weight_files(path)
    shapes = _headers(sorted(set(files.values())))
    return {name: shapes.get(name, (f, None)) for name, f in files.items()}


def _headers(files: Iterable[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    out[name] = (f, tuple(sf.get_slice(name).get_shape()))
        except Exception as e:  # safetensors' own error type: a header that does not parse
            raise ModelLoadError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return out


def check_shapes(expected: Mapping[str, Sequence[int]], stored: Mapping[str, tuple[Path, tuple[int, ...] | None]],
                 where: str | Path, rename: Callable[[str], str | None] = lambda n: n,
                 optional: Iterable[str] = ()) -> None:
    """Strictly: every stored tensor (name -> (file, shape)) that ``rename`` keeps is one of ``expected`` (module name
    -> shape) with its shape, and every expected one is stored unless ``optional``; else one ``ModelLoadError`` naming
    the file and the tensor. Shapes only, so a module built on the meta device can be checked against a checkpoint's
    headers before anything is allocated (``Target.empty``)."""
    seen = set()
    for ckpt_name, (f, shape) in stored.items():
        name = rename(ckpt_name)
        if name is None:
            continue
        if name not in expected:
            raise ModelLoadError(f"{f}: unexpected tensor {ckpt_name!r} (not part of this architecture)")
        want = tuple(expected[name])
        if shape is not None and tuple(shape) != want:
            raise ShapeMismatch(f"{f}: tensor {ckpt_name!r} has shape {list(shape)}, expected {list(want)}",
                                ckpt_name, tuple(shape), want)
        seen.add(name)
    optional = set(optional)
    missing = [n for n in expected if n not in seen and n not in optional]
    if missing:
        raise MissingTensor(
            f"{where}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""),
            missing[0])


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def mapped_tensors(f: str | Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of one safetensors file as a view of a single private, read-on-demand memory map of it (no
    copy: a page enters the process's RSS only when something reads it, and the map goes when the last view does);
    None where the file cannot be mapped so (an unknown dtype, an offset the dtype cannot be viewed at), and then
    the caller copies as before. Private (copy-on-write): writing a view never changes the file. A file truncated
    in place while mapped faults its readers (SIGBUS), as any mmap'd checkpoint would; ours are written whole
    (``disk_cache.atomic_file``), a new file replacing the old one, which the map keeps."""
    f = Path(f)
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error):
        return None
    base = 8 + n
    meta = {k: v for k, v in header.items() if k != "__metadata__"}
    if not meta:
        return {}
    try:
        storage = torch.UntypedStorage.from_file(str(f), False, size)
    except RuntimeError:  # a file torch cannot map (a filesystem without mmap): copied instead
        return None
    out = {}
    for name, info in meta.items():
        dtype = _ST_DTYPES.get(info.get("dtype"))
        start, end = info["data_offsets"]
        if dtype is None or end > size - base:
            return None
        item = torch.empty((), dtype=dtype).element_size()
        if (base + start) % item:
            return None
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, base + start, (end - start,))
        shape = tuple(info["shape"])
        out[name] = raw.view(dtype).view(shape) if end > start else torch.empty(shape, dtype=dtype)
    return out


def load_state(
    module: nn.Module,
    path: str | Path,
    rename: Callable[[str], str | None] = lambda n: n,
    optional: Iterable[str] = (),
    dtype: torch.dtype | None = None,
    mmap: bool = False,
    assign: bool = True,
) -> None:
    """Copy tensors from a model dir into ``module``'s parameters/buffers, strictly.

    ``rename`` maps a checkpoint name to a module name, or to None to ignore it (e.g. ``lm_head`` of a draft).
    Names in ``optional`` may be absent (their initial values stay). ``mmap`` (a CPU module): a tensor stored in
    the dtype the module holds becomes a view of the file's memory map instead of a copy (``mapped_tensors``), so
    a weight that is never read (a linear replaced by its packed form from the cache) never costs memory; tensors
    of another dtype are converted from the map, and parameters shared under two names copied, as before. With
    ``assign=False`` every tensor is copied out of the map (which goes when this returns): for a checkpoint whose
    every weight is converted or repacked anyway (a bf16 draft), where a view would keep its pages resident.
    """
    path = Path(path)
    stored = checkpoint_shapes(path)
    expected = dict(module.state_dict(keep_vars=True))
    check_shapes({n: t.shape for n, t in expected.items()}, stored, path, rename, optional)  # before any copy
    opened: dict[Path, object] = {}
    mapped: dict[Path, dict[str, torch.Tensor] | None] = {}
    shared = _shared_names(expected) if mmap else set()
    try:
        for ckpt_name, (f, _) in stored.items():
            name = rename(ckpt_name)
            if name is None:
                continue
            want = expected[name]
            t = None
            if mmap and want.device.type == "cpu" and name not in shared:
                if f not in mapped:
                    mapped[f] = mapped_tensors(f)
                t = (mapped[f] or {}).get(ckpt_name)
            if t is not None:
                if t.dtype == want.dtype and assign:
                    _assign(module, name, t)
                else:  # converted straight from the map (no second, unconverted copy first)
                    with torch.no_grad():
                        want.copy_(t)
                continue
            if f not in opened:
                opened[f] = safe_open(str(f), framework="pt")
            t = opened[f].get_tensor(ckpt_name)
            with torch.no_grad():
                want.copy_(t.to(want.dtype if want.dtype == torch.bool or dtype is None else want.dtype))
    finally:
        opened.clear()


def _shared_names(expected: dict[str, torch.Tensor]) -> set[str]:
    """Names of tensors held under more than one name (tied weights): assigning one would untie them."""
    by_id: dict[int, list[str]] = {}
    for name, t in expected.items():
        by_id.setdefault(id(t), []).append(name)
    return {n for names in by_id.values() if len(names) > 1 for n in names}


def _assign(module: nn.Module, name: str, t: torch.Tensor) -> None:
    """Make ``t`` the parameter or buffer ``name`` of ``module`` (instead of copying into the one there)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(t, requires_grad=bool(old is not None and old.requires_grad))
    else:
        owner._buffers[leaf] = t
