"""The engine boundary: what the pipeline asks of any generation backend, and nothing more.

The pipeline only sees ``Request`` in and ``Result`` out through ``Engine.run``, plus the engine's
``tokenizer`` (prompts -> ids, stop ids); which engine runs (scripted test engine, the CPU reference engine over
``dspine.generate``, SGLang) must not change anything else. Engines are found by name in ``ENGINES`` (name ->
loader); tests put the scripted engine behind the default names with ``engines_replaced``. ``SamplingParams``
holds the generation defaults of the whole tool. SGLang-shaped stats are normalised in one place
(``stats_from_sglang_meta`` -> ``sglang_stats``) because the names drift.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import UsageError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling settings. Its defaults are the generation defaults of the whole tool: the CLI
    options and ``GenerateConfig`` take theirs from here. ``stop_token_ids`` end generation inside the engine;
    ``stop`` strings are cut from the text afterwards (``stop_strings``)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


DEFAULTS = SamplingParams()


@dataclass(slots=True)
class Request:
    """One generation: ``row_id`` is the input row's id, ``sample_index`` which of its samples this is."""

    row_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Result:
    row_id: str
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "error"  # stop / length / abort / error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int | None = None  # None when no draft ran
    draft_tokens_proposed: int | None = None
    draft_tokens_accepted: int | None = None
    accept_length: float | None = None
    accept_histogram: list[int] | None = None
    latency_s: float = 0.0
    error: str | None = None


class Tokenizer(Protocol):
    """What the pipeline needs to turn rows into token ids: the model's tokenizer, owned by the engine only
    because the engine knows which model it loaded (``tokenizer.HFTokenizer`` for HF model dirs)."""

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat template with ``add_generation_prompt=True``, tokenized."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def stop_token_ids(self, stop: Iterable[str]) -> tuple[int, ...]:
        """EOS ids plus any stop string that is exactly one token."""
        ...


class Engine(Protocol):
    """What a backend provides. ``run`` must pull requests lazily and keep at most ``max_in_flight`` open, so
    that stopping the request iterator (signal, error budget) stops admission without losing finished work.
    A transient death (rerunning helps) raises ``errors.EngineDied``; anything else is treated as a bug."""

    name: str
    tokenizer: Tokenizer

    def identity(self) -> dict[str, Any]:
        """Everything about the model/draft/backend that changes outputs; goes into the run fingerprint."""
        ...

    @property
    def max_context(self) -> int | None: ...

    def run(self, requests: Iterable[Request], max_in_flight: int) -> Iterator[Result]: ...

    def close(self) -> None: ...


def derive_seed(run_seed: int, row_id: str, sample_index: int) -> int:
    """Per-request seed: stable across processes and resumes (never Python's salted ``hash``), so a
    regenerated row equals the one an uninterrupted run would have produced."""
    digest = hashlib.blake2b(f"{run_seed}\x1f{row_id}\x1f{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def stats_from_sglang_meta(meta: dict[str, Any], result: Result, block_size: int | None = None) -> Result:
    """Fill ``result``'s token counts and speculative stats from an SGLang-shaped ``meta_info`` dict.

    One normalisation for every backend that reports SGLang-style stats (``sglang_stats``: all name
    vintages, our accept-length convention); without speculation the stats stay null."""
    from .sglang_stats import apply

    return apply(meta, result, block_size=block_size)


EngineLoader = Callable[[str, str, dict[str, str]], Engine]
"""``(model, draft, engine_args) -> Engine``."""


def _load_reference(model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    from .reference_engine import ReferenceEngine

    return ReferenceEngine.load(model, draft, engine_args)


def _load_sglang(model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    from .sglang_engine import SGLangEngine, sglang_available

    ok, why = sglang_available(need_gpu=False)  # no GPU: SGLang's CPU test path
    if not ok:
        raise UsageError(
            f"--engine sglang is not available here: {why}; install the sglang extra in its own virtualenv "
            "(bash scripts/setup_sglang_venv.sh) and run dspine-batch from it, "
            "or use --engine reference"
        )
    return SGLangEngine.load(model, draft, engine_args)


def _load_scripted(model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    from .scripted_engine import ScriptedEngine

    return ScriptedEngine.from_args(engine_args)


def _pick_auto() -> str:
    from .sglang_engine import sglang_available

    ok, why = sglang_available()
    name = "sglang" if ok else "reference"
    print(f"dspine-batch: --engine auto picked {name} ({why})", file=sys.stderr)
    return name


ENGINE_NAMES = ("auto", "reference", "sglang")  # what --help offers
ENGINES: dict[str, EngineLoader] = {"reference": _load_reference, "sglang": _load_sglang,
                                    "scripted": _load_scripted}  # scripted: the hidden deterministic test engine


@contextmanager
def engines_replaced(loader: EngineLoader, names: Iterable[str] = ("auto", "reference")) -> Iterator[None]:
    """Load every engine in ``names`` with ``loader`` for the duration (``auto`` included): how tests and the
    benchmark put the scripted engine behind the default command line without touching the production path."""
    saved = dict(ENGINES)
    try:
        ENGINES.update(dict.fromkeys(names, loader))
        yield
    finally:
        ENGINES.clear()
        ENGINES.update(saved)


def open_engine(name: str, model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    """Build the engine the user asked for. ``auto`` is SGLang when it is installed and a GPU is present,
    else the reference engine; it says which it picked and why on stderr."""
    if name == "auto" and "auto" not in ENGINES:
        name = _pick_auto()
    loader = ENGINES.get(name)
    if loader is None:
        raise UsageError(f"unknown engine {name!r} (choose from {', '.join(ENGINE_NAMES)})")
    return loader(model, draft, engine_args)
