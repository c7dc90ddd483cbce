"""A row's own ``max_tokens`` beyond what the model's context leaves after its prompt (issue 50: a hidden input
sent 10**400 and the row ran silently to the context, 2,016 tokens under ``--max-new-tokens 4``) is an error row
naming the field and the limit, as vLLM's and OpenAI's servers answer it; the job's ``--max-new-tokens`` stays a
cap that ends a row where its context does."""

from __future__ import annotations

from helpers import read_output, run_cli, write_jsonl


def _line(cid: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smol", "messages": [{"role": "user", "content": f"question {cid}"}], **body}}


def test_a_rows_max_tokens_beyond_the_context_is_an_error_row_naming_the_limit(tmp_path):
    src = write_jsonl(tmp_path / "batch.jsonl", [_line("huge", {"max_tokens": 10**400}),
                                                  _line("over", {"max_completion_tokens": 40}),
                                                  _line("fits", {"max_tokens": 8}),
                                                  _line("job", {})])
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--max-new-tokens", "4", "--engine-arg", "max_context=64",
                    "--max-error-rate", "0.6"]) == 0
    rows = {r["row_id"]: r for r in read_output(out)}
    assert rows["huge"]["status"] == rows["over"]["status"] == "error"
    assert rows["huge"]["error"] == ("batch.jsonl: line 1 (custom_id 'huge'), field 'body.max_tokens': "
                                     "100000000000... (401 digits) is too large: the model's context is 64 tokens "
                                     "and the prompt has 35, which leaves 29")
    assert rows["over"]["error"].endswith("field 'body.max_completion_tokens': 40 is too large: the model's context "
                                          "is 64 tokens and the prompt has 35, which leaves 29")
    assert rows["fits"]["status"] == rows["job"]["status"] == "ok"
    assert rows["fits"]["completion_tokens"] <= 8 and rows["job"]["completion_tokens"] <= 4


def test_a_column_max_tokens_names_its_column_and_the_jobs_flag_stays_a_cap(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello there", "max_tokens": 10**400},
                                               {"id": "b", "prompt": "hello there"}])
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--max-new-tokens", "1000", "--engine-arg",
                    "max_context=64", "--max-error-rate", "0.6"]) == 0
    rows = {r["row_id"]: r for r in read_output(out)}
    assert rows["a"]["status"] == "error" and "field 'max_tokens': 100000000000... (401 digits) is too large: " \
        "the model's context is 64 tokens" in rows["a"]["error"]
    assert rows["b"]["status"] == "ok"  # the job's 1000: a cap, the row ends where its context does
