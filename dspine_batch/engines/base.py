"""The engine boundary: what the pipeline asks of any generation backend, and nothing more.

The pipeline only sees ``Request`` in and ``Result`` out through ``Engine.run``, plus the engine's
``tokenizer`` (prompts -> ids, stop ids); which engine runs (scripted test engine, the CPU reference engine over
``dspine.generate``, SGLang) must not change anything else. Engines are found by name in ``registry.py``;
``SamplingParams`` holds the generation defaults of the whole tool.

Request features beyond plain sampling (logprobs, penalties, logit bias, min_tokens, structured outputs) are
opt-in per engine: an engine lists the ones it honours in ``features`` (names in ``FEATURES``), and the pipeline
refuses a row that uses one its engine does not list, naming the row's field, instead of sending the engine a
request it would silently answer without it. Everything about rendering the prompt (tools, tool_choice,
chat_template_kwargs) and reading the answer (reasoning, tool calls) is the pipeline's, the same for every engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

STRUCTURE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Structure:
    """A constraint on the output's text, as one canonical string, so equal constraints compare, hash and
    fingerprint equal however the user spelled them (``digest``; engines compile each distinct one once).

    ``spec`` by ``kind``: ``json_schema`` the schema as compact JSON in the user's key order (the order of
    ``properties`` is the order fields are generated in); ``json_object`` "" (any JSON
    object); ``regex`` the pattern; ``choice`` a JSON list of the allowed strings; ``grammar`` EBNF/GBNF text
    (xgrammar's dialect, root rule ``root``). No torch or xgrammar here: ``engines.grammar`` compiles them."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURE_KINDS:
            raise ValueError(f"structure kind {self.kind!r}: expected one of {', '.join(STRUCTURE_KINDS)}")

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\x1f{self.spec}".encode()).hexdigest()[:24]


# What an engine may declare in ``Engine.features``: the SamplingParams fields beyond plain sampling, with the
# structure kinds one by one (an engine may take JSON schemas before it takes arbitrary grammars).
FEATURES = frozenset({"logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "min_tokens", "logit_bias", *STRUCTURE_KINDS})


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
    # OpenAI/vLLM names and ranges; engines honour them only where they list them in ``Engine.features``
    logprobs: bool = False  # return the log-softmax of the model's own logits for each completion token
    top_logprobs: int = 0  # 0..20 most likely alternatives per position (needs logprobs)
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already in the completion
    frequency_penalty: float = 0.0  # [-2, 2], times the token's count in the completion
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt and completion tokens, CTRL-style divide/multiply)
    min_tokens: int = 0  # stop tokens are masked until this many tokens are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), sorted by id
    structure: Structure | None = None

    def features(self) -> tuple[str, ...]:
        """The names (``FEATURES``) of the non-default settings this request uses."""
        used = []
        if self.logprobs:
            used.append("logprobs")
        if self.top_logprobs:
            used.append("top_logprobs")
        for name in ("presence_penalty", "frequency_penalty", "min_tokens", "logit_bias"):
            if getattr(self, name):
                used.append(name)
        if self.repetition_penalty != 1.0:
            used.append("repetition_penalty")
        if self.structure is not None:
            used.append(self.structure.kind)
        return tuple(used)


DEFAULTS = SamplingParams()

# ``Result.logprobs``: one entry per completion token, ``(token_id, logprob, top)`` with ``top`` the
# ``top_logprobs`` most likely tokens at that position as ``((token_id, logprob), ...)``, most likely first
# (empty without top_logprobs). Log-probabilities of the model's own logits (log-softmax before temperature,
# top-k/top-p, penalties or grammar), as OpenAI and vLLM report them by default. Engines return ids and numbers;
# the pipeline adds each token's text (``requests.answers``).
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(slots=True)
class Request:
    """One generation: ``row_id`` is the input row's id, ``sample_index`` which of its samples this is."""

    row_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    # a scoring request (``stages.score``): no decoding, the log-probability of each of these token sequences
    # after the prompt, returned in ``Result.continuation_logprobs`` by the engine's ``score`` (``Scorer``)
    continuations: tuple[tuple[int, ...], ...] | None = None


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
    # verify steps whose proposal came from grammar-forced tokens (None where the engine does not tell them)
    forced_verify_steps: int | None = None
    forced_tokens_proposed: int | None = None
    forced_tokens_accepted: int | None = None
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs; see TokenLogprob
    latency_s: float = 0.0
    error: str | None = None
    # a scoring request's answer: per continuation, the log-probability of each of its tokens (fp32 log-softmax
    # of the model's logits, teacher-forced after the prompt and the continuation's tokens before it)
    continuation_logprobs: list[list[float]] | None = None
    # set by the pipeline from ``text`` (``--reasoning-parser`` / ``--tool-call-parser``), never by engines
    reasoning_content: str | None = None
    tool_calls: str | None = None  # JSON list in OpenAI's shape


class Tokenizer(Protocol):
    """What the pipeline needs to turn rows into token ids: the model's tokenizer, owned by the engine only
    because the engine knows which model it loaded (``tokenizer.HFTokenizer`` for HF model dirs)."""

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Chat template with ``add_generation_prompt=True``, tokenized; ``tools`` and ``template_kwargs``
        (e.g. ``enable_thinking``) are passed to the template as variables."""
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
    features: frozenset[str]  # which of ``FEATURES`` it honours; empty: plain sampling only

    def identity(self) -> dict[str, Any]:
        """Everything about the model/draft/backend that changes outputs; goes into the run fingerprint."""
        ...

    @property
    def max_context(self) -> int | None: ...

    def run(self, requests: Iterable[Request], max_in_flight: int) -> Iterator[Result]: ...

    def close(self) -> None: ...


class Scorer(Protocol):
    """An engine that can score (``Request.continuations``): one prefill per request, no decoding. The pipeline
    refuses a scoring stage on an engine without ``score``, in one line, before any row runs."""

    def score(self, requests: list[Request]) -> list[Result]:
        """One ``Result`` per request, in order, with ``continuation_logprobs`` set (or ``error``: that row's)."""
        ...


def can_score(engine: Any) -> bool:
    return callable(getattr(engine, "score", None))


def derive_seed(run_seed: int, row_id: str, sample_index: int) -> int:
    """Per-request seed: stable across processes and resumes (never Python's salted ``hash``), so a
    regenerated row equals the one an uninterrupted run would have produced."""
    digest = hashlib.blake2b(f"{run_seed}\x1f{row_id}\x1f{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF
