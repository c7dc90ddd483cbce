"""Resume by watermarks (``outdir.watermark``): the same rows as the full done-set, none twice, none lost — under
kill -9, rows finishing out of order, several inputs (a Parquet of many row groups, plain and gzipped JSON Lines),
a damaged part below the watermark, records without spans, two shards; a changed input is still refused."""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import kill9_resumes, read_output, run_cli

from dspine_batch.outdir.layout import record_rel
from dspine_batch.outdir.output import list_parts
from dspine_batch.outdir.watermark import Mark, merge, record_spans, spans_fields, watermarks

ARGS = ["--raw", "--num-samples", "2", "--temperature", "0.8", "--seed", "7", "--max-error-rate", "1"]
WATERMARKED = "below the inputs' watermarks, not read again"


def _text(i: int) -> str:  # long and short prompts mixed (the scripted engine's latency also jitters by row)
    return f"Explain {i} " + ("in great detail, step by step, " * (i % 7 == 0) * 20) + "briefly."


def _inputs(tmp: Path) -> list[str]:
    """No id column (positional ids): a Parquet of 16 row groups, a JSON Lines file with blank lines and a broken
    line, and a gzipped one."""
    pq.write_table(pa.table({"prompt": [_text(i) for i in range(480)]}), tmp / "a.parquet", row_group_size=30)
    with open(tmp / "b.jsonl", "wb") as f:
        for i in range(150):
            f.write(json.dumps({"prompt": _text(1000 + i)}).encode() + b"\n")
            if i % 37 == 5:
                f.write(b"\n" if i % 2 else b"{broken\n")
    with gzip.open(tmp / "c.jsonl.gz", "wb") as f:
        for i in range(150):
            f.write(json.dumps({"prompt": _text(2000 + i)}).encode() + b"\n")
    return [str(tmp / "a.parquet"), str(tmp / "b.jsonl"), str(tmp / "c.jsonl.gz")]


def _exactly_once(out: Path, ref: Path) -> None:
    got = read_output(out)
    keys = [(r["row_id"], r["sample_index"]) for r in got]
    assert len(keys) == len(set(keys))
    assert got == read_output(ref)


def _records(out: Path) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(out / "_dspine" / "keys" / "commit-*")))]


def _drop_last_parts(out: Path, n: int) -> None:
    """As if the last ``n`` parts were never committed (their part, record and the _SUCCESS marker gone)."""
    if not n:
        return
    for name in sorted(os.path.basename(p.path) for p in list_parts(str(out)))[-n:]:
        os.unlink(out / name)
        os.unlink(out / record_rel(name))
    (out / "_SUCCESS").unlink(missing_ok=True)


def test_spans_unite_into_watermarks_past_holes_and_out_of_order_parts():
    parts = {"p0": {"f": [(0, 4, 40), (6, 9, 90)]}, "p1": {"f": [(4, 6, 60), (12, 14, 140)], "g": [(0, 3, -1)]},
             "p2": {"f": [(9, 11, 110)]}}
    marks, below = watermarks(parts)
    assert marks == {"f": Mark(11, 110), "g": Mark(3, -1)}  # 11..12 is a hole: 12..14 stays above
    assert below == {"p0", "p2"}  # p1 holds rows above the watermark: its keys are still loaded
    assert merge([(5, 7, 70), (0, 2, 20), (2, 5, 50)]) == [(0, 7, 70)]
    assert watermarks({"p": {"f": [(1, 5, -1)]}}) == ({}, set())  # nothing from the top: no watermark
    rec = spans_fields({"f": [(3, 5, -1), (0, 3, -1)]})
    assert record_spans(rec) == {"f": [(0, 5, -1)]}
    rec["spans"]["f"][0][1] = 9  # a flipped bit in a record's spans: not trusted
    assert record_spans(rec) is None


def test_kill9_resume_by_watermarks_matches_an_uninterrupted_run(tmp_path):
    """Rows finishing out of order at high concurrency across three inputs, killed -9 at random moments: the final
    output is the uninterrupted run's, exactly once, and the resumes did skip parts by their watermarks."""
    srcs = _inputs(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["generate", *srcs, *ARGS, "--max-in-flight", "48", "--commit-rows", "9", "--commit-seconds", "0.05",
            "--engine-arg", "latency=0.2"]
    assert run_cli([*args, "-o", str(ref)]) == 0
    kills, _, logs = kill9_resumes([*args, "-o", str(out)], out, random.Random(5656), 15, 0.8, 0.8)
    assert kills >= 3
    _exactly_once(out, ref)
    assert any(WATERMARKED in log and f" 0 of them {WATERMARKED}" not in log for log in logs), logs
    # out of order: some part holds rows that are not one run of its file
    assert any(len(v) > 1 for rec in _records(out) for v in (rec.get("spans") or {}).values())
    assert run_cli(["finalize", str(out)]) == 0


def _committed(tmp_path: Path, drop: int = 6, extra: list[str] | None = None) -> tuple[list[str], Path, Path, list]:
    srcs = _inputs(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["generate", *srcs, *ARGS, "--max-in-flight", "32", "--commit-rows", "20", *(extra or [])]
    assert run_cli([*args, "-o", str(ref)]) == 0
    assert run_cli([*args, "-o", str(out)]) == 0
    assert all(record_spans(rec) for rec in _records(out))  # every part says where its rows sit
    _drop_last_parts(out, drop)
    return srcs, ref, out, args


def test_a_damaged_part_below_the_watermark_is_demoted_and_its_rows_generated_again(tmp_path, capsys):
    srcs, ref, out, args = _committed(tmp_path)
    victim = sorted(p.path for p in list_parts(str(out)))[1]  # wholly below the watermark
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 10)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "truncated" in err and WATERMARKED in err
    _exactly_once(out, ref)


def test_records_without_spans_resume_by_the_full_done_set(tmp_path, capsys):
    """An OUTDIR written before watermarks (records without spans) resumes as before, exactly once."""
    srcs, ref, out, args = _committed(tmp_path)
    for path in glob.glob(str(out / "_dspine" / "keys" / "commit-*")):
        rec = json.loads(Path(path).read_text())
        assert rec.pop("spans") and rec.pop("spans_crc32") is not None
        Path(path).write_text(json.dumps(rec))
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and WATERMARKED not in err
    _exactly_once(out, ref)


def test_watermarks_off_and_on_resume_the_same(tmp_path, capsys, monkeypatch):
    srcs, ref, out, args = _committed(tmp_path)
    monkeypatch.setenv("DSPINE_BATCH_WATERMARKS", "0")
    capsys.readouterr()
    assert run_cli([*args, "-o", str(tmp_path / "out")]) == 0
    assert WATERMARKED not in capsys.readouterr().err
    _exactly_once(out, ref)


def test_a_changed_input_below_the_watermark_is_still_refused(tmp_path, capsys):
    srcs, ref, out, args = _committed(tmp_path)
    t = pq.read_table(srcs[0])
    rows = t.column("prompt").to_pylist()
    rows[3] = "changed"  # a row the resume would never read again
    pq.write_table(pa.table({"prompt": rows}), srcs[0], row_group_size=30)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 2
    assert "a.parquet changed" in capsys.readouterr().err


def test_a_finished_job_rerun_counts_every_row_without_reading_the_committed_ones(tmp_path, capsys):
    srcs, ref, out, args = _committed(tmp_path, drop=0)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "nothing left to do: all 782 input rows are committed" in err, err  # 782: the rows below counted too
    _exactly_once(out, ref)


def test_two_shards_resume_by_their_own_watermarks(tmp_path, capsys):
    srcs = _inputs(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["generate", *srcs, *ARGS, "--max-in-flight", "32", "--commit-rows", "15"]
    assert run_cli([*args, "-o", str(ref)]) == 0
    for i in range(2):
        assert run_cli([*args, "-o", str(out), "--shard", f"{i}/2"]) == 0
    for tag in ("00000-of-00002", "00001-of-00002"):
        for name in sorted(os.path.basename(p.path) for p in list_parts(str(out)) if tag in p.path)[-4:]:
            os.unlink(out / name)
            os.unlink(out / record_rel(name))
    capsys.readouterr()
    for i in range(2):
        assert run_cli([*args, "-o", str(out), "--shard", f"{i}/2"]) == 0
    assert capsys.readouterr().err.count(WATERMARKED) == 2
    _exactly_once(out, ref)


def test_a_state_trailing_the_parts_reads_only_the_parts_after_it(tmp_path, monkeypatch, capsys):
    """Killed between commits and the state's save: the carried tallies come from the state plus the parts after
    its ``next_seq``, not from reading every committed part again, and they still add up to the job's."""
    from dspine_batch.run import state as state_mod
    from dspine_batch.run.sink import committed_tallies

    srcs, ref, out, args = _committed(tmp_path, drop=4)
    parts = sorted(p.path for p in list_parts(str(out)))
    at = len(parts) - 2  # the state was last saved after part ``at - 1``
    path = out / "_dspine" / "state-00000-of-00001.json"
    st = json.loads(path.read_text())
    before = committed_tallies(parts[:at])
    st.update(rows_done=before.rows, error_rows=before.error_rows, totals=before.totals(), next_seq=at)
    path.write_text(json.dumps(st))
    asked: list[list[str]] = []

    def spy(paths):
        asked.append(sorted(paths))
        return committed_tallies(paths)

    monkeypatch.setattr(state_mod, "committed_tallies", spy)
    assert run_cli([*args, "-o", str(out)]) == 0
    assert asked == [parts[at:]]
    _exactly_once(out, ref)
    final = json.loads(path.read_text())["totals"]
    want = json.loads((ref / "_dspine" / "state-00000-of-00001.json").read_text())["totals"]
    assert {k: final[k] for k in ("rows", "outputs", "completion_tokens")} == \
        {k: want[k] for k in ("rows", "outputs", "completion_tokens")}


def test_retry_errors_over_watermarked_parts_generates_each_failed_row_once(tmp_path, capsys):
    """--retry-errors rewrites the parts that held failed rows (their new records carry no spans: holes), so the
    retried rows are generated again, once, and the rest stay as they were."""
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt": _text(i)}).encode() for i in range(40)]
    broken = {5: b"{broken", 30: b'{"prompt": oops'}
    src.write_bytes(b"".join(broken.get(i, x) + b"\n" for i, x in enumerate(lines)))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), *ARGS, "--commit-rows", "4"]
    assert run_cli(args) == 0
    assert all(record_spans(rec) for rec in _records(out))
    before = read_output(out)
    failed = {"in.jsonl:5", "in.jsonl:30"}
    assert {r["row_id"] for r in before if r["status"] == "error"} == failed
    src.write_bytes(b"".join(x + b"\n" for x in lines))  # the user fixes the two lines
    assert run_cli([*args, "--retry-errors"]) == 0
    after = read_output(out)
    keys = [(r["row_id"], r["sample_index"]) for r in after]
    assert len(keys) == len(set(keys)) == 80 and all(r["status"] == "ok" for r in after)
    assert [r for r in after if r["row_id"] not in failed] == [r for r in before if r["row_id"] not in failed]
    capsys.readouterr()
    assert run_cli(args) == 0
    assert "nothing left to do: all 40 input rows are committed" in capsys.readouterr().err


def test_a_resume_holds_no_key_list_and_reads_only_those_above_the_watermarks(tmp_path, monkeypatch):
    """Records are held without their key lists (~11 bytes a row: ~1 GB at 100M rows); the done-set reads the lists
    of the parts above the watermarks only, and a list whose record changed since the check is not trusted."""
    from dspine_batch.outdir.core import Outdir
    from dspine_batch.outdir.done import load_done

    srcs, ref, out, args = _committed(tmp_path)
    records = _records(out)
    # a hole in the spans of one early part: it and every part after it stay above the watermark of its file
    hole = records[3]
    rec_path = out / record_rel(hole["part"])
    hole.pop("spans"), hole.pop("spans_crc32")
    rec_path.write_text(json.dumps(hole))
    asked: list[str] = []
    real = Outdir.keys_of

    def spy(self, names):
        asked.extend(names)
        return real(self, names)

    monkeypatch.setattr(Outdir, "keys_of", spy)
    od = Outdir(str(out))
    done = load_done(od, "00000-of-00001", id_column=False)
    assert all("keys_b64" not in rec for rec in od.records("00000-of-00001").values())
    assert done.below_parts >= 3 and hole["part"] in asked
    assert len(asked) == len(records) - done.below_parts  # every part above, none below
    assert len(done.keys) == sum(r["rows"] for r in records if r["part"] in asked)
    # a record swapped after the check (another token): its list is not taken from the new one
    swapped = dict(json.loads(rec_path.read_text()), token="someone-else")
    rec_path.write_text(json.dumps(swapped))
    assert od.keys_of([hole["part"]]) == {hole["part"]: None}
    assert Outdir(str(out)).keys_of([hole["part"]])[hole["part"]] is not None  # a start that checked it anew


def _rot(path: str) -> None:
    """Bit rot that still decodes: one digit of the footer's commit time, same size, same rows."""
    data = bytearray(Path(path).read_bytes())
    at = data.rindex(b'"committed_at": ') + len(b'"committed_at": ')
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("budget", [None, "0"])
def test_a_start_checks_every_crc32_within_its_budget_past_it_those_above_the_watermarks(tmp_path, capsys,
                                                                                       monkeypatch, budget):
    """Within the budget (a small shard) every part's crc32 is checked at start; past it only the parts the resume
    reads from (above the watermarks), their sizes all, and finalize finds the rot below."""
    srcs, ref, out, args = _committed(tmp_path)
    records = _records(out)
    hole = records[3]  # its spans gone: it and the parts after it are above the watermark
    hole.pop("spans"), hole.pop("spans_crc32")
    (out / record_rel(hole["part"])).write_text(json.dumps(hole))
    below, above = str(out / records[1]["part"]), str(out / hole["part"])
    _rot(below)
    _rot(above)
    if budget is not None:
        monkeypatch.setenv("DSPINE_BATCH_START_CRC_BYTES", budget)
    capsys.readouterr()
    assert run_cli([*args, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{above}: committed part is altered (crc32" in err
    assert (f"{below}: committed part is altered (crc32" in err) == (budget is None)
    assert ("their crc32 left to finalize" in err) == (budget is not None)
    if budget is not None:
        assert run_cli(["finalize", str(out)]) == 1
        assert f"{below}: committed part is altered (crc32" in capsys.readouterr().err
        assert run_cli([*args, "-o", str(out)]) == 0
    _exactly_once(out, ref)
