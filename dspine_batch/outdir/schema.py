"""The output contract: every column typed up front, so parts never drift and error rows never null-type.

A column that is null in a whole part (e.g. speculative stats without a draft) still has its declared type;
readers that concatenate parts (pyarrow.dataset, pandas, datasets, polars) then always agree on the schema.
"""

from __future__ import annotations

import pyarrow as pa

from dspine_batch.errors import UsageError

SCHEMA_VERSION = 6  # 2: speculative stats by source (dspine / suffix); 3: cached_prompt_tokens (prefix cache hits);
# 4: the whole answer (reasoning_content, tool_calls, logprobs), grammar-forced proposal stats, the row's structure;
# 5: the input's id column under its own name beside row_id (``mapping.Columns``);
# 6: each logprobs token's own bytes (a token holding part of a character has no text of its own)

TOKEN_LOGPROB = pa.struct([pa.field("token_id", pa.int32()), pa.field("token", pa.string()),
                           pa.field("bytes", pa.binary()), pa.field("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(pa.struct([*TOKEN_LOGPROB, pa.field("top_logprobs", pa.list_(TOKEN_LOGPROB))]))

BASE_FIELDS = [
    pa.field("row_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("output", pa.string()),  # the answer: without the reasoning block and parsed tool calls
    pa.field("reasoning_content", pa.string()),  # with --reasoning-parser: the thinking (null: none)
    pa.field("tool_calls", pa.string()),  # JSON list in OpenAI's shape [{id, type, function: {name, arguments}}]
    pa.field("finish_reason", pa.string(), nullable=False),  # stop / length / tool_calls / abort / error
    pa.field("status", pa.string(), nullable=False),  # ok / error
    pa.field("error", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    # of prompt_tokens, those served from a prefix cache instead of computed; null where the engine does not say
    pa.field("cached_prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("verify_steps", pa.int32()),  # null without a draft
    pa.field("draft_tokens_proposed", pa.int32()),
    pa.field("draft_tokens_accepted", pa.int32()),
    pa.field("accept_length", pa.float32()),  # completion_tokens / verify_steps (bonus token included)
    pa.field("accept_histogram", pa.list_(pa.int32())),  # index j = verify steps that accepted j drafts
    # the verify steps and drafted tokens above, by who proposed them: the DSpine draft or a suffix match
    pa.field("dspine_verify_steps", pa.int32()),
    pa.field("dspine_tokens_proposed", pa.int32()),
    pa.field("dspine_tokens_accepted", pa.int32()),
    pa.field("suffix_verify_steps", pa.int32()),
    pa.field("suffix_tokens_proposed", pa.int32()),
    pa.field("suffix_tokens_accepted", pa.int32()),
    pa.field("forced_verify_steps", pa.int32()),  # proposals of grammar-forced tokens (structured outputs)
    pa.field("forced_tokens_proposed", pa.int32()),
    pa.field("forced_tokens_accepted", pa.int32()),
    # the row's structure (engines.base.Structure): kind json_schema / json_object / regex / choice / grammar
    # and its canonical text, so a report can check outputs against it (null: free text)
    pa.field("structure_kind", pa.string()),
    pa.field("structure", pa.string()),
    pa.field("logprobs", LOGPROBS_TYPE),  # one entry per completion token, with --logprobs / a row's logprobs
    pa.field("latency_s", pa.float32()),
    pa.field("attempt", pa.int32()),  # SLURM_RESTART_COUNT (0 outside Slurm): which requeue produced the row
]
BASE_NAMES = [f.name for f in BASE_FIELDS]
SOURCE_STATS = [n for n in BASE_NAMES if n.startswith(("dspine_", "suffix_", "forced_"))]
TOKEN_IDS_FIELD = pa.field("output_token_ids", pa.list_(pa.int32()))


def output_schema(keep: list[pa.Field], save_token_ids: bool) -> pa.Schema:
    clash = [f.name for f in keep if f.name in BASE_NAMES or f.name == TOKEN_IDS_FIELD.name]
    if clash:
        raise UsageError(f"--keep-columns {clash[0]!r}: clashes with an output column of the same name")
    fields = BASE_FIELDS + list(keep) + ([TOKEN_IDS_FIELD] if save_token_ids else [])
    return pa.schema(fields)
