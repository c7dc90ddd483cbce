"""``export --format openai``: an OUTDIR as an OpenAI Batch API output file, one line per input row.

Tools that read OpenAI batch results (``custom_id`` -> ``response.body``) can read a dspine-batch job this way.
Each line: ``{"id", "custom_id": row_id, "response": {"status_code": 200, "request_id", "body": <a
chat.completion>}, "error": null}``; a row's samples are the ``choices`` of one completion (``index`` =
``sample_index``), each with ``message`` (``content``, ``reasoning_content`` where there is reasoning,
``tool_calls`` parsed into OpenAI's objects), ``logprobs`` (``{"content": [{token, logprob, bytes,
top_logprobs}]}``, ``bytes`` the token's own bytes, which add up to the content's UTF-8 even where a character is
split across tokens; a log-probability of -inf is written as -9999.0, as OpenAI does: JSON has no infinity) and
``finish_reason``; ``usage`` adds the samples' completion tokens to the row's prompt tokens, with
``prompt_tokens_details.cached_tokens``. A row that failed (any of its samples) is ``{"response": null,
"error": {"code", "message"}}`` with ``code`` ``invalid_request`` (refused before generation: a bad field, a
prompt too long) or ``engine_error``.

Ids are hashes of the row id (``batch_req_``, ``req_``, ``chatcmpl-``), so exporting twice gives the same file;
``created`` is the commit time of the row's part. Memory stays bounded on any number of rows: parts are read
a record batch at a time, and a row's samples are next to each other in one part (the sink commits a row
whole, in one part, sample after sample).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import pyarrow.parquet as pq

from dspine_batch.errors import UsageError, engine_side
from dspine_batch.outdir.output import arrow_path, committed_parts, open_output
from dspine_batch.storage.fs import filesystem, retrying
from dspine_batch.storage.objects import local_tmp_dir
from dspine_batch.storage.urls import is_url, redact

COLUMNS = ["row_id", "sample_index", "output", "reasoning_content", "tool_calls", "finish_reason", "status", "error",
           "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "logprobs"]
BATCH_ROWS = 2048
FINISH = {"stop", "length", "tool_calls", "content_filter", "function_call"}  # OpenAI's finish reasons


@dataclass
class ExportStats:
    lines: int = 0
    ok: int = 0
    errors: int = 0


def export_openai(outdir: str, path: str) -> ExportStats:
    """Write ``path`` (``-``: stdout); a file is written under a temporary name and renamed when complete (a URL:
    uploaded once complete, so a reader never sees half a results file)."""
    out = open_output(outdir)
    manifest = out.read_manifest()
    if manifest is None:
        raise UsageError(f"{out.display}: no _manifest.json (not a dspine-batch output)")
    model = str(manifest.get("config", {}).get("model", "unknown"))
    if path == "-":
        return _write(outdir, model, sys.stdout)
    if is_url(path):
        fs, inner = filesystem(path)
        tmp = os.path.join(local_tmp_dir(), f".dspine-export-{os.getpid()}.jsonl")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                stats = _write(outdir, model, f)
            retrying(lambda: fs.put_file(tmp, inner), redact(path))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return stats
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            stats = _write(outdir, model, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return stats


def _write(outdir: str, model: str, out: IO[str]) -> ExportStats:
    stats = ExportStats()
    for group, created in rows(outdir):
        line = openai_line(group, model, created)
        out.write(json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n")  # strict JSON, or a loud bug
        stats.lines += 1
        if line["error"] is None:
            stats.ok += 1
        else:
            stats.errors += 1
    return stats


def rows(outdir: str) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Each row's output records (its samples, in sample order) and its part's commit time."""
    for part in committed_parts(outdir):
        pf = pq.ParquetFile(**arrow_path(part.path))
        meta = json.loads((pf.metadata.metadata or {}).get(b"dspine_batch.part", b"{}"))
        created = int(meta.get("committed_at", 0))
        cols = [c for c in COLUMNS if c in pf.schema_arrow.names]  # parts from before schema 4 lack some
        group: list[dict[str, Any]] = []
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols):
            for rec in batch.to_pylist():
                if group and rec["row_id"] != group[0]["row_id"]:
                    yield sorted(group, key=lambda r: r["sample_index"]), created
                    group = []
                group.append(rec)
        if group:
            yield sorted(group, key=lambda r: r["sample_index"]), created


def _hash(prefix: str, row_id: str) -> str:
    return prefix + hashlib.blake2b(row_id.encode(), digest_size=12).hexdigest()


def openai_line(group: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
    """One OpenAI batch output line for one row's records."""
    row_id = group[0]["row_id"]
    line: dict[str, Any] = {"id": _hash("batch_req_", row_id), "custom_id": row_id}
    failed = next((r for r in group if r["status"] != "ok"), None)
    if failed is not None:
        # a row the engine took (it counted the prompt), or one it hung or died on, failed on the engine's side
        code = "engine_error" if failed.get("prompt_tokens") or engine_side(failed.get("error") or "") \
            else "invalid_request"
        return line | {"response": None, "error": {"code": code, "message": failed.get("error") or "failed"}}
    prompt = int(group[0].get("prompt_tokens") or 0)
    completion = sum(int(r.get("completion_tokens") or 0) for r in group)
    body = {"id": _hash("chatcmpl-", row_id), "object": "chat.completion", "created": created, "model": model,
            "choices": [_choice(r) for r in group],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": int(group[0].get("cached_prompt_tokens") or 0)}}}
    return line | {"response": {"status_code": 200, "request_id": _hash("req_", row_id), "body": body},
                   "error": None}


def _choice(r: dict[str, Any]) -> dict[str, Any]:
    calls = json.loads(r["tool_calls"]) if r.get("tool_calls") else None
    content = r.get("output")
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content,
                               "refusal": None}
    if r.get("reasoning_content") is not None:
        message["reasoning_content"] = r["reasoning_content"]
    if calls:
        message["tool_calls"] = calls
    finish = r.get("finish_reason")
    logprobs = r.get("logprobs")
    return {"index": int(r["sample_index"]), "message": message,
            "logprobs": None if logprobs is None else {"content": [_logprob(e, True) for e in logprobs],
                                                       "refusal": None},
            "finish_reason": finish if finish in FINISH else "stop"}


MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of (nearly) zero probability; JSON has no -inf


def _logprob(e: dict[str, Any], top: bool) -> dict[str, Any]:
    # stored as float32: written as float32's shortest decimal (-0.616, not -0.6159999966621399)
    lp = float(str(np.float32(e["logprob"])))
    own = e.get("bytes")  # (parts of schema 4 have only the text)
    out = {"token": e["token"], "logprob": lp if math.isfinite(lp) else MIN_LOGPROB,
           "bytes": list(own if own is not None else e["token"].encode("utf-8"))}
    if top:
        out["top_logprobs"] = [_logprob(t, False) for t in e.get("top_logprobs") or []]
    return out
