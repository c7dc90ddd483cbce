"""An OUTDIR written before the one commit protocol still resumes and finalizes, exactly once.

The layout that version wrote on a local disk is written here by hand (what CI has is the repo, not the old code):
commit records without token, staged name, error rows or row keys, written by temp + rename; the row keys in key
files ``_dspine/keys/keys-X.npy``; a part with no record at all (from before records existed: "trusted by row
count"); and what a crash left: a ``.X.inprogress`` staging file with its record and key file (never committed by
that protocol's rule: a part was committed iff it had been renamed in), and a ``finalize --compact`` journal with
its merged part still staged."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from helpers import prompts, read_output, run_cli, write_jsonl

from dspine_batch.outdir.output import list_parts
from dspine_batch.outdir.records import keys_checksum, record_keys

N = 60
ARGS = ["--num-samples", "2", "--temperature", "0.8", "--seed", "7", "--commit-rows", "10"]


def _jobs(tmp_path: Path) -> tuple[list[str], Path]:
    src = write_jsonl(tmp_path / "in.jsonl", prompts(N))
    args = ["generate", str(src), *ARGS]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    out = tmp_path / "out"
    assert run_cli([*args, "-o", str(out)]) == 0
    _to_old_layout(out)
    return args, out


def _old_record(part: Path, rows: int, keys: np.ndarray | None) -> dict:
    import zlib

    data = part.read_bytes()
    rec = {"part": part.name.removeprefix(".").removesuffix(".inprogress"), "rows": rows,
           "outputs": pq.read_metadata(part).num_rows, "bytes": len(data), "crc32": zlib.crc32(data),
           "committed_at": 1.0}
    if keys is not None:
        rec["keys_crc32"] = keys_checksum(keys)
    return rec


def _to_old_layout(out: Path) -> None:
    """Rewrite a finished output as the old version wrote it: old records, key files, nothing staged."""
    keys_dir = out / "_dspine" / "keys"
    for path in sorted(keys_dir.glob("commit-*.json")):
        rec = json.loads(path.read_text())
        keys = record_keys(rec)
        stem = path.name.removeprefix("commit-").removesuffix(".json")
        np.save(keys_dir / f"keys-{stem}.npy", keys.astype("<u8"), allow_pickle=False)
        path.write_text(json.dumps(_old_record(out / rec["part"], rec["rows"], keys), sort_keys=True))
    shutil.rmtree(out / "_dspine" / "staging", ignore_errors=True)
    (out / "_SUCCESS").unlink()


def _stem(part: Path) -> str:
    return part.name.removeprefix("train-").removesuffix(".parquet")


def test_an_old_output_with_a_crash_left_in_it_resumes_and_finalizes_exactly_once(tmp_path, capsys):
    args, out = _jobs(tmp_path)
    parts = [Path(p.path) for p in list_parts(str(out))]
    keys_dir = out / "_dspine" / "keys"
    assert len(parts) == 6 and len(list(keys_dir.glob("keys-*.npy"))) == 6
    # part 0: from before records and key files (its row ids are read)
    (keys_dir / f"commit-{_stem(parts[0])}.json").unlink()
    (keys_dir / f"keys-{_stem(parts[0])}.npy").unlink()
    # part 1: no record, its key file kept (trusted by row count, keys from the file)
    (keys_dir / f"commit-{_stem(parts[1])}.json").unlink()
    # part 4: a crash between its record and its rename (uncommitted: swept, generated again)
    os.rename(parts[4], out / f".{parts[4].name}.inprogress")
    # part 5: a crash before anything of it was written
    for p in (parts[5], keys_dir / f"commit-{_stem(parts[5])}.json", keys_dir / f"keys-{_stem(parts[5])}.npy"):
        p.unlink()
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "40 were already committed" in err and "committed part" not in err  # nothing taken for damage
    assert not [n for n in os.listdir(out) if n.endswith(".inprogress")]
    got = read_output(out)
    assert len({(r["row_id"], r["sample_index"]) for r in got}) == len(got) == 2 * N
    assert got == read_output(tmp_path / "ref")
    assert run_cli(["finalize", str(out)]) == 0 and (out / "_SUCCESS").exists()


def test_an_old_compaction_journal_is_rolled_forward(tmp_path):
    """The old ``finalize --compact`` staged the merged part as ``.X.inprogress`` with its record and key file, then
    wrote a journal without a token, then renamed: a crash after the journal is finished by the next start."""
    args, out = _jobs(tmp_path)
    parts = [Path(p.path) for p in list_parts(str(out))]
    keys_dir = out / "_dspine" / "keys"
    table = pa.concat_tables([pq.read_table(p) for p in parts[:2]])
    new = "train-00000-of-00001-000006.parquet"
    staged = out / f".{new}.inprogress"
    pq.write_table(table, staged, compression="zstd")
    keys = np.concatenate([np.load(keys_dir / f"keys-{_stem(p)}.npy") for p in parts[:2]])
    np.save(keys_dir / "keys-00000-of-00001-000006.npy", keys, allow_pickle=False)
    (keys_dir / "commit-00000-of-00001-000006.json").write_text(json.dumps(_old_record(staged, 20, keys)))
    (out / "_dspine" / "compact.json").write_text(json.dumps({"new": new, "old": [p.name for p in parts[:2]]}))
    assert run_cli(["finalize", str(out)]) == 0  # recovery first: the merged part in, the old two gone
    names = sorted(os.listdir(out))
    assert new in names and parts[0].name not in names and parts[1].name not in names
    assert not staged.exists() and not (out / "_dspine" / "compact.json").exists()
    assert not (keys_dir / f"keys-{_stem(parts[0])}.npy").exists()
    got = read_output(out)
    assert sorted((r["row_id"], r["sample_index"]) for r in got) == \
        sorted((r["row_id"], r["sample_index"]) for r in read_output(tmp_path / "ref"))
    assert run_cli([*args, "-o", str(out)]) == 0  # and it resumes with nothing to do
    assert len(read_output(out)) == 2 * N
