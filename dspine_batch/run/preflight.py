"""What is settled before a job streams rows: its ``Job`` (resolved settings), the checks that fail fast and
cheaply before the model loads (structures, the previous run, free space, the chat template), the engine load,
the log line format, the default OUTDIR and ``_SUCCESS``. Shared by the one-stage job (``job``) and the stage
runner (``dspine_batch.stages``)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from dspine_batch.config import GenerateConfig
from dspine_batch.engines.base import Engine, SamplingParams, Tokenizer
from dspine_batch.engines.registry import open_engine
from dspine_batch.errors import (
    UsageError,
    human_bytes,
)
from dspine_batch.inputs.sources import InputFile
from dspine_batch.inputs.totals import exact_rows
from dspine_batch.log import log
from dspine_batch.outdir.output import Output, open_output
from dspine_batch.requests.fields import Defaults, RowOptions, RowRequest, merge
from dspine_batch.requests.mapping import Columns
from dspine_batch.requests.structures import StructureCheck, prescan
from dspine_batch.storage.fs import size as input_size

SUCCESS = "_SUCCESS"


def default_output(inputs: list[str]) -> str:
    """``-o`` when not given: ``<name of the first input>-out`` in the working directory, e.g.
    ``prompts.parquet`` -> ``./prompts-out``, ``data/*.parquet`` -> ``./data-out``; the same command line
    always maps to the same folder, so rerunning it resumes."""
    parts = Path(inputs[0].rstrip("/")).parts or ("dspine",)
    name = re.split(r"[*?\[]", parts[-1])[0]
    for suffix in (".gz", ".zst", ".jsonl", ".json", ".parquet", ".arrow"):
        name = name.removesuffix(suffix)
    name = name.strip("-_.") or (parts[-2] if len(parts) > 1 and parts[-2] != "/" else "dspine")
    return os.path.abspath(f"{name}-out")


@dataclass
class Job:
    """What a run needs once its inputs are checked: the resolved settings shared by the steps."""

    cfg: GenerateConfig
    files: list[InputFile]
    columns: Columns
    outdir: str
    shard: tuple[int, int]
    tag: str
    request: RowRequest = field(default_factory=RowRequest)  # the job-wide request fields, parsed
    structures: StructureCheck = field(default_factory=StructureCheck)
    out: Output | None = None  # OUTDIR's storage (a local directory or an object-store prefix)

    @property
    def output(self) -> Output:
        if self.out is None:
            self.out = open_output(self.outdir)
        return self.out


def load_engine(cfg: GenerateConfig, why: str = "") -> Engine:
    """The job's engine, opened with a line before and after (the load time is what a user waits for first)."""
    t0 = time.monotonic()
    log(f"loading the model ({cfg.engine} engine, model {cfg.model}, draft {cfg.draft}){why}")
    engine = open_engine(cfg.engine, cfg.model, cfg.draft, cfg.engine_args)
    log(f"model loaded in {time.monotonic() - t0:.1f}s ({engine.name} engine)")
    return engine


def check_job_structure(job: Job) -> Defaults:
    """The job-wide request checked, its structure compiled with xgrammar; returns it (over default sampling)."""
    base = job_defaults(job, SamplingParams(max_new_tokens=job.cfg.max_new_tokens))
    s = base.params.structure
    if s is not None and (problem := job.structures.problem(s)):
        raise UsageError(f"{base.labels['structure']}: {problem}")
    return base


def check_row_structures(job: Job, base: Defaults) -> None:
    """Every row's own structure checked now (``structures.prescan``): rows whose field is unusable become error
    rows (one warning line), or, with --on-error fail, the job is refused."""
    cols = job.columns
    if cols.row_params and job.files[0].kind not in ("jsonl", "openai"):
        log(f"per-row request fields from columns: {', '.join(cols.row_params)}")
    t0 = time.monotonic()
    found = prescan(job.files, cols.row_params, job.cfg.limit, base, job.structures)
    if found.rows or found.problems:
        log(f"structures: {found.rows:,} rows carry their own, {job.structures.compiled} distinct checked with "
            f"xgrammar ({time.monotonic() - t0:.1f}s)")
    if found.problems:
        if job.cfg.on_error == "fail":
            raise UsageError(f"{found.first} (--on-error fail)")
        log(f"warning: {found.problems:,} rows ask for a structure that cannot be used; they become error rows "
            f"(first: {found.first})")


def job_defaults(job: Job, base: SamplingParams) -> Defaults:
    """The job-wide request over ``base`` (the job's SamplingParams): flags, env and job file together."""
    def fail(label: str, msg: str) -> UsageError:
        return UsageError(f"{label}: {msg}")

    over, options, labels = merge(Defaults(base, RowOptions(n=job.cfg.num_samples), {}), job.request, fail)
    over.pop("stop", None)
    return Defaults(replace(base, **over), options, labels)


def check_previous_run(job: Job) -> None:
    out = job.output
    if out.read_manifest() is None:
        return
    if job.cfg.overwrite:
        held = [h for h in out.held_locks() if h not in (f"lock-{job.tag}", f"lease-{job.tag}")]
        if held:
            raise UsageError(f"--overwrite: other shards are running ({', '.join(held)})")
        out.wipe()
        log(f"--overwrite: removed the previous run in {job.outdir}")
    elif not job.cfg.resume:
        raise UsageError(f"{job.outdir} holds a run; use --resume to continue it or --overwrite to start over")


BYTES_PER_TOKEN = 2.0  # compressed output text (zstd, ~4 characters a token); token ids add 4 more before zstd
BYTES_PER_OUTPUT_ROW = 100  # the other columns, compressed


def check_free_space(job: Job, total: int | None) -> None:
    """Before the model loads: warn (never refuse) when the output filesystem has less free space than a rough
    upper bound of what the run writes, rows x samples x max_new_tokens x ~2 bytes. Committed rows are not
    subtracted (they are not known before the fingerprint check), so on a resume it errs on the safe side.
    Without a row count (JSONL, shards) only the input size is known: rows ~ input bytes / 200."""
    cfg = job.cfg
    free = job.output.free_bytes()
    if free is None:
        return
    if total is None:
        rows = sum(input_size(p) for inp in job.files for p in inp.content_files()) // 200 // job.shard[1]
    else:
        rows = total
    per_token = BYTES_PER_TOKEN + (4.0 if cfg.save_token_ids else 0.0)
    need = int(rows * cfg.num_samples * (cfg.max_new_tokens * per_token + BYTES_PER_OUTPUT_ROW))
    if free < need:
        log(f"warning: {job.outdir}: {human_bytes(free)} free, this run may write up to ~{human_bytes(need)} "
            f"(~{rows:,} rows x {cfg.num_samples} sample(s) x {cfg.max_new_tokens} tokens); if the disk fills it "
            "stops with exit 1, committed rows kept, and the same command resumes once space is freed")


def wants_chat(cfg: GenerateConfig, columns: Columns, tokenizer: Tokenizer) -> bool:
    if cfg.chat_template is True and not tokenizer.has_chat_template:
        raise UsageError("--chat-template: the model has no chat template (use --raw)")
    use_chat = tokenizer.has_chat_template if cfg.chat_template is None else cfg.chat_template
    if not use_chat and columns.messages:
        raise UsageError(f"--raw cannot render the messages column {columns.messages!r}; it needs a chat template")
    if not use_chat and cfg.system_prompt:
        raise UsageError("--system-prompt needs a chat template (not --raw)")
    if not use_chat and columns.templates is not None and columns.templates.system is not None:
        raise UsageError("--system-template needs a chat template (not --raw)")
    return use_chat


def total_rows(files: list[InputFile], limit: int | None, shards: int) -> int | None:
    """Input rows of this shard when the formats know their length (``totals.exact_rows``); with --shard about
    its share (rows are split by a hash of their id), for the progress bar."""
    total = exact_rows(files, limit)
    return total if total is None or shards == 1 else -(-total // shards)
