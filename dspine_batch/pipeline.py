"""``generate``: wires source -> mapping -> scheduler -> engine -> sink, with resume and signals around it.

Start-up order is chosen so mistakes fail fast and cheaply: resolve inputs, take the lock, load the engine,
resolve columns, check the fingerprint, build the done-set, then stream. Exit codes follow ``errors``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import compact
from .config import IDENTITY_FIELDS, GenerateConfig
from .engine import Engine, SamplingParams, open_engine
from .errors import (
    EXIT_ERROR_BUDGET,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BatchError,
    FatalError,
    Interrupted,
    UsageError,
)
from .keyset import KeySet
from .manifest import build_manifest, create_or_check, describe_inputs, read_manifest
from .mapping import Columns, MapSettings, RowMapper, WorkItem, check_param, resolve_columns
from .progress import Progress
from .resume import (
    Lock,
    all_locks_free,
    load_done,
    prepare_outdir,
    read_state,
    remove_staging,
    wipe,
    write_state,
)
from .scheduler import schedule
from .schema import SCHEMA_VERSION, output_schema
from .shard import attempt_from_env, parse_shard, shard_tag
from .shutdown import Shutdown
from .sink import PartSink, SinkStats, fsync_dir
from .sources import InputFile, iter_inputs, resolve_inputs

SUCCESS = "_SUCCESS"


def log(msg: str) -> None:
    print(f"dspine-batch: {msg}", file=sys.stderr, flush=True)


@dataclass
class Scan:
    rows: int = 0  # rows of this shard read from the inputs
    skipped: int = 0  # of which already committed
    finished: bool = False


def check_settings(cfg: GenerateConfig) -> None:
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
        check_param(name, getattr(cfg, name), lambda m, n=name: UsageError(f"--{n.replace('_', '-')}: {m}"))
    if cfg.num_samples < 1:
        raise UsageError("--num-samples: expected an integer >= 1")
    if cfg.max_in_flight < 1:
        raise UsageError("--max-in-flight: expected an integer >= 1")
    if cfg.on_error not in ("skip", "fail"):
        raise UsageError("--on-error: expected skip or fail")
    if not 0 <= cfg.max_error_rate <= 1:
        raise UsageError("--max-error-rate: expected a number in [0, 1]")
    if cfg.limit is not None and cfg.limit < 0:
        raise UsageError("--limit: expected an integer >= 0")
    if cfg.commit_rows < 1 or cfg.commit_seconds <= 0:
        raise UsageError("--commit-rows/--commit-seconds: expected positive values")


def iter_work(files: list[InputFile], columns: Columns, mapper: RowMapper, limit: int | None,
              shard: tuple[int, int], done: KeySet, scan: Scan) -> Iterator[WorkItem]:
    """Rows of this shard that are not committed yet, as work items, in input order."""
    index, count = shard
    check_done = len(done) > 0
    for batch in iter_inputs(files, columns.read_columns(), limit):
        ids, problems, hashes = mapper.assign_ids(batch)
        mask = None
        if count > 1:
            mask = (hashes % np.uint64(count)) == np.uint64(index)
        n_mine = len(ids) if mask is None else int(mask.sum())
        if check_done:
            todo = ~done.contains_many(hashes)
            mask = todo if mask is None else mask & todo
        picks = range(len(ids)) if mask is None else np.flatnonzero(mask).tolist()
        scan.rows += n_mine
        scan.skipped += n_mine - len(picks)
        if not picks:
            continue
        file, indices = batch.file, batch.indices
        rows = batch.rows_at(list(picks))
        for k, row in zip(picks, rows, strict=True):
            yield mapper.build(ids[k], file, indices[k], row, problems[k], int(hashes[k]))
    scan.finished = True


def _use_chat(cfg: GenerateConfig, columns: Columns, engine: Engine) -> bool:
    if cfg.chat_template is True and not engine.has_chat_template:
        raise UsageError("--chat-template: the model has no chat template (use --raw)")
    use_chat = engine.has_chat_template if cfg.chat_template is None else cfg.chat_template
    if not use_chat and columns.messages:
        raise UsageError(f"--raw cannot render the messages column {columns.messages!r}; it needs a chat template")
    if not use_chat and cfg.system_prompt:
        raise UsageError("--system-prompt needs a chat template (not --raw)")
    return use_chat


def _total_rows(files: list[InputFile], limit: int | None, shards: int) -> int | None:
    """Input rows when the formats know their length (Parquet/Arrow metadata), for the progress bar."""
    if shards > 1:
        return None
    total = 0
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for inp in files:
            if inp.kind == "parquet":
                total += pq.ParquetFile(inp.path).metadata.num_rows
            elif inp.kind == "arrow":
                for path in inp.arrow_files:
                    with pa.memory_map(path) as src:
                        total += pa.ipc.open_stream(src).read_all().num_rows
            else:
                return None
    except Exception:  # only a progress hint
        return None
    return min(total, limit) if limit is not None else total


def generate(cfg: GenerateConfig) -> int:
    check_settings(cfg)
    shard = parse_shard(cfg.shard)
    tag = shard_tag(*shard)
    cfg.inputs = [os.path.abspath(p) for p in cfg.inputs]  # finalize re-reads them from the manifest
    files = resolve_inputs(cfg.inputs, cfg.split)
    for inp in files:
        if inp.kind in ("jsonl", "openai") and os.path.getsize(inp.path) == 0:
            log(f"warning: {inp.name}: empty file (0 rows)")
    outdir = os.path.abspath(cfg.output)
    prepare_outdir(outdir)
    shutdown = Shutdown(cfg.grace_seconds).install()
    lock = Lock(outdir, tag).acquire()
    try:
        if read_manifest(outdir) is not None:
            if cfg.overwrite:
                held = [h for h in all_locks_free(outdir) if h != f"lock-{tag}"]
                if held:
                    raise UsageError(f"--overwrite: other shards are running ({', '.join(held)})")
                wipe(outdir)
                log(f"--overwrite: removed the previous run in {outdir}")
            elif not cfg.resume:
                raise UsageError(f"{outdir} holds a run; use --resume to continue it or --overwrite to start over")
        compact.recover(outdir)  # a crashed `finalize --compact` must not leave duplicates behind
        name = cfg.engine
        if os.environ.get("DSPINE_BATCH_TEST_ENGINE") and name in ("auto", "reference"):
            name = os.environ["DSPINE_BATCH_TEST_ENGINE"]  # tests: the scripted engine in subprocesses
        engine = open_engine(name, cfg.model, cfg.draft, cfg.engine_args)
        try:
            return _run(cfg, files, outdir, shard, tag, engine, shutdown)
        finally:
            engine.close()
    except Interrupted:
        log("interrupted before work started; run the same command again")
        return EXIT_INTERRUPTED
    finally:
        lock.release()
        shutdown.restore()


def _run(cfg: GenerateConfig, files: list[InputFile], outdir: str, shard: tuple[int, int], tag: str,
         engine: Engine, shutdown: Shutdown) -> int:
    columns = resolve_columns(files, cfg.prompt_column, cfg.messages_column, cfg.id_column, cfg.keep_columns,
                              cfg.row_params)
    use_chat = _use_chat(cfg, columns, engine)
    schema = output_schema(columns.keep_schema(), cfg.save_token_ids)
    settings = {k: getattr(cfg, k) for k in IDENTITY_FIELDS} | {"chat_template": use_chat}
    fields = {"schema_version": SCHEMA_VERSION, "inputs": describe_inputs(files), "settings": settings,
              "columns": {"prompt": columns.prompt, "messages": columns.messages, "id": columns.id,
                          "keep": list(columns.keep), "keep_types": [str(t) for t in columns.keep_types],
                          "row_params": list(columns.row_params)},
              "engine": engine.identity()}
    manifest = create_or_check(outdir, build_manifest(fields, cfg.as_dict(), shard[1], schema.names))
    schema = schema.with_metadata({"dspine_batch.manifest": _manifest_meta(manifest)})
    removed = remove_staging(outdir, tag)
    t0 = time.monotonic()
    done = load_done(outdir, tag, id_column=columns.id is not None)
    if done.rows or removed:
        log(f"resuming: {done.rows:,} rows already committed in {done.next_seq} parts "
            f"({time.monotonic() - t0:.2f}s); {removed} unfinished staging file(s) discarded")
    defaults = SamplingParams(cfg.max_new_tokens, float(cfg.temperature), float(cfg.top_p), max(cfg.top_k, 0),
                              cfg.seed, engine.stop_token_ids(cfg.stop), tuple(cfg.stop))
    mapper = RowMapper(MapSettings(columns, defaults, cfg.num_samples, cfg.system_prompt, use_chat), engine)
    attempt = attempt_from_env()
    prev = read_state(outdir, tag)
    state = {"shard": f"{shard[0]}/{shard[1]}", "fingerprint": manifest["fingerprint"], "state": "running",
             "pid": os.getpid(), "attempt": attempt, "starts": int(prev.get("starts", 0)) + 1,
             "started_at": time.time(), "elapsed_before_s": float(prev.get("elapsed_s", 0.0)),
             "rows_before": done.rows, "error_rows_before": done.error_rows}
    if os.environ.get("SLURM_JOB_ID"):  # batch logs are appended across requeues: say which start this is
        job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if job else os.environ["SLURM_JOB_ID"]
        state["slurm_job"] = job
        log(f"shard {shard[0]}/{shard[1]}: Slurm job {job}, restart {attempt}, start {state['starts']} of this shard")

    def on_commit(stats: SinkStats) -> None:
        state.update(rows_done=done.rows + stats.rows, error_rows=done.error_rows + stats.error_rows,
                     parts=stats.parts, last_commit_at=stats.last_commit,
                     completion_tokens_this_run=stats.completion_tokens,
                     elapsed_s=state["elapsed_before_s"] + time.time() - state["started_at"])
        write_state(outdir, tag, state)

    on_commit(SinkStats())
    sink = PartSink(outdir, schema, tag, done.next_seq, cfg.num_samples, cfg.commit_rows, cfg.commit_seconds,
                    attempt, on_commit)
    progress = Progress(cfg.progress, _total_rows(files, cfg.limit, shard[1]), done.rows, cfg.log_interval)
    scan = Scan()
    work = iter_work(files, columns, mapper, cfg.limit, shard, done.keys, scan)
    failure: str | None = None
    outcome = "done"
    try:
        fail_fast = cfg.on_error == "fail"
        for item, results in schedule(work, engine, cfg.max_in_flight, shutdown):
            err = item.error
            tokens = steps = spec = 0
            if results is not None:
                for r in results:
                    if r.error is not None:
                        err = err or r.error
                    else:
                        tokens += r.completion_tokens
                        if r.verify_steps:
                            steps += r.verify_steps
                            spec += (r.accept_length or 0.0) * r.verify_steps
            if err and fail_fast:
                failure = failure or err
                shutdown.request("--on-error fail")
                continue
            sink.add(item, results)
            progress.update(1, err is not None, tokens, steps, spec)
            if sink.due():
                sink.commit()
            if shutdown.expired:
                break
    except Interrupted:
        outcome = "interrupted"
    except BatchError:
        sink.commit()
        state["state"] = "failed"
        on_commit(sink.stats)
        progress.close()
        raise
    except Exception as e:
        sink.commit()
        state["state"] = "interrupted"
        on_commit(sink.stats)
        progress.close()
        if os.environ.get("DSPINE_BATCH_DEBUG"):
            raise
        log(f"the engine failed: {type(e).__name__}: {str(e)[:300]}; finished rows are committed; run the same "
            "command again to resume (DSPINE_BATCH_DEBUG=1 shows a traceback)")
        return EXIT_INTERRUPTED
    signal.setitimer(signal.ITIMER_REAL, 0)
    sink.commit()
    progress.close()
    if failure:
        state["state"] = "failed"
        on_commit(sink.stats)
        raise FatalError(f"{failure} (--on-error fail; rows before it are committed)")
    if outcome == "interrupted" or (shutdown.requested and not scan.finished):
        state["state"] = "interrupted"
        on_commit(sink.stats)
        log(f"stopped ({shutdown.reason or 'grace period over'}): {sink.stats.rows:,} rows committed this run; "
            "run the same command again to resume")
        return EXIT_INTERRUPTED
    rows = done.rows + sink.stats.rows
    errors = done.error_rows + sink.stats.error_rows
    state.update(state="done", total_rows=scan.rows)
    on_commit(sink.stats)
    rate = errors / rows if rows else 0.0
    log(f"done: {rows:,} rows ({sink.stats.rows:,} this run, {scan.skipped:,} were already committed), "
        f"{errors:,} with errors -> {outdir}")
    if rate > cfg.max_error_rate:
        log(f"error rate {rate:.1%} is over --max-error-rate {cfg.max_error_rate:.1%}; see `dspine-batch report`")
        return EXIT_ERROR_BUDGET
    if shard[1] == 1:
        _write_success(outdir)
    return EXIT_OK


def _write_success(outdir: str) -> None:
    path = os.path.join(outdir, SUCCESS)
    with open(path, "w") as f:
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(outdir)


def _manifest_meta(manifest: dict) -> str:
    import json

    return json.dumps({k: manifest[k] for k in ("fingerprint", "config", "versions", "num_shards")} |
                      {"engine": manifest["fingerprint_fields"]["engine"]}, default=str)
