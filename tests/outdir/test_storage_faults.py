"""Storage faults under OUTDIR lose nothing (issue 24): a committed part that is missing, truncated, unreadable or
altered is reported in one line, moved aside and regenerated (or, with --on-damaged-part fail, the job refuses);
a full disk (ENOSPC/EDQUOT) in a commit, the manifest, the lock or the state file ends in one line naming the
path, exit 1, nothing half-committed, and the same command resumes exactly once after space is freed.

Faults are injected by patching the write path (``os.fsync``, ``os.pwrite``, ``os.replace``, ``os.link``,
``records.ChecksumWriter.write``) to raise ``OSError(ENOSPC)``, and, where the machine allows ``mount``, by a real
1 MiB tmpfs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from helpers import prompts, read_output, run_cli, spawn, write_jsonl

from dspine_batch import errors
from dspine_batch.errors import DiskFull, FatalError
from dspine_batch.outdir import records
from dspine_batch.outdir.layout import DAMAGED as DAMAGED_DIR
from dspine_batch.outdir.layout import KEYS as KEYS_DIR
from dspine_batch.outdir.layout import STAGING, record_rel
from dspine_batch.outdir.layout import STATE as STATE_DIR
from dspine_batch.outdir.output import list_parts, open_output
from dspine_batch.outdir.records import crc_of

TAG = "00000-of-00001"


def check_parts(out: str, tag: str | None = None) -> list:
    return open_output(out).check_parts(tag)


def load_done(out: str, tag: str):  # noqa: ANN201
    return open_output(out).load_done(tag)


def read_record(out: str, name: str) -> dict | None:
    return open_output(out).record_of(name)


def record_path(out: str, name: str) -> str:
    return os.path.join(out, record_rel(name))


def file_checksum(path: str) -> int:
    with open(path, "rb") as f:
        return crc_of(f)


def write_part_atomically(out: str, name: str, table: pa.Table, keys: np.ndarray) -> dict:
    return open_output(out).commit_part(name, table, keys)
N = 40
GEN = ["--num-samples", "2", "--temperature", "0.8", "--seed", "3", "--commit-rows", "10"]


def _job(tmp_path: Path, n: int = N) -> tuple[list[str], Path]:
    """A finished 4-part output and the args that (re)run it; plus an uninterrupted reference run in ``ref``."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    args = ["generate", str(src), *GEN]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    out = tmp_path / "out"
    assert run_cli([*args, "-o", str(out)]) == 0
    return args, out


def _assert_same_as_reference(tmp_path: Path, out: Path) -> None:
    got = read_output(out)
    keys = [(r["row_id"], r["sample_index"]) for r in got]
    assert len(keys) == len(set(keys)) == 2 * N
    assert got == read_output(tmp_path / "ref")


def _flip_footer_digit(path: str) -> None:
    """Bit rot that still decodes: one digit of the footer's commit time changes, same size, same rows."""
    data = bytearray(Path(path).read_bytes())
    at = data.rindex(b'"committed_at": ') + len(b'"committed_at": ')
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    Path(path).write_bytes(bytes(data))
    pq.read_table(path)  # still readable: only the checksum can tell


def _damaged_files(out: Path) -> list[str]:
    d = out / DAMAGED_DIR
    return sorted(os.listdir(d)) if d.exists() else []


# -- the commit record -----------------------------------------------------------------------------------------
def test_commit_record_describes_the_part_bytes(tmp_path):
    _, out = _job(tmp_path)
    for p in list_parts(str(out)):
        rec = read_record(str(out), os.path.basename(p.path))
        assert rec is not None and rec["bytes"] == os.path.getsize(p.path)
        assert rec["crc32"] == file_checksum(p.path) and rec["outputs"] == 20 and rec["rows"] == 10
    assert all(c.problem is None and c.verified for c in check_parts(str(out)))


# -- damaged or missing parts on resume ------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "altered", "garbage", "deleted"])
def test_damaged_part_is_moved_aside_and_regenerated(tmp_path, capsys, damage):
    args, out = _job(tmp_path)
    part = list_parts(str(out))[1].path
    size = os.path.getsize(part)
    if damage == "truncated":
        os.truncate(part, size // 2)
    elif damage == "altered":
        _flip_footer_digit(part)
    elif damage == "garbage":
        Path(part).write_bytes(os.urandom(size))
    else:
        os.unlink(part)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if part in ln]
    assert len(lines) == 1, err  # one line, naming the file
    want = {"truncated": f"truncated ({size // 2:,} of {size:,} bytes)", "altered": "altered (crc32",
            "garbage": "altered (crc32", "deleted": "missing"}[damage]
    assert want in lines[0] and "moved aside to" in lines[0] and "generated again" in lines[0]
    _assert_same_as_reference(tmp_path, out)
    moved = _damaged_files(out)
    assert any(n.endswith(".commit.json") for n in moved)
    if damage != "deleted":  # never deleted: the damaged bytes are kept for inspection
        (kept,) = [n for n in moved if n.endswith(".damaged")]
        assert "train" not in kept and not kept.endswith(".parquet")  # readers and datasets must not see it
    assert run_cli(["finalize", str(out)]) == 0
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0  # repaired for good: nothing reported again
    assert "committed part" not in capsys.readouterr().err


def test_each_shard_repairs_only_its_own_parts(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(N))
    args = ["generate", str(src), *GEN]
    out = tmp_path / "out"
    for i in range(2):
        assert run_cli([*args, "-o", str(tmp_path / "ref"), "--shard", f"{i}/2"]) == 0
        assert run_cli([*args, "-o", str(out), "--shard", f"{i}/2"]) == 0
    part = list_parts(str(out), "00001-of-00002")[0].path
    os.unlink(part)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out), "--shard", "0/2"]) == 0
    assert "committed part" not in capsys.readouterr().err  # not shard 0's part: left to shard 1
    assert run_cli([*args, "-o", str(out), "--shard", "1/2"]) == 0
    assert f"{part}: committed part is missing" in capsys.readouterr().err
    _assert_same_as_reference(tmp_path, out)
    assert run_cli(["finalize", str(out)]) == 0


def test_on_damaged_part_fail_refuses_and_says_how_to_continue(tmp_path, capsys):
    args, out = _job(tmp_path)
    part = list_parts(str(out))[2].path
    os.truncate(part, 100)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out), "--on-damaged-part", "fail"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dspine-batch: error: {part}: committed part is truncated (100 of ")
    assert "--on-damaged-part repair" in err[-1] and "Traceback" not in "\n".join(err)
    assert os.path.getsize(part) == 100 and not _damaged_files(out)  # left exactly where it was
    assert run_cli([*args, "-o", str(out)], env={"DSPINE_BATCH_ON_DAMAGED_PART": "fail"}) == 1  # the env var too
    assert run_cli([*args, "-o", str(out)]) == 0
    _assert_same_as_reference(tmp_path, out)


def test_parts_without_a_commit_record_are_trusted_by_row_count(tmp_path, capsys):
    """Outputs written before commit records existed still resume: readable footer + row count is enough;
    one that does not read is moved aside (it used to stop every resume with exit 1)."""
    args, out = _job(tmp_path)
    for p in list_parts(str(out)):
        os.unlink(record_path(str(out), os.path.basename(p.path)))
    done = load_done(str(out), TAG)
    assert done.rows == N and done.damaged == 0
    assert not any(c.verified for c in check_parts(str(out)))
    first = list_parts(str(out))[0].path
    _flip_footer_digit(first)  # without a record, bit rot that decodes cannot be seen: trusted, as before
    broken = list_parts(str(out))[3].path
    Path(broken).write_bytes(b"PAR1 not really")
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{broken}: committed part is unreadable (" in err and first not in err
    _assert_same_as_reference(tmp_path, out)


def test_unreadable_row_ids_of_an_old_part_are_damage_too(tmp_path, capsys):
    """No record and no key file: the done-set reads row_id; a part whose footer reads but data does not is
    moved aside, not fatal."""
    args, out = _job(tmp_path)
    part = list_parts(str(out))[1].path
    name = os.path.basename(part)
    os.unlink(record_path(str(out), name))  # (its row keys were in it)
    data = bytearray(Path(part).read_bytes())
    data[8:400] = os.urandom(392)  # the first data pages; the footer at the end still reads
    Path(part).write_bytes(bytes(data))
    pq.read_metadata(part)
    done = load_done(str(out), TAG)
    assert done.rows == N - 10 and done.damaged == 1 and not os.path.exists(part)
    assert "unreadable" in capsys.readouterr().err
    assert run_cli([*args, "-o", str(out)]) == 0
    _assert_same_as_reference(tmp_path, out)


def test_altered_row_keys_are_not_trusted(tmp_path):
    """A record's row keys are what the done-set is built from: one wrong hash would skip an unrelated row (lost) or
    redo a done one (duplicated). Their crc32 is in the record too; a mismatch falls back to reading row_id."""
    from dspine_batch.outdir.keyset import key_hashes

    args, out = _job(tmp_path)
    name = os.path.basename(list_parts(str(out))[1].path)
    rec = read_record(str(out), name)
    keys = records.record_keys(rec)
    bogus = keys.copy()
    bogus[0] = key_hashes(["r99999"])[0]  # a row that is not done, in place of one that is
    rec["keys_b64"] = records.keys_fields(bogus)["keys_b64"]
    Path(record_path(str(out), name)).write_text(json.dumps(rec))
    done = load_done(str(out), TAG)
    assert done.rows == N and done.damaged == 0
    assert done.keys.contains_many(key_hashes([r["id"] for r in prompts(N)])).all()
    assert not done.keys.contains_many(key_hashes(["r99999"])).any()
    assert run_cli([*args, "-o", str(out)]) == 0
    _assert_same_as_reference(tmp_path, out)


def test_crash_mid_commit_is_not_mistaken_for_a_lost_part(tmp_path, capsys):
    """Staged bytes + record, no part: a commit whose publish a crash interrupted; committed, so the next start
    publishes it (nothing reported, nothing regenerated)."""
    args, out = _job(tmp_path)
    last = list_parts(str(out))[-1].path
    name = os.path.basename(last)
    os.rename(last, out / read_record(str(out), name)["staged"])
    assert check_parts(str(out)) and all(c.problem is None for c in check_parts(str(out)))
    assert len(check_parts(str(out))) == 4
    assert open_output(str(out)).remove_staging(TAG) == 0
    assert os.path.exists(last) and os.path.exists(record_path(str(out), name)) and not os.listdir(out / STAGING)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    assert "committed part" not in capsys.readouterr().err and not _damaged_files(out)
    _assert_same_as_reference(tmp_path, out)


def test_finalize_moves_damaged_parts_aside_then_generate_repairs(tmp_path, capsys):
    args, out = _job(tmp_path)
    part = list_parts(str(out))[0].path
    _flip_footer_digit(part)
    capsys.readouterr()
    assert run_cli(["finalize", str(out), "--on-damaged-part", "fail"]) == 1
    assert f"{part}: committed part is altered" in capsys.readouterr().err and os.path.exists(part)
    assert run_cli(["finalize", str(out)]) == 1
    err = capsys.readouterr().err
    assert "moved aside" in err and "10 of 40 input rows are missing" in err and "run generate again" in err
    assert not (out / "_SUCCESS").exists()
    assert run_cli([*args, "-o", str(out)]) == 0
    assert run_cli(["finalize", str(out)]) == 0
    _assert_same_as_reference(tmp_path, out)


def test_status_lists_damage_without_touching_it(tmp_path, capsys):
    args, out = _job(tmp_path)
    parts = list_parts(str(out))
    os.truncate(parts[1].path, 10)
    _flip_footer_digit(parts[2].path)
    capsys.readouterr()
    assert run_cli(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"damaged: {parts[1].path}: truncated (10 of" in text and parts[2].path not in text  # cheap: no crc
    assert "done 30" in text and "not finalized" in text
    assert run_cli(["status", str(out), "--verify", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert [d["path"] for d in st["damaged_parts"]] == [parts[1].path, parts[2].path]
    assert st["rows_done"] == 20 and st["parts_verified"] == 2 and not st["complete"]
    assert os.path.getsize(parts[1].path) == 10 and not _damaged_files(out)  # status only reads


def test_compaction_writes_a_record_for_the_merged_part(tmp_path, capsys):
    args, out = _job(tmp_path)
    assert run_cli(["finalize", str(out), "--compact"]) == 0
    (part,) = list_parts(str(out))
    rec = read_record(str(out), os.path.basename(part.path))
    assert rec["rows"] == N and rec["crc32"] == file_checksum(part.path)
    name = os.path.basename(part.path)
    assert os.listdir(out / KEYS_DIR) == [os.path.basename(record_path(str(out), name))]
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    assert "committed part" not in capsys.readouterr().err
    _assert_same_as_reference(tmp_path, out)


# -- a full disk -----------------------------------------------------------------------------------------------
def _enospc(code: int = errno.ENOSPC) -> OSError:
    return OSError(code, os.strerror(code))


def _fail_fsync_for(monkeypatch, needle: str, code: int = errno.ENOSPC) -> None:
    """``os.fsync`` raises ENOSPC/EDQUOT for files whose path contains ``needle`` (what a full disk does when
    the delayed allocation of buffered writes fails)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if needle in os.readlink(f"/proc/self/fd/{fd}"):
            raise _enospc(code)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_enospc_mid_part_leaves_nothing_half_committed(tmp_path, monkeypatch):
    table = pa.table({"x": list(range(50_000))})
    real = records.ChecksumWriter.write

    def write(self, data):
        if self.size > 1000:
            raise _enospc()
        return real(self, data)

    monkeypatch.setattr(records.ChecksumWriter, "write", write)
    name = "train-00000-of-00001-000000.parquet"
    with pytest.raises(DiskFull) as e:
        write_part_atomically(str(tmp_path), name, table, np.arange(3, dtype=np.uint64))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / name}: no space left on device after writing ")
    assert "this part was not committed" in msg and "run the same command again" in msg and "\n" not in msg
    assert os.listdir(tmp_path) == [] or os.listdir(tmp_path) == ["_dspine"]
    assert not os.path.exists(tmp_path / KEYS_DIR) or os.listdir(tmp_path / KEYS_DIR) == []
    assert not os.path.exists(tmp_path / STAGING) or os.listdir(tmp_path / STAGING) == []
    monkeypatch.undo()
    write_part_atomically(str(tmp_path), name, table, np.arange(3, dtype=np.uint64))
    assert ds.dataset(str(tmp_path), format="parquet").count_rows() == 50_000


@pytest.mark.parametrize("call", ["link", "fsync_of_the_part"])
def test_edquot_on_the_record_or_the_staged_part_commits_nothing(tmp_path, monkeypatch, call):
    name = "train-00000-of-00001-000000.parquet"
    if call == "link":  # the record's create-only write
        real = os.link

        def link(a, b, *rest, **kw):
            if "commit-" in str(b):
                raise _enospc(errno.EDQUOT)
            return real(a, b, *rest, **kw)

        monkeypatch.setattr(os, "link", link)
        want = r"commit-00000-of-00001-000000\.json: disk quota exceeded after"
    else:
        _fail_fsync_for(monkeypatch, "part-00000-of-00001-000000.", errno.EDQUOT)
        want = rf"{name}: disk quota exceeded after"
    with pytest.raises(DiskFull, match=want) as e:
        write_part_atomically(str(tmp_path), name, pa.table({"x": [1, 2]}), np.arange(2, dtype=np.uint64))
    assert "this part was not committed" in str(e.value)
    assert os.listdir(tmp_path) == ["_dspine"] and not os.listdir(tmp_path / STAGING)
    assert not os.path.exists(tmp_path / KEYS_DIR) or not os.listdir(tmp_path / KEYS_DIR)


def _disk_of(monkeypatch, budget: int) -> None:
    """Every part write draws on one byte budget: a disk that fills up part way through the run."""
    real = records.ChecksumWriter.write
    left = [budget]

    def write(self, data):
        n = memoryview(data).nbytes
        if n > left[0]:
            raise _enospc()
        left[0] -= n
        return real(self, data)

    monkeypatch.setattr(records.ChecksumWriter, "write", write)


def test_cli_disk_full_mid_run_exits_1_with_one_line_then_resumes_exactly_once(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(N))
    args = ["generate", str(src), *GEN]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    out = tmp_path / "out"
    one_part = os.path.getsize(list_parts(str(tmp_path / "ref"))[0].path)
    _disk_of(monkeypatch, int(one_part * 2.5))  # room for two parts, not three
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 1  # not 75: rerunning before freeing space cannot help
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dspine-batch: error: {out}/train-00000-of-00001-000002.parquet: no space left on "
                              "device after writing ")
    assert "free space" in err[-1] and "run the same command again" in err[-1]
    assert not [ln for ln in err if "Traceback" in ln]
    assert len(list_parts(str(out))) == 2 and all(c.problem is None for c in check_parts(str(out)))
    assert not [n for n in os.listdir(out) if n.endswith(".inprogress")] and not os.listdir(out / STAGING)
    assert not (out / "_SUCCESS").exists()
    assert json.loads((out / STATE_DIR / f"state-{TAG}.json").read_text())["state"] == "failed"
    monkeypatch.undo()  # space freed
    assert run_cli([*args, "-o", str(out)]) == 0
    _assert_same_as_reference(tmp_path, out)
    assert run_cli(["finalize", str(out)]) == 0


def test_cli_disk_full_on_the_manifest(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out"
    _fail_fsync_for(monkeypatch, "_manifest.json")
    assert run_cli(["generate", str(src), "-o", str(out)]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"dspine-batch: error: {out}/_manifest.json: no space left on device after writing ")
    assert "no manifest was created" in line
    assert not [n for n in os.listdir(out) if "manifest" in n]  # no temp file left behind either
    monkeypatch.undo()
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0
    assert len(read_output(out)) == 5


def test_cli_disk_full_on_the_lock(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out"

    def pwrite(fd, data, offset):
        raise _enospc()

    monkeypatch.setattr(os, "pwrite", pwrite)
    assert run_cli(["generate", str(src), "-o", str(out)]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"dspine-batch: error: {out}/_dspine/lock-{TAG}: no space left on device")
    assert "loading the model" not in capsys.readouterr().err  # refused before the model loads
    assert not (out / STATE_DIR / f"lock-{TAG}").exists()
    monkeypatch.undo()
    assert run_cli(["generate", str(src), "-o", str(out)]) == 0


def test_cli_disk_full_on_the_state_file_after_a_commit(tmp_path, monkeypatch, capsys):
    """The state file is written after each commit: the part stays committed, the run stops with exit 1."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(N))
    args = ["generate", str(src), *GEN]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    out = tmp_path / "out"
    real, calls = os.replace, [0]

    def replace(a, b, *rest, **kw):
        if "state-" in str(b):
            calls[0] += 1
            if calls[0] > 2:  # the start, the first commit, then the disk is full
                raise _enospc()
        return real(a, b, *rest, **kw)

    monkeypatch.setattr(os, "replace", replace)
    assert run_cli([*args, "-o", str(out)]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"dspine-batch: error: {out}/_dspine/state-{TAG}.json: no space left on device")
    assert not [n for n in os.listdir(out / STATE_DIR) if n.endswith(".tmp")]
    monkeypatch.undo()
    assert run_cli([*args, "-o", str(out)]) == 0
    _assert_same_as_reference(tmp_path, out)


def test_disk_full_during_compaction_merges_nothing(tmp_path, monkeypatch, capsys):
    args, out = _job(tmp_path)
    before = sorted(os.listdir(out))
    _disk_of(monkeypatch, 1000)
    capsys.readouterr()
    assert run_cli(["finalize", str(out), "--compact"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"dspine-batch: error: {out}/train-00000-of-00001-000004.parquet: no space left")
    assert sorted(os.listdir(out)) == before
    assert not [n for n in os.listdir(out / KEYS_DIR) if "000004" in n]  # no sidecar of the merged part either
    assert len(list_parts(str(out))) == 4 and all(c.problem is None for c in check_parts(str(out)))
    monkeypatch.undo()
    assert run_cli(["finalize", str(out), "--compact"]) == 0 and len(list_parts(str(out))) == 1
    _assert_same_as_reference(tmp_path, out)


def test_low_free_space_warns_before_the_model_loads(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 100))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out")]) == 0  # a warning, not a refusal
    err = capsys.readouterr().err
    warn = [ln for ln in err.splitlines() if "100 B free" in ln]
    assert len(warn) == 1 and "may write up to" in warn[0] and str(tmp_path / "out") in warn[0]
    assert err.index("100 B free") < err.index("loading the model")


def test_cli_rejects_a_bad_on_damaged_part_value(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), "--on-damaged-part", "delete"]) == 2


def test_fatal_error_on_damage_is_not_a_bug_exit():
    assert issubclass(DiskFull, FatalError) and DiskFull.exit_code == 1


# -- a real full filesystem (root only: mounts a 1 MiB tmpfs) ------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_tmpfs_subprocess_exit_1_then_resume_after_freeing(tmp_path, small_fs):
    rows = [{"id": f"r{i:05d}", "prompt": f"Tell a story #{i}"} for i in range(120)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["generate", str(src), "--commit-rows", "20", "--max-new-tokens", "64"]
    p = spawn([*args, "-o", str(tmp_path / "ref")])
    assert p.wait(timeout=120) == 0
    out = small_fs / "out"
    filler = small_fs / "filler"
    part = os.path.getsize(list_parts(str(tmp_path / "ref"))[0].path)
    free = shutil.disk_usage(small_fs).free
    filler.write_bytes(b"\0" * max(0, free - int(2.5 * part) - 64 * 1024))  # room for about two parts
    p = spawn([*args, "-o", str(out)])
    _, err = p.communicate(timeout=120)
    lines = err.decode().strip().splitlines()
    assert p.returncode == 1, err.decode()
    assert "no space left on device after writing" in lines[-1] and str(out) in lines[-1], lines[-1]
    assert not [n for n in os.listdir(out) if n.endswith(".inprogress")]
    assert all(c.problem is None for c in check_parts(str(out)))
    filler.unlink()  # space freed: the same command resumes
    p = spawn([*args, "-o", str(out)])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()
    got = read_output(out)
    assert len(got) == len({r["row_id"] for r in got}) == 120
    assert got == read_output(tmp_path / "ref")
