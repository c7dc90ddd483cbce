"""A deterministic fake engine for tests and the pipeline benchmark.

Tokens are a pure function of (prompt ids, sampling params), so a resumed run can be compared with an
uninterrupted one; latency and errors are scripted; stats come out SGLang-shaped (``meta_info`` names) and
go through the same normalisation as a real backend. Selected with the hidden ``--engine scripted``, or put
behind the default command line by the tests (``registry.engines_replaced``); configured with
``--engine-arg KEY=VALUE``. ``crash_after`` raises ``EngineDied`` (a transient death: exit 75), ``poison=ROW_ID``
raises it whenever that row is in flight (a crash that repeats on the same row), ``fail_after`` a plain exception
(a bug: exit 1). ``stall_after`` stops producing after that many results with a request in hand (an engine that
hangs: the watchdog's test), ``hang_every`` never finishes every k-th request (by hash) unless ``request_timeout``
(set by the pipeline from --request-timeout) ends it as an error at its deadline; ``honor_timeout=0`` ignores the
setting, as an engine that does not know it would.

It declares every request feature (``base.FEATURES``) and honours them where a test can tell: a ``choice`` row
gets one of its strings, a ``json_schema`` / ``json_object`` row a JSON value that validates (``_instance``; cut
at ``max_new_tokens`` like any output, finish ``length``), ``logprobs`` rows deterministic log-probabilities
(the chosen token first among its ``top_logprobs``); penalties, logit bias, min_tokens, regex and grammar
are accepted and ignored. A prompt carrying the tools block (``<tools>``, what the pipeline gives a template
without tools) is answered with a Hermes ``<tool_call>`` to its first tool; ``reasoning=1`` wraps every answer
in a ``<think>`` block first. Such text is spelled one token per character (ids ``CHAR_BASE`` + code point).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dspine_batch.engines.base import FEATURES, Request, Result, Structure
from dspine_batch.engines.sglang.stats import stats_from_sglang_meta
from dspine_batch.engines.stop_strings import cut_at_stop
from dspine_batch.errors import EngineDied, UsageError, request_timed_out

EOS = 0
CHAR_BASE = 1 << 20  # ids of the characters of structured text (generated letters stay below 64)


@dataclass
class ScriptedTokenizer:
    """One token per character (``ord``); generated tokens decode to letters."""

    chat_template: bool = True
    zero_cost: bool = False

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template

    def encode(self, text: str) -> list[int]:
        if self.zero_cost:
            return [len(text)]  # tokenization is engine cost too
        return list(map(ord, text))

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """A template that, like the embedded SmolLM2's, reads neither ``tools`` nor template options."""
        return self.encode("".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>")

    def decode(self, ids: list[int]) -> str:
        return _letters(ids)

    def token_text(self, token_id: int) -> str:
        return _letters([token_id])

    @property
    def vocab_size(self) -> int:
        return CHAR_BASE + 0x110000  # letters below, then one id per Unicode code point

    def stop_token_ids(self, stop: Iterable[str]) -> tuple[int, ...]:
        return (EOS,)


@dataclass
class ScriptedEngine:
    latency: float = 0.0  # seconds per request (x0.5..1.5 jitter by request, so results finish out of order)
    error_every: int = 0  # every k-th request (by hash) returns an engine error
    crash_after: int = 0  # raise EngineDied (transient: rerun helps) after this many results
    fail_after: int = 0  # raise a plain RuntimeError (a bug) after this many results
    poison: str = ""  # raise EngineDied whenever this row is in flight (a deterministic crash)
    zero_cost: bool = False  # skip token synthesis: for measuring the pipeline alone
    draft: bool = True
    block_size: int = 8
    max_context_len: int = 4096
    chat_template: bool = True
    reasoning: bool = False  # answer "<think>...</think>answer"
    stall_after: int = 0  # hang (holding a request) after this many results
    hang_every: int = 0  # every k-th request (by hash) never finishes, unless request_timeout ends it
    honor_timeout: bool = True
    request_timeout: float | None = None  # set by the pipeline (--request-timeout)
    name: str = "scripted"
    features: frozenset[str] = FEATURES

    @classmethod
    def from_args(cls, args: dict[str, str]) -> ScriptedEngine:
        kinds = {"latency": float, "error_every": int, "crash_after": int, "fail_after": int, "poison": str,
                 "block_size": int,
                 "max_context": int, "zero_cost": _flag, "draft": _flag, "chat_template": _flag,
                 "reasoning": _flag, "stall_after": int, "hang_every": int, "honor_timeout": _flag}
        kw: dict[str, Any] = {}
        for key, value in args.items():
            if key not in kinds:
                raise UsageError(f"--engine-arg {key}: unknown for the scripted engine ({', '.join(kinds)})")
            try:
                kw["max_context_len" if key == "max_context" else key] = kinds[key](value)
            except ValueError as e:
                raise UsageError(f"--engine-arg {key}={value}: {e}") from e
        return cls(**kw)

    def identity(self) -> dict[str, Any]:
        return {"engine": "scripted", "draft": self.draft, "block_size": self.block_size,
                "error_every": self.error_every, "zero_cost": self.zero_cost} | (
                    {"reasoning": True} if self.reasoning else {})

    @property
    def max_context(self) -> int | None:
        return self.max_context_len

    @property
    def tokenizer(self) -> ScriptedTokenizer:
        return ScriptedTokenizer(self.chat_template, self.zero_cost)

    def close(self) -> None:
        pass

    def describe_state(self) -> str:
        """What the watchdog reports of an engine that stopped producing."""
        return f"scripted engine, {getattr(self, '_held', 0)} request(s) held"

    def _hangs(self, req: Request) -> bool:
        return bool(self.hang_every) and _h("hang", req.row_id, req.sample_index) % self.hang_every == 0

    def _stall(self, held: int) -> None:
        self._held = held
        while True:  # a hung engine: only a signal (the watchdog's) gets out of here
            time.sleep(0.05)

    def run(self, requests: Iterable[Request], max_in_flight: int) -> Iterator[Result]:
        produced = 0
        if self.latency <= 0 and not self.hang_every:
            for req in requests:
                self._maybe_poisoned([req])
                if self.stall_after and produced >= self.stall_after:
                    self._stall(1)
                yield self._result(req, 0.0)
                produced += 1
                self._maybe_crash(produced)
            return
        it = iter(requests)
        heap: list[tuple[float, int, Request, float]] = []
        seq, exhausted = 0, False
        while True:
            while not exhausted and len(heap) < max_in_flight:
                try:
                    req = next(it)
                except StopIteration:
                    exhausted = True
                    break
                lat = self.latency * (0.5 + _h(req.row_id, req.sample_index) % 1000 / 1000)
                timeout = self.request_timeout if self.honor_timeout else None
                if self._hangs(req):
                    lat = timeout if timeout else float("inf")
                heapq.heappush(heap, (time.monotonic() + lat, seq, req, lat))
                seq += 1
            if not heap:
                return
            self._maybe_poisoned([h[2] for h in heap])
            if self.stall_after and produced >= self.stall_after or heap[0][0] == float("inf"):
                self._stall(len(heap))
            due, _, req, lat = heapq.heappop(heap)
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if self._hangs(req):
                yield Result(req.row_id, req.sample_index, prompt_tokens=len(req.prompt_ids),
                             error=request_timed_out(lat), latency_s=lat)
            else:
                yield self._result(req, lat)
            produced += 1
            self._maybe_crash(produced)

    def score(self, requests: list[Request]) -> list[Result]:
        """Scoring requests (``base.Scorer``) with made-up log-probabilities: a pure function of the prompt, the
        continuation's tokens before and the token (no proper distribution is needed by any test; equal inputs give
        equal numbers, across processes). ``poison`` dies on its row as ``run`` does."""
        from dspine_batch.engines.scoring import score_requests

        def fake(batch: list[Request]) -> list[list[list[float]]]:
            self._maybe_poisoned(batch)
            return [[[-(_h(",".join(map(str, [*r.prompt_ids, *c[:j]])), t) % 1000) / 250 - 0.01
                      for j, t in enumerate(c)] for c in r.continuations or ()] for r in batch]

        return score_requests(requests, self.max_context_len, 8, fake)

    def _maybe_poisoned(self, in_flight: list[Request]) -> None:
        if self.poison and any(r.row_id == self.poison for r in in_flight):
            raise EngineDied(f"scripted engine crashed on row {self.poison}")

    def _maybe_crash(self, produced: int) -> None:
        if self.crash_after and produced >= self.crash_after:
            raise EngineDied(f"scripted engine died after {produced} results")
        if self.fail_after and produced >= self.fail_after:
            raise RuntimeError(f"scripted engine bug after {produced} results")

    def _result(self, req: Request, latency: float) -> Result:
        p = req.params
        if self.zero_cost:
            return Result(req.row_id, req.sample_index, [], "", "stop", len(req.prompt_ids), 0, latency_s=latency)
        if self.error_every and _h(req.row_id, req.sample_index) % self.error_every == 0:
            return Result(req.row_id, req.sample_index, prompt_tokens=len(req.prompt_ids),
                          error="scripted engine error", latency_s=latency)
        salt = f"{p.temperature}:{p.top_p}:{p.top_k}:{p.seed if p.temperature > 0 else ''}"
        base = _h(",".join(map(str, req.prompt_ids[-64:])), salt)
        want = 1 + base % 48
        special = _special_text(p.structure, req.prompt_ids, base, self.reasoning)
        if special is None:
            n = min(want, p.max_new_tokens)
            tokens = [1 + (base >> (i % 48)) % 26 + i % 7 for i in range(n)]
        else:
            want = len(special)
            tokens = [CHAR_BASE + ord(c) for c in special[:p.max_new_tokens]]
        text = _letters(tokens)
        finish = "stop" if want <= p.max_new_tokens else "length"
        cut = cut_at_stop(text, tokens, p.stop, _letters)
        if cut is not None:
            (text, tokens), finish = cut, "stop"
        result = Result(req.row_id, req.sample_index, tokens, text, finish, len(req.prompt_ids), len(tokens),
                        latency_s=latency)
        if self.draft and len(tokens) > 1:
            meta = _spec_meta(base, len(tokens), self.block_size)
            stats_from_sglang_meta(meta, result, block_size=self.block_size)
            if p.structure is not None:  # a made-up share of the rounds proposed grammar-forced tokens
                steps = result.verify_steps or 0
                result.forced_verify_steps = steps // 2
                result.forced_tokens_proposed = 3 * (steps // 2)
                result.forced_tokens_accepted = 3 * (steps // 2)
        if p.logprobs:
            result.logprobs = [_logprob(t, base, i, p.top_logprobs) for i, t in enumerate(tokens)]
        return result


def _spec_meta(base: int, completion: int, block: int) -> dict[str, Any]:
    """SGLang-style per-request spec stats: the first token comes from the prefill, then each verify round
    commits accepted + 1 tokens until ``completion`` is covered."""
    hist = [0] * block
    steps, done, x = 0, 1, base
    while done < completion:
        x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        accepted = min((x >> 33) % block, block - 1)
        hist[accepted] += 1
        steps += 1
        done += accepted + 1
    correct = sum(j * c for j, c in enumerate(hist))
    return {"completion_tokens": completion, "spec_verify_ct": steps, "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": steps * (block - 1), "spec_correct_drafts_histogram": hist,
            "spec_accept_length": completion / steps}


def _h(*parts: object) -> int:
    data = "\x1f".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _letters(ids: list[int]) -> str:
    return "".join(chr(t - CHAR_BASE) if t >= CHAR_BASE else chr(96 + t % 26 + 1) for t in ids)


def _logprob(token: int, base: int, i: int, top: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    lp = -((base >> (i % 40)) % 1000) / 250.0
    alts = tuple((token + 1 + j, lp - 0.5 * (j + 1)) for j in range(top - 1))
    return token, lp, (((token, lp),) + alts) if top else ()


def _special_text(structure: Structure | None, prompt_ids: list[int], base: int, reasoning: bool) -> str | None:
    """The answer of a structured row, a row offered tools, or a reasoning engine; None: plain letters."""
    text = None
    if structure is not None and structure.kind in ("choice", "json_schema", "json_object"):
        if structure.kind == "choice":
            options = json.loads(structure.spec)
            text = options[base % len(options)]
        else:
            schema = json.loads(structure.spec) if structure.spec else {"type": "object"}
            text = json.dumps(_instance(schema, base))
    elif structure is None:
        prompt = "".join(chr(t) for t in prompt_ids if 0 <= t < 0x110000)
        m = re.search(r'<tools>\s*(\{.*?\})\n', prompt)
        if m:
            fn = json.loads(m.group(1))["function"]
            args = _instance(fn.get("parameters") or {"type": "object"}, base)
            text = "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>"
    if reasoning:
        text = f"<think>\nthinking {base % 97}\n</think>\n\n" + (text if text is not None else "the answer")
    return text


def _instance(schema: Any, base: int) -> Any:
    """A value that validates against ``schema`` (the JSON Schema subset tests use)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][base % len(schema["enum"])]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _instance(schema[key][0], base)
    kind = schema.get("type", "object")
    kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: _instance(v, base >> 1) for k, v in props.items()}
    if kind == "array":
        return [_instance(schema.get("items") or {}, base + j) for j in range(max(1, schema.get("minItems", 1)))]
    if kind == "string":
        text = f"v{base % 1000}".ljust(schema.get("minLength", 0), "v")
        return text[:schema["maxLength"]] if "maxLength" in schema else text
    if kind == "integer":
        return int(schema.get("minimum", base % 100))
    if kind == "number":
        return float(schema.get("minimum", (base % 1000) / 10))
    if kind == "boolean":
        return bool(base & 1)
    return None


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")
