"""What every engine does with ``--model`` and ``--draft`` before it loads anything: resolve the names
(``embedded``, ``none``, a directory), identify the files for the run's fingerprint, open the tokenizer.

Shared by the reference and SGLang engines, so that both accept the same arguments and fingerprint a model the
same way.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

from dspine_batch.digest import content_digest
from dspine_batch.errors import UsageError


def model_identity(path: Path) -> dict[str, Any]:
    """A model directory as a run's identity records it: its path and a digest of its config, weights and
    templates (``digest.content_digest`` per file, so a 50 GB checkpoint is identified in milliseconds)."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".jinja"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.name}:{content_digest(str(p))}".encode())
    return {"path": str(path), "digest": digest.hexdigest()[:24]}


def resolve_model(model: str) -> Path:
    """``--model``: ``embedded`` (the shipped SmolLM2 target, converted on first use), an HF model directory, or a
    llama.cpp ``FILE.gguf`` of a supported architecture (converted once into the per-machine cache)."""
    if model == "embedded":
        try:
            from dspine.embedded.smollm2 import embedded_target_path

            return Path(embedded_target_path())
        except ImportError as e:
            raise UsageError(f"--model embedded: the dspine package is not available ({e})") from e
        except Exception as e:  # EmbeddedModelMissing: its message says how to fix it
            raise UsageError(f"--model embedded: {e}") from e
    p = Path(model)
    if p.suffix.lower() == ".gguf" and p.is_file():  # a llama.cpp file: converted once into the per-machine cache
        try:
            from dspine.embedded.gguf_convert import gguf_model_path

            return gguf_model_path(p)
        except ImportError as e:
            raise UsageError(f"--model {model}: the dspine package is not available ({e})") from e
        except ValueError as e:  # GGUFConversionError: one line naming the file and what is unsupported
            raise UsageError(f"--model {model}: {' '.join(str(e).split())}") from e
    if not (p / "config.json").exists():
        raise UsageError(f"--model {model}: not a model directory (no config.json) nor a .gguf file")
    return p


def _warn(msg: str) -> None:
    print(f"dspine-batch: warning: {msg}; running without a draft (speculative stats columns will be null)",
          file=sys.stderr)


def resolve_draft(draft: str, model: str = "embedded") -> Path | None:
    """``embedded`` is the draft trained against the embedded target: with any other model it would be wrong
    (a draft borrows its target's embeddings and head), so it only applies to ``--model embedded``."""
    if draft in ("none", ""):
        return None
    if draft == "embedded":
        if model != "embedded":
            _warn("the embedded draft pairs only with --model embedded; pass --draft PATH for this model, or "
                  "--draft none to silence this")
            return None
        try:
            from dspine.embedded import smollm2 as embedded

            path = Path(embedded.embedded_draft_path())  # type: ignore[attr-defined]
            if (path / "config.json").exists():
                return path
            _warn(f"the embedded draft is missing at {path}")
        except Exception as e:  # not shipped in this build, or damaged: generate without speculation
            _warn(f"no embedded draft is available ({str(e)[:200]})")
        return None
    p = Path(draft)
    if not (p / "config.json").exists():
        raise UsageError(f"--draft {draft}: not a draft directory (no config.json)")
    return p


def open_tokenizer(model_path: Path) -> Any:
    """The HF tokenizer of a model directory; a missing or unreadable tokenizer file is a ``UsageError``."""
    from dspine.models.tokenizer import HFTokenizer

    try:
        return HFTokenizer(model_path)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from e
