"""A rerun with nothing left to do, found before any engine loads.

Nightly cron pipelines and requeued array tasks rerun finished jobs by design, and loading a model (seconds on a
CPU, minutes for SGLang on a GPU) only to find every row committed is waste. So before the engine loads, when OUTDIR
holds this run, the shard's done-set is loaded and the shard's input rows are read for their ids only (the id
column, or just the row indices) and looked up in it. If all are there the job says so and ends (exit 0, or 3 over
``--max-error-rate`` as before) without opening the engine; otherwise the done-set is handed on, not loaded twice.

"This run" is checked without an engine: the same inputs (content digests), settings, columns and shard count as
the manifest's fingerprint, and the same engine request as the manifest's config (``--engine``, ``--model``,
``--draft``, ``--engine-arg`` as given). What only a loaded engine can tell (the resolved model's digest, the dtype
this CPU resolves) is checked when there is work to do: with none, nothing is generated, so nothing can mix.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dspine_batch.config import IDENTITY_FIELDS, GenerateConfig
from dspine_batch.errors import FingerprintMismatch
from dspine_batch.inputs.sources import InputFile, iter_inputs
from dspine_batch.outdir.keyset import KeySet
from dspine_batch.outdir.manifest import diff
from dspine_batch.outdir.schema import SCHEMA_VERSION
from dspine_batch.outdir.watermark import Mark
from dspine_batch.requests.fields import RowRequest
from dspine_batch.requests.fields import identity as request_identity
from dspine_batch.requests.mapping import Columns, RowIds
from dspine_batch.run.fingerprint import describe_inputs
from dspine_batch.run.selector import seek_starts
from dspine_batch.storage.urls import redacted

REQUEST = ("engine", "model", "draft", "engine_args")  # the engine as asked for, before it resolves anything


def run_fields(cfg: GenerateConfig, files: list[InputFile], columns: Columns, use_chat: bool | None,
               request: RowRequest) -> dict[str, Any]:
    """The fingerprint's fields that do not need an engine (the job adds ``engine``); ``request``: the job-wide
    request fields (``requests.job_request``), in their canonical form."""
    settings = {k: getattr(cfg, k) for k in IDENTITY_FIELDS} | {"chat_template": use_chat,
                                                                 "request": request_identity(request)}
    fields = {"schema_version": SCHEMA_VERSION, "inputs": describe_inputs(files), "settings": settings,
              "columns": {"prompt": columns.prompt, "messages": columns.messages, "id": columns.id,
                          "keep": list(columns.keep), "keep_types": [str(t) for t in columns.keep_types],
                          "row_params": list(columns.row_params)}}
    if columns.templates is not None:  # only when set: runs without a template keep their fingerprint
        fields["template"] = columns.templates.identity()
    return fields


def run_changes(cfg: GenerateConfig, files: list[InputFile], columns: Columns, manifest: dict[str, Any],
                request: RowRequest, extra: dict[str, Any] | None = None) -> list[str]:
    """What differs between the run in OUTDIR and this one, in the fingerprint's fields an engine is not needed
    for (``manifest.diff``'s words); empty: the same run as far as can be told before the model loads. ``extra``:
    fields of the fingerprint beyond ``run_fields``' (a stage's rules and input, ``run.precheck``)."""
    old = manifest.get("fingerprint_fields") or {}
    recorded_chat = (old.get("settings") or {}).get("chat_template")  # resolved from the model's tokenizer
    new = run_fields(cfg, files, columns, recorded_chat if cfg.chat_template is None else cfg.chat_template,
                     request) | (extra or {})
    if all(_canon(old.get(k)) == _canon(v) for k, v in new.items()):
        return []
    return diff({k: old.get(k) for k in new}, new) or ["(unknown)"]


def refuse_other_run(outdir: str, changes: list[str], manifest: dict[str, Any]) -> None:
    """The refusal ``manifest.create_or_check`` would give after the model loaded, given before it loads."""
    old = (manifest.get("fingerprint_fields") or {}).get("schema_version")
    if old != SCHEMA_VERSION:
        raise FingerprintMismatch(
            f"{outdir} was written by another dspine-batch version (schema_version: {old} -> {SCHEMA_VERSION}; "
            "one folder never mixes parts of two output schemas): finish it with the version that started it "
            "(its committed rows are intact), or --overwrite to start over")
    hint = " (to generate its failed rows again from fixed input lines, add --retry-errors)" \
        if all(c.startswith("inputs") for c in changes) else ""
    raise FingerprintMismatch(
        f"{outdir} holds a different run; changed: " + "; ".join(changes[:8]) + ("; ..." if len(changes) > 8 else "")
        + f". Use the original settings to resume, or --overwrite to start over{hint}; the model was not loaded.")


def _same_run(cfg: GenerateConfig, files: list[InputFile], columns: Columns, manifest: dict[str, Any],
              request: RowRequest) -> bool:
    return not run_changes(cfg, files, columns, manifest, request) and same_engine_asked(cfg, manifest)


def same_engine_asked(cfg: GenerateConfig, manifest: dict[str, Any]) -> bool:
    """The engine, model, draft and engine arguments asked for are the run's (the fingerprint holds the engine as
    it resolved them, which needs the engine loaded)."""
    config = manifest.get("config") or {}  # written redacted (``manifest.build_manifest``): compare it so
    return all(_canon(config.get(k)) == _canon(redacted(getattr(cfg, k))) for k in REQUEST)


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def count_missing(cfg: GenerateConfig, files: list[InputFile], columns: Columns, shard: tuple[int, int],
                   done: KeySet, marks: dict[str, Mark] | None = None, committed: int = 0) -> tuple[int, int]:
    """(this shard's input rows, those not in ``done``), from the row ids alone (``mapping.RowIds``: the same ids,
    duplicates and fallbacks included, that a run assigns). Stops after the first batch with a missing row: one
    is enough to load the engine, and a resumed run's committed rows come first, so a big JSONL input is not
    parsed twice. ``marks``: the watermarks (``outdir.watermark``): reading starts there, and ``committed`` rows
    (the done-set's) less those read again count the rows below them."""
    ids = RowIds(columns.id)
    marks = marks or {}
    starts = seek_starts(marks, files, cfg.limit)
    index, count = shard
    read = [columns.id] if columns.id else columns.read_columns()[:1]
    rows = missing = found = 0
    for batch in iter_inputs(files, read, cfg.limit, starts=starts):
        hashes = ids.assign_ids(batch)[2]
        mine = (hashes % np.uint64(count)) == np.uint64(index) if count > 1 else np.ones(len(hashes), dtype=bool)
        rows += int(np.count_nonzero(mine))
        if (mark := marks.get(batch.file.name)) is not None:
            below = np.asarray(batch.indices, dtype=np.int64) < mark.index
            found += int(np.count_nonzero(mine & below))
            mine &= ~below
        hashes = hashes[mine]
        if len(hashes):
            hit = done.contains_many(hashes)
            found += int(np.count_nonzero(hit))
            missing += len(hashes) - int(np.count_nonzero(hit))
        if missing:
            break
    return rows + (max(0, committed - found) if not missing else 0), missing
