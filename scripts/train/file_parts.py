"""Split a large file (the 98 MB SmolLM2 GGUF) into parts of at most N MB, and join them back, verified by sha256.

A GPU machine may accept only small uploads: ``split`` writes ``NAME.part000``, ``NAME.part001``, ... and a
manifest ``NAME.parts.json`` (size and sha256 of the whole file and of every part) into a directory;
``join`` checks every part against the manifest, concatenates them into a temporary file, checks the whole
file's sha256 and renames it into place, so a missing, truncated or damaged part is a one-line error, never a
silently different model. Standard library only (it runs before anything is installed).

    python scripts/train/file_parts.py split SmolLM2-135M-Instruct.Q4_1.gguf parts/ --max-mb 50
    python scripts/train/file_parts.py join parts/SmolLM2-135M-Instruct.Q4_1.gguf.parts.json model.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

CHUNK = 1 << 20
MANIFEST_SUFFIX = ".parts.json"


class PartsError(Exception):
    """A split or join that cannot go on; the message names the file."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def split(src: Path, out_dir: Path, max_bytes: int) -> Path:
    """Write the parts and the manifest of ``src`` into ``out_dir``; returns the manifest path."""
    if max_bytes < 1:
        raise PartsError(f"--max-mb must be positive (got {max_bytes} bytes)")
    if not src.is_file():
        raise PartsError(f"{src}: no such file")
    out_dir.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    parts = []
    with open(src, "rb") as fh:
        while True:
            data = fh.read(max_bytes)
            if not data and parts:
                break
            name = f"{src.name}.part{len(parts):03d}"
            (out_dir / name).write_bytes(data)
            whole.update(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            if len(data) < max_bytes:
                break
    manifest = {"name": src.name, "bytes": src.stat().st_size, "sha256": whole.hexdigest(), "parts": parts}
    path = out_dir / (src.name + MANIFEST_SUFFIX)
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text())
        if not (isinstance(m["parts"], list) and isinstance(m["sha256"], str) and isinstance(m["bytes"], int)):
            raise TypeError("parts/sha256/bytes have the wrong types")
        for p in m["parts"]:
            if Path(p["name"]).name != p["name"]:
                raise ValueError(f"part name {p['name']!r} is not a plain file name")
        return m
    except FileNotFoundError:
        raise PartsError(f"{path}: no such manifest") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise PartsError(f"{path}: not a parts manifest ({type(e).__name__}: {e})") from None


def join(manifest_path: Path, dest: Path) -> Path:
    """Verify every part, concatenate into ``dest`` atomically, verify the whole; returns ``dest``."""
    m = read_manifest(manifest_path)
    where = manifest_path.parent
    if dest.is_file() and dest.stat().st_size == m["bytes"] and sha256_of(dest) == m["sha256"]:
        return dest  # already joined (a rerun of the recipe)
    for p in m["parts"]:
        f = where / p["name"]
        if not f.is_file():
            raise PartsError(f"{f}: missing part ({len(m['parts'])} parts listed in {manifest_path.name})")
        if f.stat().st_size != p["bytes"]:
            raise PartsError(f"{f}: {f.stat().st_size} bytes, the manifest says {p['bytes']} (truncated upload?)")
        if sha256_of(f) != p["sha256"]:
            raise PartsError(f"{f}: sha256 differs from the manifest (damaged part)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for p in m["parts"]:
                with open(where / p["name"], "rb") as fh:
                    while block := fh.read(CHUNK):
                        whole.update(block)
                        out.write(block)
        if whole.hexdigest() != m["sha256"]:
            raise PartsError(f"{dest}: joined sha256 differs from {manifest_path.name} (parts from another file?)")
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="write SRC's parts and manifest into OUT_DIR")
    s.add_argument("src", type=Path)
    s.add_argument("out_dir", type=Path)
    s.add_argument("--max-mb", type=float, default=50.0, help="largest part, in MB (10^6 bytes)")
    j = sub.add_parser("join", help="verify the parts of MANIFEST and write the file to DEST")
    j.add_argument("manifest", type=Path)
    j.add_argument("dest", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.command == "split":
            path = split(args.src, args.out_dir, int(args.max_mb * 1e6))
            n = len(json.loads(path.read_text())["parts"])
            print(f"{path} ({n} parts)")
        else:
            print(join(args.manifest, args.dest))
    except PartsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
