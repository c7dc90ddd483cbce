"""Builds SGLang-0.5.23-shaped ``meta_info`` dicts by running SGLang's own ``TokenizerManager.
_calculate_spec_decoding_metrics`` on scheduler-side counters (used by tests/sglang_plugin/test_sglang_plugin.py to
check that
tests/data/sglang_0_5_23_meta_info.json is what 0.5.23 produces; needs sglang installed).

Each case is a request as the scheduler accounts it: the first token comes from the prefill, then every verify
round commits accepted + 1 tokens (the last round may be cut by a stop token or max_new_tokens).
"""

from __future__ import annotations

from types import SimpleNamespace

CASES = [  # name, B (speculative_num_draft_tokens), accepted drafts per round, completion tokens, finish_reason
    ("greedy_b16_length", 16, [15, 3, 0, 7, 15], 40, {"type": "length", "length": 40}),
    ("stop_mid_round_b16", 16, [2, 5, 9], 16, {"type": "stop", "matched": 151645}),
    ("b4_all_rejected", 4, [0, 0, 0, 0], 5, {"type": "length", "length": 5}),
    ("prefill_only", 16, [], 1, {"type": "stop", "matched": 2}),
    ("aborted", 16, [1, 1], 5, {"type": "abort", "message": "Abort in waiting queue", "status_code": 500}),
]


def record(case) -> dict:
    import sglang.srt.managers.tokenizer_manager as tm

    name, B, accepted, completion, finish = case
    hist = [0] * B
    for a in accepted:
        hist[a] += 1
    recv = SimpleNamespace(
        spec_verify_ct=[len(accepted)], spec_num_correct_drafts=[sum(accepted)], completion_tokens=[completion],
        spec_correct_drafts_histogram=[hist if accepted else []], spec_num_cap_tokens=None,
        spec_num_block_accept_tokens=None, spec_cap_lens_histogram=None)
    meta = {"id": name, "finish_reason": finish, "prompt_tokens": 12, "weight_version": "default",
            "completion_tokens": completion, "cached_tokens": 0, "reasoning_tokens": 0, "num_retractions": 0,
            "e2e_latency": 0.25}
    original = tm.get_spec
    tm.get_spec = lambda: SimpleNamespace(speculative_num_draft_tokens=B)
    try:
        tm.TokenizerManager._calculate_spec_decoding_metrics(SimpleNamespace(), meta, recv, 0)
    finally:
        tm.get_spec = original
    return meta


def record_all() -> dict:
    return {c[0]: {"block_size": c[1], "accepted_per_round": c[2], "meta_info": record(c)} for c in CASES}


if __name__ == "__main__":
    import json
    import sys

    json.dump(record_all(), sys.stdout, indent=1, sort_keys=True)
    print()
