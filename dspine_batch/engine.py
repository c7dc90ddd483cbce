"""The engine boundary: what the pipeline asks of any generation backend, and nothing more.

The pipeline only sees ``Request`` in and ``Result`` out through ``Engine.run``; which engine runs (scripted
test engine, the CPU reference engine over ``dspine.generate``, SGLang) must not change anything else. SGLang-shaped
stats are normalised in one place (``stats_from_sglang_meta`` -> ``sglang_stats``) because the names drift.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import UsageError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class Request:
    """One generation: ``key`` is the row id, ``sample_index`` which of its samples this is."""

    key: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Result:
    key: str
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


class Engine(Protocol):
    """What a backend provides. ``run`` must pull requests lazily and keep at most ``max_in_flight`` open, so
    that stopping the request iterator (signal, error budget) stops admission without losing finished work."""

    name: str

    def identity(self) -> dict[str, Any]:
        """Everything about the model/draft/backend that changes outputs; goes into the run fingerprint."""
        ...

    @property
    def max_context(self) -> int | None: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat template with ``add_generation_prompt=True``, tokenized."""
        ...

    def stop_token_ids(self, stop: Iterable[str]) -> tuple[int, ...]:
        """EOS ids plus any stop string that is exactly one token."""
        ...

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


ENGINE_NAMES = ("auto", "reference", "sglang")


def open_engine(name: str, model: str, draft: str, engine_args: dict[str, str]) -> Engine:
    """Build the engine the user asked for. ``auto`` is SGLang when it is installed and a GPU is present,
    else the reference engine; it says which it picked and why on stderr.

    ``scripted`` (not shown in help) is the deterministic test engine; ``DSPINE_BATCH_TEST_ENGINE`` also
    selects it so subprocess tests need no special flags."""
    if name == "auto":
        from .sglang_engine import sglang_available

        ok, why = sglang_available()
        name = "sglang" if ok else "reference"
        print(f"dspine-batch: --engine auto picked {name} ({why})", file=sys.stderr)
    if name == "scripted":
        from .scripted_engine import ScriptedEngine

        return ScriptedEngine.from_args(engine_args)
    if name == "reference":
        from .reference_engine import ReferenceEngine

        return ReferenceEngine.load(model, draft, engine_args)
    if name == "sglang":
        from .sglang_engine import SGLangEngine, sglang_available

        ok, why = sglang_available(need_gpu=False)  # no GPU: SGLang's CPU test path
        if not ok:
            raise UsageError(
                f"--engine sglang is not available here: {why}; install the sglang extra in its own virtualenv "
                "(bash scripts/setup_sglang_venv.sh) and run dspine-batch from it, "
                "or use --engine reference"
            )
        return SGLangEngine.load(model, draft, engine_args)
    raise UsageError(f"unknown engine {name!r} (choose from {', '.join(ENGINE_NAMES)})")
