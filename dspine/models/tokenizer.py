"""Tokenizer and chat template for HF-layout model dirs, without transformers in the runtime path.

``tokenizers`` does the BPE; the chat template (``tokenizer_config.json`` ``chat_template`` or a
``chat_template.jinja`` file) is rendered with jinja2 the way transformers does it: a sandboxed environment
with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII, and the special tokens (``bos_token``, ``eos_token``, ...) as variables. The rendered text is
tokenized without adding special tokens (the template already has them), as ``apply_chat_template`` does.
A missing or unreadable file is a ``ModelLoadError`` naming it (callers turn it into their own one-line error).
"""

from __future__ import annotations

import json
from contextlib import suppress
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from dspine.models.checkpoint import ModelLoadError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").exists():
            raise ModelLoadError(f"{d}: no tokenizer.json (the reference engine needs a fast-tokenizer file)")
        self.dir = d
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.config: dict[str, Any] = _read_json(d / "tokenizer_config.json")
        self.special = {k: _token_text(self.config.get(k)) for k in SPECIAL_KEYS}
        for k, v in _read_json(d / "special_tokens_map.json").items():
            if k in SPECIAL_KEYS and self.special.get(k) is None:
                self.special[k] = _token_text(v)
        self.template_source = self._template()

    def _template(self) -> str | None:
        jinja_file = self.dir / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text()
        t = self.config.get("chat_template")
        if isinstance(t, list):  # named templates: use "default"
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        return t if isinstance(t, str) else None

    @cached_property
    def _compiled(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.template_source or "")

    @property
    def has_chat_template(self) -> bool:
        return bool(self.template_source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The template's text; ``tools`` and ``kwargs`` (e.g. ``enable_thinking``) are template variables, as
        ``apply_chat_template`` passes them."""
        if not self.template_source:
            raise ValueError(f"{self.dir}: the tokenizer has no chat template")
        special = {k: v for k, v in self.special.items() if v is not None}
        return self._compiled.render(**{**special, **kwargs}, messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **kwargs: Any) -> list[int]:
        return self.tok.encode(self.render(messages, tools=tools, **kwargs), add_special_tokens=False).ids

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (added tokens included)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (``decode`` drops them)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in a text, read from its vocabulary entry. A token may hold part of a
        multi-byte character (byte-level BPE splits an emoji across two tokens; SentencePiece's byte fallback
        spells one byte per ``<0xE2>`` token): its text then decodes to U+FFFD, while these bytes, concatenated
        over a completion's tokens, are the completion's UTF-8 (what OpenAI's logprobs ``bytes`` promise).
        Added and special tokens are their literal text; a vocabulary whose pieces this cannot read gives the
        token's text."""
        piece = self.tok.id_to_token(token_id)
        if piece is None or token_id in self._added_ids:
            return self.token_text(token_id).encode("utf-8")
        kind = self._piece_kind
        if kind == "byte_level":
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                pass
        elif kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                with suppress(ValueError):
                    return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.token_text(token_id).encode("utf-8")

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.tok.get_added_tokens_decoder())

    @cached_property
    def _piece_kind(self) -> str:
        """How vocabulary pieces spell bytes, from the decoder: ``byte_level`` (GPT-2's byte-to-unicode map),
        ``sentencepiece`` (``\u2581`` for a space, ``<0xNN>`` byte fallback), else ``text``."""
        try:
            state = json.loads(self.tok.decoder.__getstate__()) if self.tok.decoder is not None else {}
        except (ValueError, TypeError, AttributeError):
            return "text"
        types: list[str] = []

        def walk(d: Any) -> None:
            if isinstance(d, dict):
                types.append(str(d.get("type")))
                if d.get("type") == "Replace" and "\u2581" in json.dumps(d.get("pattern"), ensure_ascii=False):
                    types.append("Metaspace")
                for v in d.values():
                    walk(v)
            elif isinstance(d, list):
                for v in d:
                    walk(v)

        walk(state)
        if "ByteLevel" in types:
            return "byte_level"
        if "ByteFallback" in types or "Metaspace" in types:
            return "sentencepiece"
        return "text"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def stop_token_ids(self, stop) -> tuple[int, ...]:
        """EOS ids plus the ids of any stop strings that are single tokens (others are applied to the text)."""
        ids = list(self.eos_ids())
        for text in stop:
            t = self.token_id(text)
            if t is not None and t not in ids:
                ids.append(t)
        return tuple(ids)

    def eos_ids(self) -> list[int]:
        """EOS from the tokenizer config plus ``eos_token_id`` of config.json / generation_config.json."""
        ids: list[int] = []
        eos = self.special.get("eos_token")
        if eos and self.tok.token_to_id(eos) is not None:
            ids.append(self.tok.token_to_id(eos))
        for name in ("generation_config.json", "config.json"):
            v = _read_json(self.dir / name).get("eos_token_id")
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and x not in ids:
                    ids.append(x)
        return ids


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (byte-level BPE vocabularies are written in
    it): printable Latin-1 bytes stand for themselves, the others for code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable ({e})") from e
