"""Resume details beyond the torture test: row keys in the records (fast done-set) and crash-safe compaction."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
from helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.outdir import compact
from dspine_batch.outdir.commit import Committer
from dspine_batch.outdir.layout import record_rel
from dspine_batch.outdir.output import list_parts, open_output
from dspine_batch.outdir.records import keys_fields, record_keys

TAG = "00000-of-00001"


def load_done(out: str, tag: str):  # noqa: ANN201
    return open_output(out).load_done(tag)


def _set_keys(out, part, keys: np.ndarray | None) -> None:
    """Rewrite a part's record with other row keys (None: without any, as a record that lost them)."""
    path = out / record_rel(os.path.basename(part))
    rec = json.loads(path.read_text())
    rec.pop("keys_b64", None)
    rec.pop("keys_crc32", None)
    if keys is not None:
        rec.update(keys_fields(keys))
    path.write_text(json.dumps(rec))


def _run(tmp_path, n=40, commit=10):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", str(commit)]) == 0
    return src, out


def test_done_set_from_record_keys_or_row_ids(tmp_path):
    _, out = _run(tmp_path)
    parts = list_parts(str(out), TAG)
    fast = load_done(str(out), TAG)
    _set_keys(out, parts[0].path, None)  # no keys in the record
    _set_keys(out, parts[1].path, np.zeros(3, dtype=np.uint64))  # wrong length
    slow = load_done(str(out), TAG)
    assert (fast.rows, fast.outputs, fast.next_seq) == (slow.rows, slow.outputs, slow.next_seq) == (40, 40, 4)
    from dspine_batch.outdir.keyset import key_hashes

    hashes = key_hashes([r["id"] for r in prompts(40)])
    assert fast.keys.contains_many(hashes).all() and slow.keys.contains_many(hashes).all()


def test_resume_after_losing_record_keys_is_still_exact(tmp_path):
    src, out = _run(tmp_path)
    for p in list_parts(str(out)):
        _set_keys(out, p.path, None)
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "10"]) == 0
    assert len(read_output(out)) == 40


def test_compaction_merges_parts_and_keeps_row_keys(tmp_path):
    src, out = _run(tmp_path)
    assert run_cli(["finalize", str(out), "--compact"]) == 0
    (part,) = list_parts(str(out))
    info = json.loads(pq.read_schema(part.path).metadata[b"dspine_batch.part"])
    assert info["rows"] == 40 and len(info["compacted_from"]) == 4
    assert len(record_keys(open_output(str(out)).record_of(os.path.basename(part.path)))) == 40
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "10"]) == 0  # resume: nothing to do
    assert [r["row_id"] for r in read_output(out)] == [r["id"] for r in prompts(40)]


def test_compaction_crash_is_rolled_forward(tmp_path):
    """Crash after the merged part's commit, before the old parts went: recovery drops the old ones."""
    src, out = _run(tmp_path)
    parts = [os.path.basename(p.path) for p in list_parts(str(out))]
    o = open_output(str(out))
    real_recover = compact.recover
    compact.recover = lambda outdir: None  # the crash: journal written, merged part committed, old parts still there
    try:
        compact._merge(o, Committer(o), parts[:2], o.records(TAG), "train-00000-of-00001-000004.parquet")
    finally:
        compact.recover = real_recover
    assert len(list_parts(str(out))) == 5  # a reader would see both copies until the next start
    assert os.path.exists(out / compact.JOURNAL)
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "10"]) == 0  # runs recovery first
    assert not os.path.exists(out / compact.JOURNAL)
    assert len(list_parts(str(out))) == 3
    got = read_output(out)
    assert len(got) == 40 and len({r["row_id"] for r in got}) == 40
    assert run_cli(["finalize", str(out)]) == 0


def test_no_id_column_resume_without_record_keys_and_shards(tmp_path):
    from helpers import shard_of

    rows = [{"prompt": r["prompt"]} for r in prompts(30)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    for i in range(2):
        assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "4", "--shard", f"{i}/2"]) == 0
    for p in list_parts(str(out)):
        _set_keys(out, p.path, None)
        shard = int(p.shard.split("-")[0])
        assert all(shard_of(r, 2, id_column=False) == shard for r in pq.read_table(p.path)["row_id"].to_pylist())
    for i in range(2):  # done-set rebuilt from row_id strings: nothing regenerated
        assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "4", "--shard", f"{i}/2"]) == 0
    got = read_output(out)
    assert sorted(r["row_id"] for r in got) == sorted(f"in.jsonl:{i}" for i in range(30))
    assert run_cli(["finalize", str(out)]) == 0
