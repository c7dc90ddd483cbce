"""What xgrammar computes per tokenizer and per grammar, kept in the per-machine cache (``grammar/``).

A structured job's first request used to pay, before its first token: transformers loading the tokenizer
(``AutoTokenizer``, ~1.5 s CPU for SmolLM2's) only for xgrammar to read its vocabulary into a ``TokenizerInfo``,
then a compile of each distinct grammar against it. xgrammar serialises both (``serialize_json``), so they are
computed once per machine: the tokenizer's info keyed by the bytes of the tokenizer files, the vocabulary size, the
stop ids and the xgrammar version; a compiled grammar keyed by that and the grammar's own text.

Entries follow the cache's rules (``dspine.cpu.disk_cache``: written whole under a temporary name, so a killed
writer leaves nothing half-written). Each also starts with the SHA-256 of its body: an entry whose body does not
match (a torn copy, a bit flip, an edit) or that xgrammar cannot read is rebuilt and rewritten, never trusted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from dspine.cpu.disk_cache import atomic_write, cache_root

# the files a tokenizer directory may read its vocabulary from (transformers' names)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")


def _dir() -> Path:
    return cache_root() / "grammar"


def _xgrammar_version() -> str:
    try:
        return metadata.version("xgrammar")
    except metadata.PackageNotFoundError:  # a source build: no cache key to trust across versions
        return "unknown"


def tokenizer_key(path: str | Path, vocab_size: int, stop_ids: list[int]) -> str:
    """What a tokenizer's ``TokenizerInfo`` depends on, hashed: its files' bytes, the vocabulary size the model
    has, the stop ids and the xgrammar version."""
    h = hashlib.sha256(f"xgrammar {_xgrammar_version()}\nvocab {vocab_size}\nstop {sorted(stop_ids)}\n".encode())
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:32]


def _read(path: Path) -> str | None:
    """An entry's body when its checksum holds, else None (missing, torn or altered)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    digest, _, body = raw.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        return None
    try:
        return body.decode()
    except UnicodeDecodeError:
        return None


def _write(path: Path, body: str) -> None:
    data = body.encode()
    try:
        atomic_write(path, hashlib.sha256(data).hexdigest().encode() + b"\n" + data)
    except OSError:
        pass  # a read-only or full cache only costs the next run the same work


def cached(path: Path, load: Callable[[str], Any], build: Callable[[], Any], dump: Callable[[Any], str]) -> Any:
    """The object an entry holds (``load`` of its body), or ``build()`` written back when the entry is missing,
    fails its checksum, or ``load`` refuses it."""
    body = _read(path)
    if body is not None:
        try:
            return load(body)
        except Exception:  # xgrammar refusing what it wrote (another version, a damaged entry): rebuild
            pass
    obj = build()
    _write(path, dump(obj))
    return obj


def tokenizer_info(path: str | Path, vocab_size: int, stop_ids: list[int]) -> tuple[Any, str]:
    """(xgrammar ``TokenizerInfo`` of a HF tokenizer directory, its cache key): from the cache, or built with
    transformers and kept."""
    import xgrammar

    key = tokenizer_key(path, vocab_size, stop_ids)

    def build() -> Any:
        import transformers

        hf = transformers.AutoTokenizer.from_pretrained(str(path))
        return xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids))

    info = cached(_dir() / f"tokenizer-{key}.json", xgrammar.TokenizerInfo.deserialize_json, build,
                  lambda i: i.serialize_json())
    return info, key


def compiled_grammar(info: Any, info_key: str, kind: str, spec: str, compile: Callable[[], Any]) -> Any:
    """A grammar compiled against ``info`` (``compile()``), from the cache when this machine compiled it before."""
    import xgrammar

    key = hashlib.sha256(f"{info_key}\n{kind}\n{spec}".encode()).hexdigest()[:32]
    return cached(_dir() / f"compiled-{key}.json", lambda body: xgrammar.CompiledGrammar.deserialize_json(body, info),
                  compile, lambda g: g.serialize_json())
