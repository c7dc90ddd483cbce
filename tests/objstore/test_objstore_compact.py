"""``finalize --compact`` on an s3:// OUTDIR (``outdir/compact``), against the real S3 server on 127.0.0.1:
small parts merged into big ones with the same rows; a crash at either side of the merged part's commit record
is completed (or dropped) by the next start, never a row lost or left doubled, and a record under the merged
part's name that another writer created is told apart by its token; the merged records keep the done-set (a rerun
has nothing left)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prompts, run_cli
from test_objstore_generate import read_s3_output

from dspine_batch.errors import FatalError
from dspine_batch.outdir import compact as remote_compact
from dspine_batch.outdir.commit import Committer
from dspine_batch.outdir.layout import part_name
from dspine_batch.outdir.output import OutDir as ObjectOutput

TAG = "00000-of-00001"
NEW = part_name(TAG, 99)


def _job(tmp_path, s3, bucket, prefix: str) -> tuple[list[str], str]:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(prompts(40)), src)
    args = ["generate", str(src), "--commit-rows", "4", "-o", f"s3://{bucket}/{prefix}"]
    assert run_cli(args) == 0
    return args, f"{bucket}/{prefix}"


def _parts(s3, prefix: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in s3.glob(f"{prefix}/*.parquet"))


def test_compact_on_s3_merges_parts_and_keeps_every_row_once(tmp_path, s3, bucket, capsys):
    args, prefix = _job(tmp_path, s3, bucket, "c1")
    before = read_s3_output(s3, prefix)
    assert len(_parts(s3, prefix)) == 10
    assert run_cli(["finalize", f"s3://{bucket}/c1", "--compact", "--target-rows", "16"]) == 0
    assert len(_parts(s3, prefix)) == 3  # 16 + 16 + 8 rows
    assert read_s3_output(s3, prefix) == before and s3.exists(f"{prefix}/_SUCCESS")
    records = [p for p in s3.ls(f"{prefix}/_dspine/keys", detail=False)]
    assert len(records) == 3 and not s3.exists(f"{prefix}/{remote_compact.JOURNAL}")
    capsys.readouterr()
    assert run_cli(args) == 0  # resumes from the merged records: nothing left to generate
    assert "0 this run" in capsys.readouterr().err and read_s3_output(s3, prefix) == before


def _interrupted(out: ObjectOutput, commit: bool) -> tuple[str, list[str]]:
    """A compaction of the first three parts stopped by a crash: after the journal (and the merged part's
    commit, with ``commit``), before the old parts were deleted."""
    records = out.records(TAG)
    old = sorted(records)[:3]
    real = remote_compact.recover
    remote_compact.recover = lambda o: None  # the crash: nothing after the commit ran
    try:
        if commit:
            remote_compact._merge(out, Committer(out), old, records, NEW)
        else:
            out.store.put(remote_compact.JOURNAL, json.dumps({"new": NEW,
                                                              "old": old}).encode())
    finally:
        remote_compact.recover = real
    return NEW, old


def test_a_compaction_interrupted_after_its_commit_is_completed_by_the_next_start(tmp_path, s3, bucket):
    args, prefix = _job(tmp_path, s3, bucket, "c2")
    before = read_s3_output(s3, prefix)
    out = ObjectOutput(f"s3://{bucket}/c2")
    new, old = _interrupted(out, commit=True)
    assert len(read_s3_output(s3, prefix)) == len(before) + 12  # the crash's window: both copies visible
    assert run_cli(args) == 0  # the next start completes it before reading a record
    assert read_s3_output(s3, prefix) == before
    names = _parts(s3, prefix)
    assert new in names and not set(old) & set(names) and not s3.exists(f"{prefix}/{remote_compact.JOURNAL}")
    assert run_cli(["finalize", f"s3://{bucket}/c2"]) == 0


def test_a_compaction_interrupted_before_its_commit_is_dropped(tmp_path, s3, bucket):
    args, prefix = _job(tmp_path, s3, bucket, "c3")
    before = read_s3_output(s3, prefix)
    out = ObjectOutput(f"s3://{bucket}/c3")
    new, old = _interrupted(out, commit=False)
    assert run_cli(["finalize", f"s3://{bucket}/c3"]) == 0  # finalize recovers too
    names = _parts(s3, prefix)
    assert new not in names and set(old) <= set(names) and not s3.exists(f"{prefix}/{remote_compact.JOURNAL}")
    assert read_s3_output(s3, prefix) == before


def test_compact_never_blesses_doubtful_keys(tmp_path, s3, bucket, capsys):
    """A record whose row keys do not check out (crc32) gives the merged record no keys, never a fresh checksum over
    them (``records.record_keys``): the resume reads the merged part's row ids and finds nothing left."""
    args, prefix = _job(tmp_path, s3, bucket, "c4")
    before = read_s3_output(s3, prefix)
    first = sorted(s3.ls(f"{prefix}/_dspine/keys", detail=False))[0]
    rec = json.loads(s3.cat_file(first))
    rec["keys_crc32"] ^= 1
    s3.pipe_file(first, json.dumps(rec).encode())
    assert run_cli(["finalize", f"s3://{bucket}/c4", "--compact", "--target-rows", "40"]) == 0
    (merged,) = s3.ls(f"{prefix}/_dspine/keys", detail=False)
    assert "keys_b64" not in json.loads(s3.cat_file(merged))
    capsys.readouterr()
    assert run_cli(args) == 0 and "0 this run" in capsys.readouterr().err
    assert read_s3_output(s3, prefix) == before


def test_a_record_under_the_journals_name_from_another_writer_is_not_the_merged_part(tmp_path, s3, bucket,
                                                                                     monkeypatch):
    """The merged part's number is taken first by another writer (a worker that paused past its lease commits its
    next part): the compaction's create-only record loses and it stops, leaving its journal. The recovery must not
    take the other's record for the merged part (the journal names its record's token): the old parts stay, every
    row with them; on the record's existence alone they were deleted, and their rows lost."""
    args, prefix = _job(tmp_path, s3, bucket, "c5")
    before = read_s3_output(s3, prefix)
    old = _parts(s3, prefix)
    out, rival = ObjectOutput(f"s3://{bucket}/c5"), ObjectOutput(f"s3://{bucket}/c5")
    real = remote_compact.commit_part
    taken: list[str] = []

    def rival_first(o, committer, name, table, *a, **kw):
        rival.commit_part(name, table.slice(0, 1), None, rows=1)  # the other writer's part of that number
        rival.flush()
        taken.append(name)
        return real(o, committer, name, table, *a, **kw)

    with monkeypatch.context() as m:  # (undo() would drop s3env's variables)
        m.setattr(remote_compact, "commit_part", rival_first)
        with pytest.raises(FatalError, match="another worker committed this part first"):
            out.compact(16)
    assert taken and s3.exists(f"{prefix}/{remote_compact.JOURNAL}")
    remote_compact.recover(ObjectOutput(f"s3://{bucket}/c5"))  # what the next start (or finalize) runs first
    assert not s3.exists(f"{prefix}/{remote_compact.JOURNAL}")
    assert _parts(s3, prefix) == sorted([*old, *taken])  # the old parts stay, and so does the other's
    assert len(s3.ls(f"{prefix}/_dspine/keys", detail=False)) == len(old) + 1
    s3.rm([f"{prefix}/{taken[0]}", f"{prefix}/_dspine/keys/commit-{taken[0][len('train-'):-len('.parquet')]}.json"])
    assert read_s3_output(s3, prefix) == before
    assert run_cli(["finalize", f"s3://{bucket}/c5"]) == 0
