"""scripts/train/file_parts.py: the GGUF travels in parts of at most N MB and comes back byte-identical, or not at
all."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "train"))

import file_parts as fp  # noqa: E402


@pytest.fixture
def blob(tmp_path) -> Path:
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(2500) + b"tail")
    return f


def test_split_join_round_trip(blob, tmp_path):
    manifest = fp.split(blob, tmp_path / "parts", max_bytes=1000)
    m = json.loads(manifest.read_text())
    assert [p["bytes"] for p in m["parts"]] == [1000, 1000, 504]
    assert all(p["bytes"] <= 1000 for p in m["parts"]) and m["sha256"] == fp.sha256_of(blob)
    out = fp.join(manifest, tmp_path / "joined" / "x.gguf")
    assert out.read_bytes() == blob.read_bytes()
    assert fp.join(manifest, out) == out  # a rerun finds it joined


def test_exact_multiple_and_empty(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"a" * 2000)
    m = json.loads(fp.split(f, tmp_path / "p", 1000).read_text())
    assert [p["bytes"] for p in m["parts"]] == [1000, 1000]
    e = tmp_path / "e"
    e.write_bytes(b"")
    me = fp.split(e, tmp_path / "pe", 1000)
    assert fp.join(me, tmp_path / "e2").read_bytes() == b""


def test_join_refuses_damaged_missing_or_truncated_parts(blob, tmp_path):
    parts = tmp_path / "parts"
    manifest = fp.split(blob, parts, max_bytes=1000)
    dest = tmp_path / "out.gguf"
    p1 = parts / "model.gguf.part001"
    good = p1.read_bytes()
    p1.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(fp.PartsError, match="part001: sha256 differs"):
        fp.join(manifest, dest)
    p1.write_bytes(good[:10])
    with pytest.raises(fp.PartsError, match="truncated"):
        fp.join(manifest, dest)
    p1.unlink()
    with pytest.raises(fp.PartsError, match="part001: missing part"):
        fp.join(manifest, dest)
    assert not dest.exists() and not list(tmp_path.glob(".out.gguf.tmp*"))  # nothing half-written is left


def test_cli_one_line_errors(blob, tmp_path, capsys):
    assert fp.main(["split", str(blob), str(tmp_path / "p"), "--max-mb", "0.001"]) == 0
    assert "(3 parts)" in capsys.readouterr().out
    bad = tmp_path / "bad.parts.json"
    bad.write_text('{"parts": 3}')
    assert fp.main(["join", str(bad), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.parts.json: not a parts manifest" in err and err.count("\n") == 1
    evil = tmp_path / "evil.parts.json"
    evil.write_text(json.dumps({"bytes": 1, "sha256": "0", "parts": [{"name": "../x", "bytes": 1, "sha256": "0"}]}))
    assert fp.main(["join", str(evil), str(tmp_path / "o")]) == 1
    assert "plain file name" in capsys.readouterr().err
    assert fp.main(["join", str(tmp_path / "none.json"), str(tmp_path / "o")]) == 1
