"""A scoring stage (``score = {...}`` in a ``[[stages]]`` table): the model's own probabilities as a judge, one
prefill per row and no decoding.

::

    score = {labels = ["Yes", "No"]}              # a probability per label, normalised over the set
    score = {continuation = "{{ reference }}"}     # the log-likelihood of a text (a template over the row)

The prompt is the stage's ``template``, rendered as any stage's (chat template and all); each continuation is
tokenized on its own (no special tokens) and appended to the prompt's tokens. The engine returns the
log-probability of every continuation token (``Request.continuations`` -> ``Result.continuation_logprobs``);
this module turns them into the row's ``output``, a JSON object, so the next stage's templates and ``where`` and a
``select`` read its fields as they read any structured output (``structure_kind`` ``json_object``):

- labels: ``score`` (the normalised probability of the first label), ``label`` (the most probable label),
  ``probs`` (label -> normalised probability: a label's probability is the product of its tokens', and the set's
  probabilities are divided by their sum, so they add up to 1) and ``logprobs`` (label -> its unnormalised
  log-probability);
- continuation: ``score`` (the mean log-probability per token, comparable across texts of different lengths),
  ``logprob_sum``, ``logprob_mean`` and ``tokens``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dspine_batch.engines.base import Result, Structure
from dspine_batch.errors import RowError, UsageError
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.requests.templates import compile_template

OUTPUT = Structure("json_object", "")  # what a scoring row's output is: its fields are readable downstream


@dataclass(frozen=True)
class ScoreSpec:
    """What a scoring stage scores: a label set, or one continuation template."""

    labels: tuple[str, ...] = ()
    continuation: str | None = None

    def identity(self) -> dict[str, Any]:
        return {"labels": list(self.labels)} if self.labels else {"continuation": self.continuation}


def parse_score(value: Any, label: str) -> ScoreSpec:
    """``score = {...}`` checked (``UsageError`` naming the stage)."""
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in ("labels", "continuation"):
        raise UsageError(f'{label}: `score` must be a table with one key: labels = ["Yes", "No"] or continuation = '
                         '"{{ column }}"')
    if "labels" in value:
        labels = value["labels"]
        if not isinstance(labels, list) or len(labels) < 2 or not all(isinstance(x, str) and x for x in labels) \
                or len(set(labels)) != len(labels):
            raise UsageError(f"{label}: score labels must be a list of two or more distinct, non-empty strings")
        return ScoreSpec(labels=tuple(labels))
    text = value["continuation"]
    if not isinstance(text, str) or not text:
        raise UsageError(f"{label}: score continuation must be a template string (e.g. \"{{{{ reference }}}}\")")
    try:
        compile_template(text, "score continuation")
    except UsageError as e:
        raise UsageError(f"{label}: {e}") from e
    return ScoreSpec(continuation=text)


class Continuations:
    """A stage's continuations as token ids: the labels' once, a continuation template's per row."""

    def __init__(self, spec: ScoreSpec, tokenizer: Any):
        self.spec, self.tokenizer = spec, tokenizer
        self.template = compile_template(spec.continuation, "score continuation") if spec.continuation else None
        self.labels = tuple(tuple(self._encode(x)) for x in spec.labels)

    def _encode(self, text: str) -> list[int]:
        raw = getattr(self.tokenizer, "tok", None)  # an HF tokenizer's own: no special tokens around a fragment
        if raw is not None and hasattr(raw, "encode"):
            return list(raw.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text))

    def attach(self, item: WorkItem, row: Mapping[str, Any], file: str) -> WorkItem:
        """``item``'s requests made scoring requests (an error row stays as it is; a continuation that cannot be
        rendered for this row is its error)."""
        if item.error is not None or not item.requests:
            return item
        conts = self.labels
        if self.template is not None:
            try:
                conts = (tuple(self._encode(self.template.render(row, file, 0))),)
            except RowError as e:
                return replace(item, requests=[], error=f"score continuation: {e}")
        return replace(item, requests=[replace(r, continuations=conts, params=replace(r.params, structure=OUTPUT))
                                       for r in item.requests])


def fill(spec: ScoreSpec, results: list[Result] | None) -> None:
    """Each scored result's ``output`` (the JSON object of the module docstring), from its log-probabilities."""
    for r in results or ():
        if r.error is not None or r.continuation_logprobs is None:
            continue
        r.text = json.dumps(columns(spec, r.continuation_logprobs), ensure_ascii=False)
        r.finish_reason = "stop"


def columns(spec: ScoreSpec, logprobs: list[list[float]]) -> dict[str, Any]:
    """The fields of a scored row (module docstring) from its continuations' per-token log-probabilities."""
    if spec.labels:
        sums = [math.fsum(lp) for lp in logprobs]
        top = max(sums)
        z = top + math.log(math.fsum(math.exp(s - top) for s in sums))  # log-sum-exp: no underflow on long labels
        probs = [math.exp(s - z) for s in sums]
        return {"score": probs[0], "label": spec.labels[max(range(len(sums)), key=sums.__getitem__)],
                "probs": dict(zip(spec.labels, probs, strict=True)),
                "logprobs": dict(zip(spec.labels, sums, strict=True))}
    lp = logprobs[0]
    total = math.fsum(lp)
    return {"score": total / len(lp), "logprob_sum": total, "logprob_mean": total / len(lp), "tokens": len(lp)}
