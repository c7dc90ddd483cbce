"""A stage as the job file writes it (``[[stages]]``), checked before the model loads.

::

    [[stages]]
    name = "questions"                       # its output: OUTDIR/questions/
    template = "Three questions about: {{ text }}"   # or a table {system = "...", user = "..."}
    json-schema = '{"type": "object", ...}'  # any request setting of `generate` (sampling, structure, tools, n ...)
    explode = "questions"                    # a list field of the parent's output: one row per item
    where = "score >= 4"                     # keep only the rows whose output passes (the rest go no further)
    dedup = "exact"                          # drop rows whose `dedup-on` field (default: output) was seen before
                                             # ("minhash": near duplicates, `dedup-threshold` 0.8, `dedup-ngram` 3)
    model = "path/to/judge-model"            # optional: this stage on another model (and `draft`)
    score = {labels = ["Yes", "No"]}         # a scoring stage: probabilities, no decoding (``stages.score``)
    select = {group = "root_id", by = "score", keep = 1}   # a select step, no template (``stages.select``)

Every stage after the first reads the committed, kept rows of the stage before it. A stage's settings are the
job's, overridden by its own. Consecutive stages on the same model share one engine, loaded once, with no barrier
between them; a stage on another model starts when the stages before it are done (``run``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from dspine_batch.config import GenerateConfig
from dspine_batch.errors import UsageError
from dspine_batch.outdir.manifest import STAGE_NAME
from dspine_batch.requests.templates import PromptTemplates, job_templates
from dspine_batch.stages.near import need_datasketch
from dspine_batch.stages.score import ScoreSpec, parse_score
from dspine_batch.stages.select import SelectSpec, parse_select
from dspine_batch.stages.where import Predicate, parse_where

# the request settings a stage may set (GenerateConfig names): what a row's answer depends on
STAGE_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_samples", "logprobs",
                  "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                  "logit_bias", "response_format", "json_schema", "regex", "choice", "grammar", "tools",
                  "tool_choice", "chat_template_kwargs", "reasoning_parser", "tool_call_parser", "system_prompt",
                  "chat_template")
_OWN = ("name", "template", "explode", "where", "dedup", "dedup_on", "dedup_threshold", "dedup_ngram", "model",
        "draft", "score", "select")
DEDUP = ("exact", "minhash")


@dataclass(frozen=True)
class StageSpec:
    """One stage, checked: its name, templates, the generate settings it runs with, and what it does to rows."""

    name: str
    index: int
    cfg: GenerateConfig  # the job's settings with the stage's own over them (output: OUTDIR/<name>)
    templates: PromptTemplates | None
    explode: str | None = None
    where: Predicate | None = None
    dedup: str | None = None
    dedup_on: str = "output"
    dedup_threshold: float = 0.8  # minhash: the Jaccard similarity of word n-grams that makes a duplicate
    dedup_ngram: int = 3
    lineage: bool = True  # a stage of [[stages]] (OUTDIR/<name>/, lineage columns); False: a job of one stage
    score: ScoreSpec | None = None  # a scoring stage: probabilities instead of generated text
    select: SelectSpec | None = None  # a select step: no model, the best rows of each group of the stage before

    def identity(self) -> dict[str, Any]:
        """What of the stage, beyond its generate settings, decides its rows (part of its fingerprint)."""
        out = {"stage": self.name, "index": self.index, "explode": self.explode,
               "where": self.where.text if self.where else None, "dedup": self.dedup, "dedup_on": self.dedup_on}
        if self.dedup == "minhash":
            out |= {"dedup_threshold": self.dedup_threshold, "dedup_ngram": self.dedup_ngram}
        if self.score is not None:  # only when set: the fingerprints of other stages stay as they were
            out["score"] = self.score.identity()
        if self.select is not None:
            out["select"] = self.select.identity()
        return out


def single_stage(cfg: GenerateConfig, templates: PromptTemplates | None) -> StageSpec:
    """A job without ``[[stages]]`` as the runner sees it: one stage writing OUTDIR itself, its rows with no
    lineage columns and no rules, its fingerprint the one such jobs always had (no stage fields)."""
    return StageSpec("", 0, cfg, templates, lineage=False)


def parse_stages(raw: Any, job: GenerateConfig, outdir: str) -> list[StageSpec]:
    """The job file's ``stages`` list, each checked (a problem: one ``UsageError`` naming the stage)."""
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        raise UsageError("--config: `stages` must be a list of tables ([[stages]])")
    out: list[StageSpec] = []
    for i, table in enumerate(raw):
        out.append(_stage(i, {k.replace("-", "_"): v for k, v in table.items()}, job, outdir, out))
    return out


def _stage(i: int, t: dict[str, Any], job: GenerateConfig, outdir: str, before: list[StageSpec]) -> StageSpec:
    name = t.get("name")
    label = f"stage {i + 1}" + (f" ({name!r})" if isinstance(name, str) else "")
    if not isinstance(name, str) or not STAGE_NAME.match(name):
        raise UsageError(f"{label}: `name` must be a short name of letters, digits, '_', '-', '.' (it names "
                         "OUTDIR/<name>/)")
    if any(s.name == name for s in before):
        raise UsageError(f"{label}: another stage has this name")
    unknown = [k for k in t if k not in _OWN and k not in STAGE_SETTINGS]
    if unknown:
        raise UsageError(f"{label}: unknown key {unknown[0]!r} (a stage takes {', '.join(_OWN)} and the request "
                         f"settings {', '.join(STAGE_SETTINGS)})")
    model, draft = t.get("model", job.model), t.get("draft")
    for key, value in (("model", model), ("draft", draft)):
        if value is not None and (not isinstance(value, str) or not value):
            raise UsageError(f"{label}: `{key}` must be a model name or path")
    if draft is None:  # the job's draft pairs with the job's model; another model's stage brings its own or none
        draft = job.draft if model == job.model else ("embedded" if model == "embedded" else "none")
    settings = {k: _setting(k, v) for k, v in t.items() if k in STAGE_SETTINGS} | {"model": model, "draft": draft}
    score, select = _score_select(label, i, t, before)
    if score is not None or select is not None:
        settings["num_samples"] = 1  # one row in, one row out: the job's --num-samples is the sampling stage's
    template = t.get("template")
    user, system = (template.get("user"), template.get("system")) if isinstance(template, dict) else (template, None)
    if user is None and i > 0 and select is None:
        raise UsageError(f"{label}: needs a `template` (its prompt is built from the rows of stage "
                         f"{before[-1].name!r})")
    try:
        templates = job_templates(user, system) if user is not None else None
    except UsageError as e:
        raise UsageError(f"{label}: {e}") from e
    cfg = replace(job, **settings, output=f"{outdir.rstrip('/')}/{name}", prompt_template=user,
                  system_template=system)
    explode = t.get("explode")
    if explode is not None and (i == 0 or not isinstance(explode, str) or not explode):
        raise UsageError(f"{label}: `explode` names a list field of the previous stage's rows (not on the first "
                         "stage)")
    where = None
    if t.get("where") is not None:
        if not isinstance(t["where"], str):
            raise UsageError(f"{label}: `where` must be a string")
        try:
            where = parse_where(t["where"])
        except ValueError as e:
            text = t["where"] if len(t["where"]) <= 80 else t["where"][:77] + "..."
            raise UsageError(f"{label}: where {text!r}: {e}") from e
    dedup = t.get("dedup")
    if dedup is not None and dedup not in DEDUP:
        raise UsageError(f"{label}: dedup {dedup!r}: expected one of {', '.join(DEDUP)}")
    dedup_on = t.get("dedup_on", "output")
    if not isinstance(dedup_on, str) or not dedup_on:
        raise UsageError(f"{label}: `dedup-on` names a field of the stage's rows")
    threshold, ngram = t.get("dedup_threshold", 0.8), t.get("dedup_ngram", 3)
    if dedup != "minhash" and ("dedup_threshold" in t or "dedup_ngram" in t):
        raise UsageError(f'{label}: `dedup-threshold` and `dedup-ngram` go with dedup = "minhash"')
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        raise UsageError(f"{label}: `dedup-threshold` must be a number in (0, 1] (a Jaccard similarity)")
    if isinstance(ngram, bool) or not isinstance(ngram, int) or not 1 <= ngram <= 32:
        raise UsageError(f"{label}: `dedup-ngram` must be a whole number of words from 1 to 32")
    if dedup == "minhash":
        need_datasketch()
    return StageSpec(name, i, cfg, templates, explode, where, dedup, dedup_on, float(threshold), ngram,
                     score=score, select=select)


_STRUCTURED = ("json_schema", "response_format", "regex", "choice", "grammar", "tools")


def _score_select(label: str, i: int, t: dict[str, Any],
                  before: list[StageSpec]) -> tuple[ScoreSpec | None, SelectSpec | None]:
    """A stage's ``score`` / ``select``, checked against the rest of its table."""
    score = parse_score(t["score"], label) if t.get("score") is not None else None
    select = parse_select(t["select"], label, [s.name for s in before]) if t.get("select") is not None else None
    if score is None and select is None:
        return None, None
    what = "score" if score is not None else "select"
    if score is not None and select is not None:
        raise UsageError(f"{label}: `score` and `select` go in two stages (score, then select the best)")
    if i == 0:
        raise UsageError(f"{label}: `{what}` reads the rows of the stage before it: not on the first stage")
    if t.get("num_samples", 1) != 1:
        raise UsageError(f"{label}: `{what}` makes one row per row of the stage before: drop num-samples here")
    if select is not None and (t.get("template") is not None or t.get("explode") is not None):
        raise UsageError(f"{label}: a select step runs no model: no `template` or `explode` (its rows are the rows "
                         "of the stage before it)")
    if score is not None and (used := [k for k in _STRUCTURED if t.get(k) is not None]):
        raise UsageError(f"{label}: {used[0].replace('_', '-')} means nothing on a scoring stage (it decodes nothing)")
    return score, select


def _setting(key: str, value: Any) -> Any:
    """A stage's setting in the form ``GenerateConfig`` holds it (as the CLI turns a job file's values)."""
    if key in ("response_format", "chat_template_kwargs", "tools", "json_schema") and isinstance(value, dict | list):
        return json.dumps(value)
    if key in ("stop", "choice") and isinstance(value, str):
        return [value]
    if key == "logit_bias" and isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    return value
