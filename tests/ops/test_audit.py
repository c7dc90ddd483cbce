"""finalize's audit by hash partition (``ops/audit.py``): the bucket hash, and the same findings as the audit in
memory on an output with every kind of problem."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prompts, run_cli, write_jsonl

from dspine_batch.ops.audit import ENV_ROWS, audit_coverage, string_hashes
from dspine_batch.ops.finalize import expected_ids
from dspine_batch.outdir.output import list_parts, open_output


def test_string_hashes_depend_on_the_string_alone():
    words = ["", "a", "b", "ab", "ba", "prompts.jsonl:17", "prompts.jsonl:71", "é", "naïve 🙂", "x" * 300]
    h = string_hashes(pa.array(words))
    assert len(set(h.tolist())) == len(words)  # none of these collide
    # the same string hashes the same at any offset, in a slice, a chunked or large_string array, beside a null
    shifted = string_hashes(pa.array(["pad", "padding", *words]).slice(2))
    chunked = string_hashes(pa.chunked_array([pa.array(words[:4]), pa.array(words[4:])]))
    large = string_hashes(pa.array(words, pa.large_string()))
    assert (shifted == h).all() and (chunked == h).all() and (large == h).all()
    assert string_hashes(pa.array([None, "a"]))[0] == h[0] and len(string_hashes(pa.array([], pa.string()))) == 0
    # a bucket split of many similar ids is balanced
    ids = pa.array([f"in.jsonl:{i}" for i in range(20000)])
    counts = [int(c) for c in __import__("numpy").bincount(string_hashes(ids) % 8, minlength=8)]
    assert min(counts) > 2000 and max(counts) < 3000


def _no_examples(problems: list[str]) -> list[str]:
    return [re.sub(r"e\.g\. \S+", "e.g. X", p) for p in problems]


@pytest.mark.parametrize("rows", ["7", "1000"])
def test_the_audit_by_buckets_finds_what_the_audit_in_memory_finds(tmp_path, monkeypatch, capsys, rows):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    out = tmp_path / "out"
    for shard in ("0/3", "1/3"):  # shard 2/3 never ran: its rows are missing
        assert run_cli(["generate", str(src), "-o", str(out), "--shard", shard, "--num-samples", "2"]) == 0
    part = list_parts(str(out))[0].path
    t = pq.read_table(part)
    ids = t.column("row_id").to_pylist()
    bad = t.slice(0, 6).set_column(t.schema.get_field_index("row_id"), "row_id",
                                   pa.array([ids[0], ids[0], "ghost-1", "ghost-1", "ghost-2", ids[1]]))
    bad = bad.set_column(t.schema.get_field_index("sample_index"), "sample_index",
                         pa.array([0, 0, 0, 1, 1, 0], t.schema.field("sample_index").type))
    pq.write_table(bad, part.replace("-000000.parquet", "-000009.parquet"))
    manifest = open_output(str(out)).read_manifest()
    whole = audit_coverage(str(out), manifest, expected_ids)
    assert len(whole) == 5  # duplicates, gaps, missing, missing by shard, extra
    monkeypatch.setenv(ENV_ROWS, rows)
    capsys.readouterr()
    split = audit_coverage(str(out), manifest, expected_ids)
    assert ("buckets of" in capsys.readouterr().err) == (rows == "7")
    assert _no_examples(split) == _no_examples(whole)
    assert "rows are missing" in split[2] and "2/3:" in split[3] and "match no input row" in split[4]
