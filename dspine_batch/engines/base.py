"""The engine boundary: what the pipeline asks of any generation backend, and nothing more.

The pipeline only sees ``Request`` in and ``Result`` out through ``Engine.run``, plus the engine's
``tokenizer`` (prompts -> ids, stop ids); which engine runs (scripted test engine, the CPU reference engine over
``dspine.generate``, SGLang) must not change anything else. Engines are found by name in ``registry.py``;
``SamplingParams`` holds the generation defaults of the whole tool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


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
    cached_prompt_tokens: int | None = None  # prompt tokens served from a prefix cache; None: engine did not say
    verify_steps: int | None = None  # None when no draft ran
    draft_tokens_proposed: int | None = None
    draft_tokens_accepted: int | None = None
    accept_length: float | None = None
    accept_histogram: list[int] | None = None
    # the same stats by source (None where the engine does not tell them apart)
    dspine_verify_steps: int | None = None
    dspine_tokens_proposed: int | None = None
    dspine_tokens_accepted: int | None = None
    suffix_verify_steps: int | None = None
    suffix_tokens_proposed: int | None = None
    suffix_tokens_accepted: int | None = None
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
