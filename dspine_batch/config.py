"""The resolved settings of a ``generate`` run, and what of them defines the run's identity.

Precedence (flags > DSPINE_BATCH_* env > --config TOML > defaults) is applied by the CLI; this module only
holds the result. ``IDENTITY_FIELDS`` are the settings that change outputs: they go into the fingerprint.
Operational knobs (in-flight window, commit interval, error policy) do not, so they can change on resume.
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

from dspine_batch.engines.base import DEFAULTS
from dspine_batch.errors import UsageError


@dataclass
class GenerateConfig:
    inputs: list[str]
    output: str
    engine: str = "auto"
    model: str = "embedded"
    draft: str = "embedded"
    split: str | None = None
    prompt_column: str | None = None
    prompt_template: str | None = None  # Jinja2 over the row's columns (text, or a file), the user turn
    system_template: str | None = None  # ... and the system turn
    messages_column: str | None = None
    id_column: str | None = None
    system_prompt: str | None = None
    chat_template: bool | None = None  # None: use the model's template when it has one
    max_new_tokens: int = DEFAULTS.max_new_tokens  # generation defaults live in one place: engine.SamplingParams
    temperature: float = DEFAULTS.temperature
    top_p: float = DEFAULTS.top_p
    top_k: int = DEFAULTS.top_k
    seed: int = DEFAULTS.seed
    stop: list[str] = field(default_factory=list)
    num_samples: int = 1
    # the request fields beyond sampling (``requests``), job-wide; a row's own fields override them
    logprobs: bool = DEFAULTS.logprobs
    top_logprobs: int = DEFAULTS.top_logprobs
    presence_penalty: float = DEFAULTS.presence_penalty
    frequency_penalty: float = DEFAULTS.frequency_penalty
    repetition_penalty: float = DEFAULTS.repetition_penalty
    min_tokens: int = DEFAULTS.min_tokens
    logit_bias: dict[str, str] = field(default_factory=dict)  # token id -> bias, as given
    response_format: str | None = None  # OpenAI's response_format, as JSON text
    json_schema: str | None = None  # a JSON Schema file (or inline JSON)
    regex: str | None = None
    choice: list[str] = field(default_factory=list)
    grammar: str | None = None  # an EBNF/GBNF file
    tools: str | None = None  # a JSON file with OpenAI's tools list (or inline JSON)
    tool_choice: str = "auto"  # none / auto / required / a function name
    chat_template_kwargs: str | None = None  # JSON object passed to the chat template
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    row_params: bool = True
    keep_columns: list[str] = field(default_factory=list)
    save_token_ids: bool = False
    limit: int | None = None
    engine_args: dict[str, str] = field(default_factory=dict)
    max_in_flight: int = 64
    shard: str | None = None
    on_error: str = "skip"
    on_damaged_part: str = "repair"  # a committed part failing its check on resume: move aside + regenerate, or fail
    max_error_rate: float = 0.05
    resume: bool = True
    overwrite: bool = False
    commit_rows: int | None = None  # None: the OUTDIR's own default (``Output.commit_rows``)
    commit_seconds: float = 5.0
    grace_seconds: float = 20.0
    stall_seconds: float = 1800.0  # nothing produced this long with requests in flight: commit, exit 75 (0: off)
    request_timeout: float = 0.0  # a request in the engine longer than this ends its row as an error (0: off)
    retry_errors: bool = False  # take error rows out of the committed parts and generate them again (``retry``)
    retry_length: bool = False  # with it, also rows cut by length; --max-new-tokens may grow
    progress: str = "auto"
    log_interval: float = 10.0
    # watching and budgeting (``run.metrics``, ``ops.cost``): operational, never part of the run's identity
    metrics_push: str | None = None  # a Pushgateway URL
    metrics_textfile: str | None = None  # a .prom file for node_exporter's textfile collector
    metrics_interval: float = 15.0
    job_name: str | None = None  # the metrics' job label (default: the output's name)
    price_per_hour: float | None = None  # a machine-hour's price: the cost in the log, report, status, metrics

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default(name: str) -> Any:
    """The default of one setting (the CLI shows and uses these, so there is one copy); MISSING for
    ``inputs``/``output``, which have none."""
    f = GenerateConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


IDENTITY_FIELDS = ("split", "system_prompt", "chat_template", "max_new_tokens", "temperature", "top_p",
                   "top_k", "seed", "stop", "num_samples", "row_params", "save_token_ids", "limit",
                   "reasoning_parser", "tool_call_parser")
# The job-wide request fields (structure, tools, penalties, ...) enter the identity parsed and canonical
# (``requests.identity``): a schema file's content counts, not its path.


def load_toml_raw(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: invalid TOML ({e})") from e


def load_toml(path: str) -> dict[str, Any]:
    """Read a job file. Keys are option names with ``-`` or ``_``; a ``[generate]`` table is also accepted.
    A ``[slurm]`` table belongs to ``dspine-batch slurm`` and is ignored here."""
    data = load_toml_raw(path)
    data = data.get("generate", {k: v for k, v in data.items() if k != "slurm"})
    return {k.replace("-", "_"): v for k, v in data.items()}
