"""Model-directory loading: every way a directory can be wrong gives one clear ModelLoadError."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspine import ModelLoadError, load_target
from dspine.models.target import default_tap_ids


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def test_not_a_dir_and_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_target(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        load_target(tmp_path)


def test_unknown_architecture(tmp_path, llama_dir):
    p = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((p / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture \(model_type='gpt2'"):
        load_target(p)


def test_missing_unexpected_and_misshapen_tensors(tmp_path, llama_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    p = _copy(llama_dir, tmp_path / "missing")
    _edit_weights(p, lambda sd: sd.pop(name))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'layers.1.mlp.up_proj.weight'"):
        load_target(p)
    p = _copy(llama_dir, tmp_path / "extra")
    _edit_weights(p, lambda sd: sd.__setitem__("model.layers.9.foo", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: unexpected tensor 'model.layers.9.foo'"):
        load_target(p)
    p = _copy(llama_dir, tmp_path / "shape")
    _edit_weights(p, lambda sd: sd.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(
        ModelLoadError, match=rf"model.safetensors: tensor '{name}' has shape \[3, 3\], expected \[128, 64\]"
    ):
        load_target(p)


def test_sharded_checkpoint(tmp_path, llama_dir, llama_target):
    p = tmp_path / "sharded"
    p.mkdir()
    shutil.copy(f"{llama_dir}/config.json", p)
    sd = load_file(f"{llama_dir}/model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    wmap = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: sd[n] for n in part}, str(p / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in part})
    (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    t = load_target(p)
    ids = torch.randint(0, 256, (1, 9))
    assert torch.equal(t.score(ids), llama_target.score(ids))
    (p / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="points to missing file model-00002-of-00002.safetensors"):
        load_target(p)


def test_bad_json(tmp_path, llama_dir):
    p = _copy(llama_dir, tmp_path / "m")
    (p / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        load_target(p)


@pytest.mark.parametrize(
    "L,n,ids",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (32, 5, [1, 8, 15, 22, 29]),
        (30, 5, [1, 8, 14, 20, 27]),
        (12, 1, [6]),
    ],
)
def test_default_tap_ids(L, n, ids):
    assert default_tap_ids(L, n) == ids
