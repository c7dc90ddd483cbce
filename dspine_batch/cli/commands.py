"""The ``dspine-batch`` command line (click), in the style of simonw's ``llm``: discoverable help with
examples, every generate option also settable as DSPINE_BATCH_<OPTION> or in a TOML job file (--config);
precedence is flag > env > job file > default. Errors print one line and exit with the documented code.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
from typing import Any

import click

from dspine_batch import __version__
from dspine_batch.cli.help import engine_arg_table
from dspine_batch.cli.options import (
    ENV,
    FiniteFloatRange,
    KeyValue,
    OutdirOrUrl,
    env_option,
    grouped,
    load_config,
    section,
    storage_option,
)
from dspine_batch.config import GenerateConfig, load_toml
from dspine_batch.errors import DISK_FULL_ERRNOS, EXIT_FATAL, EXIT_INTERRUPTED, EXIT_USAGE, BatchError

GENERATE_EXAMPLES = """
\b
Examples:
  dspine-batch generate prompts.parquet                  # output in ./prompts-out (run again to resume)
  dspine-batch generate examples/prompts.jsonl -o out/
  dspine-batch generate data/*.parquet -o out/ --prompt-column question --id-column qid \\
      --max-new-tokens 512 --temperature 0.7 --num-samples 4 --seed 1
  dspine-batch generate requests.jsonl -o out/           # OpenAI batch JSONL (custom_id + body)
  dspine-batch generate facts.jsonl -o out/ --json-schema person.schema.json   # every output a valid record
  dspine-batch generate topics.parquet -o out/ --prompt-template 'One {{ level }} question about {{ topic }}.'
  dspine-batch generate my_dataset/ --split test -o out/ --keep-columns answer
  dspine-batch generate --config jobs/example.toml       # the same options from a TOML job file
  dspine-batch generate big.parquet -o out/ --shard 3/8  # one of 8 workers (Slurm arrays: automatic)
  dspine-batch generate big.parquet -o out/nightly --metrics-push http://pushgateway:9091 --price-per-hour 2.49

\b
Rows: the prompt column (default `prompt`; `messages` when there is no `prompt`) is rendered with the
model's chat template unless --raw. Row ids come from --id-column (default `id` if present), else
<file>:<row-index>. Columns (or OpenAI body keys) named like request fields override the job's settings for
their row (--no-row-params to ignore them): max_new_tokens / max_tokens / max_completion_tokens, temperature,
top_p, top_k, seed, stop, n, logprobs, top_logprobs, presence_penalty, frequency_penalty, repetition_penalty,
min_tokens, logit_bias, response_format, regex, choice, grammar (and vLLM's guided_json/regex/choice/grammar),
tools, tool_choice, parallel_tool_calls, chat_template_kwargs. README, "Requests".

\b
Resume: the same command again continues where a crash, kill or preemption stopped: no row is lost or
duplicated. Failed rows: the same command plus --retry-errors generates them again (the input's failed lines may
be fixed first). A hang: --stall-seconds ends a run whose engine produces nothing (exit 75, run again), and
--request-timeout makes one stuck request an error row. Exit codes: 0 done, 75 interrupted by a signal, a stall
or an engine death (run again: the rows in flight then run alone first, and one the engine dies on again
becomes an error row),
3 done but over --max-error-rate, 2 usage error or different settings than the run in OUTDIR, 1 fatal (a bug
or bad data: running again would fail the same way; a full disk: free space, then run it again). A committed
part found missing, truncated or damaged is moved aside to OUTDIR/_dspine/damaged/ and its rows generated again.
"""


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="dspine-batch")
def cli() -> None:
    """Offline batch generation with DSpine speculative decoding and exactly-once resume.

    \b
    dspine-batch generate INPUT... -o OUTDIR   run (or resume) a job
    dspine-batch info [MODEL]                  the model and draft a job would run (default: embedded)
    dspine-batch prepare                       build kernels, convert the model, calibrate: ahead of jobs
    dspine-batch status OUTDIR                 done / failed / remaining
    dspine-batch report OUTDIR                 tokens, throughput, acceptance (tau), errors
    dspine-batch export OUTDIR -o FILE         OpenAI batch results file (JSONL)
    dspine-batch finalize OUTDIR               check coverage, write _SUCCESS
    dspine-batch slurm JOB.toml --submit       Slurm array job + finalize (docs/slurm.md)
    dspine-batch estimate INPUT... [options]   tokens, time and cost of a job, from a sample of its rows
    """


@cli.command(epilog=GENERATE_EXAMPLES + "\n" + engine_arg_table())
@click.argument("inputs", nargs=-1, type=click.Path(), metavar="INPUT...")
@section("Inputs")
@grouped("--config", type=click.Path(dir_okay=False), callback=load_config, is_eager=True, expose_value=False,
            help="TOML job file with any of these options (and `inputs`, `output`).")
@grouped("--prompt-column", help="Column with the prompt text.  [default: prompt]")
@grouped("--messages-column", help="Column with chat messages [{role, content}, ...] instead of a prompt.")
@grouped("--id-column", help="Column with a unique row id ('' for none).  [default: id, if present]")
@grouped("--split", help="Split of a DatasetDict / local HF dataset dir.")
@grouped("--limit", type=click.IntRange(min=0), help="Only the first N input rows.")
@grouped("--row-params/--no-row-params", help="Let input columns override sampling settings per row.")
@storage_option(grouped=True)
@section("What to ask")
@grouped("--prompt-template", metavar="TEXT|FILE",
            help="Build each prompt from the row's columns with a Jinja2 template (sandboxed; a column the template "
                 "names and a row lacks makes that row an error), e.g. 'Write a {{ level }} question about "
                 "{{ topic }}.'; nested fields read as {{ judge.score }}. Job file: `template`.")
@grouped("--system-template", metavar="TEXT|FILE",
            help="A Jinja2 template for the system turn, over the same columns (with --prompt-template).")
@grouped("-s", "--system-prompt", help="System message added to every row.")
@grouped("--max-new-tokens", type=click.IntRange(min=1))
@grouped("-t", "--temperature", type=FiniteFloatRange(min=0), help="0 = greedy.")
@grouped("--num-samples", type=click.IntRange(min=1), help="Samples per row (a row's own `n` overrides it).")
@grouped("--seed", type=int, help="Run seed; each (row, sample) gets its own seed derived from it.")
@grouped("--json-schema", metavar="FILE", help="Every output follows this JSON Schema (a file, or inline JSON).")
@grouped("--response-format", metavar="JSON", help='OpenAI\'s response_format for every row, e.g. '
            '\'{"type": "json_object"}\'.')
@grouped("--regex", help="Every output matches this regular expression (xgrammar's syntax).")
@grouped("--choice", multiple=True, help="Every output is one of these strings (repeatable).")
@grouped("--grammar", metavar="FILE", help="Every output follows this EBNF/GBNF grammar (root rule `root`).")
@grouped("--stop", multiple=True, help="Stop string (repeatable).")
@grouped("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True))
@grouped("--top-k", type=click.IntRange(min=-1), help="0 or -1 = off.")
@grouped("--chat-template/--raw", "chat_template", show_default=False,
            help="Render prompts with the model's chat template, or tokenize them as-is.  [default: template if the "
                 "model has one]")
@grouped("--tools", metavar="FILE", help="OpenAI tools list (JSON file, or inline JSON) for every row, rendered "
            "by the chat template (or as a Hermes-style system block when the template ignores tools).")
@grouped("--tool-choice", metavar="none|auto|required|NAME",
            help="none: tools shown, calls not parsed; auto: calls parsed; required / a function's name: the "
                 "output is forced to be a call (a JSON schema: needs an engine with structured outputs).")
@grouped("--chat-template-kwargs", metavar="JSON",
            help='Variables for the chat template, e.g. \'{"enable_thinking": false}\' (Qwen3).')
@grouped("--logprobs/--no-logprobs", "logprobs", show_default=False,
            help="Store each generated token's log-probability (column `logprobs`): the log-softmax of the model's "
                 "own logits at that position, before temperature, top-k/top-p, penalties or a grammar, as OpenAI "
                 "and vLLM report them by default.")
@grouped("--top-logprobs", type=click.IntRange(0, 20), help="Also the N most likely tokens at each position "
            "(turns on --logprobs).")
@grouped("--presence-penalty", type=FiniteFloatRange(-2, 2))
@grouped("--frequency-penalty", type=FiniteFloatRange(-2, 2))
@grouped("--repetition-penalty", type=FiniteFloatRange(min=0, min_open=True), help="1 = off.")
@grouped("--min-tokens", type=click.IntRange(min=0), help="Generate at least this many tokens before a stop.")
@grouped("--logit-bias", "logit_bias", type=KeyValue(), multiple=True, metavar="TOKEN_ID=BIAS",
            help="Add BIAS (-100..100) to a token's logit (repeatable).")
@section("Speculation and engine")
@grouped("-m", "--model", help="Target model dir (HF layout), a llama.cpp FILE.gguf (converted once into the "
                                   "cache), or `embedded`.")
@grouped("--draft", help="Draft model dir, `embedded`, or `none`.")
@grouped("--engine", metavar="auto|reference|sglang",
            help="Generation backend. auto: SGLang when installed and a GPU is present, else the reference engine.")
@grouped("--engine-arg", "engine_arg", type=KeyValue(), multiple=True,
         help="A setting of the engine (repeatable): the keys, their engines and defaults are in the table at the "
              "end of this help, e.g. --engine-arg proposers=suffix --engine-arg dtype=float32.")
@grouped("--max-in-flight", type=click.IntRange(min=1), help="Most requests open in the engine at once.")
@section("Output")
@grouped("-o", "--output", "output_dir", type=click.Path(file_okay=False),
            help="Output directory (Parquet parts).  [default: ./<first input's name>-out, e.g. prompts-out]")
@grouped("--keep-columns", multiple=True, help="Input columns to copy to the output (comma-separated, repeatable).")
@grouped("--save-token-ids", is_flag=True, help="Also store output_token_ids.")
@grouped("--reasoning-parser", type=click.Choice(["qwen3", "deepseek-r1"]),
            help="Move the reasoning (<think>...</think>) out of `output` into `reasoning_content`.")
@grouped("--tool-call-parser", type=click.Choice(["hermes", "qwen3_coder"]),
            help="Move tool calls out of `output` into `tool_calls` (OpenAI's shape); finish_reason tool_calls.")
@grouped("--commit-rows", type=click.IntRange(min=1),
            help="Commit a part after this many rows (default 1,000; 10,000 on an object store)...")
@grouped("--commit-seconds", type=FiniteFloatRange(min=0, min_open=True), help="...or after this many seconds.")
@section("Run control")
@grouped("--resume/--no-resume", help="Continue a run found in OUTDIR.")
@grouped("--overwrite", is_flag=True, help="Delete the run found in OUTDIR and start over.")
@grouped("--retry-errors", is_flag=True,
            help="Generate again the rows whose status is error (same command plus this flag): they are taken out of "
                 "the committed parts first, so readers see each row once. The input may have its failed lines "
                 "fixed (every other line unchanged). E.g. dspine-batch generate batch.jsonl -o out/ --retry-errors.")
@grouped("--retry-length", is_flag=True,
            help="--retry-errors, and also the rows cut at --max-new-tokens (finish_reason length); "
                 "--max-new-tokens may be raised for them. E.g. --retry-length --max-new-tokens 4096.")
@grouped("--shard", metavar="I/N", help="Process shard I of N (by row-id hash).  [default: from SLURM_ARRAY_TASK_*]")
@grouped("--on-error", type=click.Choice(["skip", "fail"]),
            help="Bad rows: write a status=error row, or stop the job.")
@grouped("--max-error-rate", type=FiniteFloatRange(min=0, max=1), help="Exit 3 when errors exceed this.")
@grouped("--on-damaged-part", type=click.Choice(["repair", "fail"]),
            help="A committed part that is missing, truncated, unreadable or fails its checksum on resume: move it "
                 "aside to OUTDIR/_dspine/damaged/ and generate its rows again, or stop (exit 1) and leave it.")
@grouped("--stall-seconds", type=FiniteFloatRange(min=0),
            help="Watchdog: when the engine produces nothing for this long while requests are in flight (a hung "
                 "engine), say what was in flight, commit the finished rows and exit 75 so a requeue resumes "
                 "(0 = off). E.g. --stall-seconds 600.")
@grouped("--request-timeout", type=FiniteFloatRange(min=0),
            help="A request in the engine longer than this many seconds ends its row as an error row instead of "
                 "holding the job (0 = off; retry such rows with --retry-errors). E.g. --request-timeout 900.")
@grouped("--grace-seconds", type=FiniteFloatRange(min=0),
            help="After SIGTERM/SIGINT/SIGUSR1: time for in-flight work before committing and exiting 75.")
@grouped("--progress", type=click.Choice(["auto", "bar", "log", "none"]),
            help="auto: a bar on a terminal, log lines otherwise.")
@grouped("--log-interval", type=FiniteFloatRange(min=0), help="Seconds between progress log lines.")
@section("Watching and cost")
@grouped("--metrics-push", metavar="URL",
         help="Push the job's Prometheus metrics to this Pushgateway every --metrics-interval seconds and at the end "
              "(grouped by --job-name and shard); a push that fails is one warning, never the job's end. E.g. "
              "--metrics-push http://pushgateway:9091.")
@grouped("--metrics-textfile", metavar="FILE",
         help="Write the same metrics to FILE (written whole) for node_exporter's textfile collector, e.g. "
              "textfile/nightly.prom in its --collector.textfile.directory.")
@grouped("--metrics-interval", type=FiniteFloatRange(min=0, min_open=True), help="Seconds between pushes/writes.")
@grouped("--job-name", help="The metrics' job label.  [default: OUTDIR's name]")
@grouped("--price-per-hour", type=FiniteFloatRange(min=0),
         help="A machine-hour's price (one shard = one machine): the log's last line, report, status and the "
              "metrics then say the cost and the cost per million generated tokens. E.g. --price-per-hour 2.49.")
@click.pass_context
def generate(ctx: click.Context, inputs: tuple[str, ...], output_dir: str | None,
             engine_arg: tuple[tuple[str, str], ...], keep_columns: tuple[str, ...], stop: tuple[str, ...],
             logit_bias: tuple[tuple[str, str], ...], choice: tuple[str, ...], **kw: Any) -> int:
    """Generate completions for every row of INPUT (JSONL[.gz|.zst], Parquet file/dir/glob, a save_to_disk
    dataset dir, a local HF dataset with --split, or OpenAI batch JSONL) into Parquet parts in OUTDIR.

    Without -o the output goes to ./<first input's name>-out (printed at start); the same command again
    resumes there. Every option is also an environment variable, DSPINE_BATCH_<OPTION> (--max-new-tokens:
    DSPINE_BATCH_MAX_NEW_TOKENS), and a key of a --config job file (max-new-tokens = 512); a flag wins over the
    variable, the variable over the job file. The options most jobs need come first in each section."""
    from dspine_batch.run.runner import run_job

    cfg = generate_config(ctx, inputs, output_dir, engine_arg, keep_columns, stop, logit_bias, choice, **kw)
    return run_job(cfg, ctx.meta.get("stages"))


def generate_config(ctx: click.Context, inputs: tuple[str, ...], output_dir: str | None,
                    engine_arg: tuple[tuple[str, str], ...], keep_columns: tuple[str, ...], stop: tuple[str, ...],
                    logit_bias: tuple[tuple[str, str], ...], choice: tuple[str, ...], **kw: Any) -> GenerateConfig:
    """generate's options as its settings (``estimate`` takes the same)."""
    from dspine_batch.run.preflight import default_output

    inputs = inputs or tuple(_as_list(ctx.meta.get("config_inputs")))
    if not inputs:
        raise click.UsageError("no INPUT given (pass files, or `inputs` in --config)")
    keep = [c.strip() for k in keep_columns for c in k.split(",") if c.strip()]
    return GenerateConfig(inputs=list(inputs), output=output_dir or default_output(list(inputs)),
                          engine_args=dict(engine_arg), keep_columns=keep, stop=list(stop),
                          logit_bias=dict(logit_bias), choice=list(choice), **kw)


ESTIMATE_EXAMPLES = """
\b
Examples:
  dspine-batch estimate prompts.parquet --max-new-tokens 512           # this machine, 1 shard
  dspine-batch estimate big.jsonl --shards 8 --price-per-hour 2.49 --json
  dspine-batch estimate --config jobs/nightly-synth.toml --sample-rows 200
"""


@cli.command(epilog=ESTIMATE_EXAMPLES, context_settings={"show_default": True})
@click.option("--sample-rows", type=click.IntRange(min=1),
              help="Rows to run (spread over the input).  [default: 1% of the input, at least 64]")
@click.option("--shards", type=click.IntRange(min=1), default=1, help="Also the figures for this many shards.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def estimate(ctx: click.Context, sample_rows: int | None, shards: int, as_json: bool, **kw: Any) -> None:
    """What a generate job will take — generated tokens, time, machine-hours and cost (--price-per-hour), with 95%
    intervals, on this machine and for --shards shards — from a small sample of its own rows run for real with
    the job's settings into a scratch folder (removed after; OUTDIR is never touched). Takes INPUT... and every
    generate option. docs/monitoring.md."""
    from dspine_batch.run.estimate import estimate_job, format_estimate

    cfg = generate_config(ctx, **kw)
    result = estimate_job(cfg, ctx.meta.get("stages"), sample_rows, shards)
    click.echo(json.dumps(result, indent=2) if as_json else format_estimate(result))


estimate.params += [p for p in generate.params if p.name not in {q.name for q in estimate.params}]  # generate's


PREPARE_EXAMPLES = """
\b
Examples:
  dspine-batch prepare                                   # the default job's engine, model and batch shape
  dspine-batch prepare --config jobs/cpu-smoke.toml      # what that job file's generate will run
  DSPINE_CACHE_DIR=/shared/dspine-cache dspine-batch prepare   # a cluster's shared cache, before an array
"""


@cli.command(epilog=PREPARE_EXAMPLES)
@click.option("--config", "job_file", type=click.Path(dir_okay=False, exists=True),
              help="A generate job file (TOML): its engine, model, draft, engine args and in-flight window.")
@env_option("--engine", metavar="auto|reference|sglang", help="As for generate.")
@env_option("-m", "--model", help="As for generate.")
@env_option("--draft", help="As for generate.")
@env_option("--engine-arg", "engine_arg", type=KeyValue(), multiple=True, help="As for generate (repeatable).")
@env_option("--max-in-flight", type=click.IntRange(min=1), help="As for generate: the batch shape to calibrate.")
@click.pass_context
def prepare(ctx: click.Context, job_file: str | None, engine: str, model: str, draft: str,
            engine_arg: tuple[tuple[str, str], ...], max_in_flight: int) -> None:
    """Fill this machine's caches before a job needs them: build the CPU kernels, convert the embedded model,
    load it and calibrate the cost model for the job's settings, saying what each step did and how long it took.

    Idempotent (a second run takes seconds). The caches live under $DSPINE_CACHE_DIR (default
    ~/.cache/dspine); on a cluster point it at a shared folder and run this once before the array job
    (docs/slurm.md)."""
    from click.core import ParameterSource

    from dspine_batch.ops.prepare import prepare as run_prepare

    given = {"engine": engine, "model": model, "draft": draft, "engine_args": dict(engine_arg),
             "max_in_flight": max_in_flight}
    if job_file:  # the job file's values where no flag or environment variable set one
        job = load_toml(job_file)
        if isinstance(job.get("engine_args"), dict):
            job["engine_args"] = {k: str(v) for k, v in job["engine_args"].items()}
        for key in given:
            param = "engine_arg" if key == "engine_args" else key
            if key in job and ctx.get_parameter_source(param) in (ParameterSource.DEFAULT, None):
                given[key] = job[key]
    run_prepare(given["engine"], given["model"], given["draft"], given["engine_args"], int(given["max_in_flight"]),
                lambda line: click.echo(line))


@cli.command()
@click.argument("model", default="embedded", metavar="[MODEL]")
@click.option("--draft", default="embedded", show_default=True, help="The draft to pair with MODEL, as for generate.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(model: str, draft: str, as_json: bool) -> None:
    """What a job on MODEL would run: the model (default: the embedded SmolLM2-135M-Instruct; an HF model
    directory; a FILE.gguf, converted once), its family and shape, what runs on our CPU kernels, the features on,
    and the draft paired with it.

    \b
    Examples:
      dspine-batch info                        # the embedded default and its shipped draft
      dspine-batch info path/to/Qwen3-0.6B     # a model you bring (README, "Models you bring" lists the families)
      dspine-batch info model.Q8_0.gguf --json
    """
    from dspine_batch.engines.info import format_info, model_info

    d = model_info(model, draft)
    click.echo(json.dumps(d, indent=2, default=str) if as_json else format_info(d))


@cli.command()
@click.argument("outdir", type=OutdirOrUrl())
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--verify", is_flag=True,
              help="Also compare every part's bytes with its commit record's checksum (reads all output).")
def status(outdir: str, as_json: bool, verify: bool) -> None:
    """Done / failed / remaining rows, fingerprint and last commit time of OUTDIR (works while running).

    Parts that are missing, truncated or unreadable (and with --verify, altered) are listed, one line each;
    status moves nothing: the next generate or finalize moves them aside and regenerates their rows. What a crash
    left (a half-done publish, retry or compaction) is settled first, in shards no live worker holds.

    \b
    Example:
      dspine-batch status out/
    """
    from dspine_batch.ops.status import format_status, read_status
    from dspine_batch.outdir.manifest import stage_names
    from dspine_batch.outdir.recovery import recover_for_reading

    recover_for_reading(outdir)  # what a crash left is settled first (shards no live worker holds)
    stages = stage_names(outdir)  # a job of several stages: each stage's status, in order
    for path in [os.path.join(outdir, name) for name in stages] if stages else [outdir]:
        st = read_status(path, verify=verify)
        click.echo(json.dumps(st, indent=2, default=str) if as_json else format_status(st))


@cli.command()
@click.argument("outdir", type=OutdirOrUrl())
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the JSON summary instead of text.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: acceptance histogram and tau by position.")
def report(outdir: str, as_json: bool, plot: str | None) -> None:
    """Summary of committed results: rows, tokens, tok/s, mean/median tau, accept rate, finish reasons, errors.

    Also writes OUTDIR/_report.json.

    \b
    Examples:
      dspine-batch report out/
      dspine-batch report out/ --plot accept.png
      dspine-batch report out/qa            # a job of several stages: its funnel, then the final stage
    """
    from dspine_batch.ops.funnel import format_funnel, funnel, plot_funnel
    from dspine_batch.ops.report import format_report, plot_report, summarize, write_report
    from dspine_batch.outdir.recovery import recover_for_reading

    recover_for_reading(outdir)  # what a crash left is settled first (shards no live worker holds)
    stages = funnel(outdir)
    if stages is not None:  # a job of several stages: its funnel, then the last stage's report
        if not as_json:
            click.echo(format_funnel(stages))
        if plot:
            plot_funnel(stages, plot, os.path.basename(os.path.abspath(outdir)))
            click.echo(f"stage funnel written to {plot}", err=True)
            plot = None
        outdir = os.path.join(outdir, stages[-1]["stage"])
        if not as_json:
            click.echo(f"\nthe final stage ({stages[-1]['stage']}); `dspine-batch report {outdir}` for any stage:")
    summary = summarize(outdir)
    write_report(outdir, summary)
    if as_json:  # one JSON document: a staged job's is its funnel and its final stage's summary
        click.echo(json.dumps(summary if stages is None else {"stages": stages, "final": summary}, indent=2))
    else:
        click.echo(format_report(summary))
    if plot:
        plot_report(summary, plot)
        click.echo(f"plot written to {plot}", err=True)


@cli.command()
@click.argument("outdir", type=OutdirOrUrl())
@storage_option
@click.option("--format", "fmt", type=click.Choice(["openai"]), default="openai", show_default=True,
              help="openai: the OpenAI Batch API output shape (one line per input row, samples as choices).")
@click.option("-o", "--output", "output", required=True, metavar="FILE", help="Results file, or - for stdout.")
def export(outdir: str, fmt: str, output: str) -> None:
    """Write the committed rows of OUTDIR as an OpenAI batch results file (JSONL): `custom_id` is the row id,
    `response.body` a chat.completion (content, reasoning_content, tool_calls, logprobs, finish_reason,
    usage), `error` for rows that failed. Streams: memory does not grow with the number of rows.

    \b
    Example:
      dspine-batch export out/ --format openai -o results.jsonl
    """
    from dspine_batch.ops.export import export_openai
    from dspine_batch.outdir.recovery import recover_for_reading

    recover_for_reading(outdir)  # what a crash left is settled first (shards no live worker holds)
    stats = export_openai(outdir, output)
    click.echo(f"dspine-batch: {stats.lines:,} lines ({stats.ok:,} ok, {stats.errors:,} errors) -> {output}",
               err=True)


@cli.command()
@click.argument("outdir", type=OutdirOrUrl())
@storage_option
@click.option("--compact", is_flag=True, help="Merge small parts into larger ones first.")
@click.option("--target-rows", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Rows per compacted part.")
@click.option("--on-damaged-part", type=click.Choice(["repair", "fail"]), default="repair", show_default=True,
              envvar=ENV + "ON_DAMAGED_PART", show_envvar=True,
              help="A part that is missing, truncated, unreadable or fails its checksum: move it aside (its rows "
                   "are then reported missing: run generate again), or stop (exit 1) and leave it.")
@env_option("--metrics-push", metavar="URL", help="As for generate: on success, push the job's "
            "dspine_batch_last_success_timestamp_seconds (shard \"finalize\") to this Pushgateway.")
@env_option("--metrics-textfile", metavar="FILE", help="As for generate: the same, to a textfile.")
@env_option("--job-name", help="As for generate.  [default: OUTDIR's name]")
def finalize(outdir: str, compact: bool, target_rows: int, on_damaged_part: str, metrics_push: str | None,
             metrics_textfile: str | None, job_name: str | None) -> int:
    """Check that every input row x sample is in OUTDIR exactly once, then write _SUCCESS.

    Run it after all shards finished. Every part is first checked against its commit record (size, crc32,
    rows). Exit 1 (and no _SUCCESS) when rows are missing or duplicated.

    \b
    Example:
      dspine-batch finalize out/ --compact
    """
    from dspine_batch.ops.finalize import finalize as run_finalize
    from dspine_batch.outdir.manifest import stage_names

    stages = stage_names(outdir)
    if stages:  # a job of several stages: each audited in order
        from dspine_batch.stages.finalize import finalize_stages

        rc = finalize_stages(outdir, stages, compact, target_rows, on_damaged_part)
    else:
        rc = run_finalize(outdir, compact, target_rows, on_damaged_part)
    if rc == 0:
        from dspine_batch.log import log
        from dspine_batch.run.metrics import finalized

        finalized(outdir, metrics_push, metrics_textfile, job_name, log)
    return rc


SLURM_EXAMPLES = """
\b
Examples:
  dspine-batch slurm jobs/nightly-synth.toml -o /data/synth/2026-11-29            # write the scripts only
  dspine-batch slurm jobs/nightly-synth.toml -o /data/synth/$(date +%F) --submit  # array + finalize (afterok)
  dspine-batch slurm jobs/nightly-synth.toml -o OUT --submit --array 3,5          # resubmit shards 3 and 5
  dspine-batch slurm jobs/x.toml -o OUT --set shards=16 --set partition=gpu -- --seed 7   # extra generate flags
"""


@cli.command(epilog=SLURM_EXAMPLES, context_settings={"ignore_unknown_options": True})
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("generate_args", nargs=-1, type=click.UNPROCESSED)
@click.option("-o", "--output", "output_dir", help="OUTDIR (default: the job file's `output`).")
@click.option("--template", help="cpu-reference, gpu-sglang, or a path (default: [slurm] template).")
@click.option("--shards", type=click.IntRange(min=1), help="Number of shards = array tasks (default: [slurm] shards).")
@click.option("--array", "array", metavar="SPEC", help="Only these array indices (resubmitting failed shards).")
@click.option("--set", "sets", type=KeyValue(), multiple=True, help="Override a [slurm] key (repeatable).")
@click.option("--submit/--no-submit", default=False, show_default=True, help="sbatch the scripts.")
@click.option("--finalize/--no-finalize", default=True, show_default=True,
              help="With --submit: also submit the finalize job (--dependency=afterok:<array job>).")
@click.option("--json", "as_json", is_flag=True, help="Print what was rendered/submitted as JSON.")
def slurm(job_file: str, generate_args: tuple[str, ...], output_dir: str | None, template: str | None,
          shards: int | None, array: str | None, sets: tuple[tuple[str, str], ...], submit: bool, finalize: bool,
          as_json: bool) -> None:
    """Render the Slurm array job (one shard per task) and the finalize job of JOB_FILE, a generate --config
    TOML with a [slurm] table (see jobs/nightly-synth.toml and docs/slurm.md); optionally submit both.

    Arguments after `--` are passed to every `dspine-batch generate` of the array."""
    from dspine_batch.ops.slurm import render
    from dspine_batch.ops.slurm import submit as do_submit

    overrides: dict[str, Any] = {"template": template, "shards": shards}
    overrides |= {key.replace("-", "_"): value for key, value in sets}
    args = [a for a in generate_args if a != "--"]
    r = render(job_file, output_dir, overrides, array, args)
    info: dict[str, Any] = {"array_script": str(r.array_script), "finalize_script": str(r.finalize_script),
                            "prepare_script": str(r.prepare_script) if r.prepare_script else None,
                            "outdir": r.outdir, "log_dir": r.log_dir, "shards": r.shards, "array": r.array}
    if submit:
        info = do_submit(r, finalize=finalize)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"array script:    {r.array_script}\nfinalize script: {r.finalize_script}")
    if r.prepare_script:
        click.echo(f"prepare script:  {r.prepare_script}")
    if submit:
        if info.get("prepare_job_id"):
            click.echo(f"submitted prepare job {info['prepare_job_id']} (the array starts after it)")
        click.echo(f"submitted array job {info['array_job_id']} ({r.array}, {r.shards} shards) -> {r.outdir}")
        if info.get("finalize_job_id"):
            click.echo(f"submitted finalize job {info['finalize_job_id']} (afterok:{info['array_job_id']})")
        click.echo(f"logs: {r.log_dir}   progress: dspine-batch status {r.outdir}")
    elif r.prepare_script:
        click.echo(f"submit with:\n  pid=$(sbatch --parsable {r.prepare_script})\n"
                   f"  jid=$(sbatch --parsable --dependency=afterok:$pid --kill-on-invalid-dep=yes {r.array_script})\n"
                   f"  sbatch --dependency=afterok:$jid --kill-on-invalid-dep=yes {r.finalize_script}")
    else:
        click.echo(f"submit with:\n  jid=$(sbatch --parsable {r.array_script})\n"
                   f"  sbatch --dependency=afterok:$jid --kill-on-invalid-dep=yes {r.finalize_script}")


def _as_list(v: Any) -> list[str]:
    if v is None:
        return []
    return [v] if isinstance(v, str) else list(v)


def _redact(text: str) -> str:
    from dspine_batch.storage.urls import redact

    return redact(text)


# Why ``gc.freeze`` at exit: the interpreter's shutdown runs full collections over everything alive, and with
# torch and xgrammar imported that alone took 0.3-0.5 s after a job's last line (2-core AMD EPYC; ``import torch``
# then exit: 0.36 s of teardown, 0.10 s frozen) — a few per cent of a small job's wall time. Frozen objects are
# still torn down with their modules; only cycles go uncollected, as a process that is exiting loses nothing by.


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every failure ends in one line on stderr and a documented exit code (tracebacks only
    with DSPINE_BATCH_DEBUG=1): usage 2, bugs and fatal errors 1, interrupted 75."""
    debug = bool(os.environ.get("DSPINE_BATCH_DEBUG"))
    if argv is None:  # the console script: this process ends when the command does
        atexit.register(gc.freeze)  # before the interpreter's own teardown (why: the comment above ``main``)
    try:
        rv = cli.main(args=argv, prog_name="dspine-batch", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE if e.exit_code == 2 else e.exit_code)
    except click.Abort:
        sys.exit(EXIT_INTERRUPTED)
    except BatchError as e:
        if debug:
            raise
        print(f"dspine-batch: error: {_redact(str(e))}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("dspine-batch: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except OSError as e:
        if debug:
            raise
        if e.errno in DISK_FULL_ERRNOS:  # a write no caller named: still one line, with the path when known
            where = f"{e.filename}: " if e.filename else ""
            print(f"dspine-batch: error: {where}{e.strerror}; free space (or raise the quota) and run the same "
                  "command again to resume", file=sys.stderr)
        else:
            print(f"dspine-batch: error: {_redact(str(e))}", file=sys.stderr)
        sys.exit(EXIT_FATAL)
    except Exception as e:  # a bug, or a setting the code did not foresee: running again would not help
        if debug:
            raise
        print(f"dspine-batch: error: {type(e).__name__}: {_redact(str(e))[:300]} (finished rows are committed; "
              "DSPINE_BATCH_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(EXIT_FATAL)
    sys.exit(rv if isinstance(rv, int) else 0)
