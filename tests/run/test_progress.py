"""Totals and time left (issue 40, item 4): the progress shows done / total, the percentage and the time left for
Parquet (footer metadata), JSON Lines (estimated from the bytes read of the file's size, marked ~) and a
save_to_disk dataset (its length); ``status`` gives the rows left of a job whose inputs it can count."""

from __future__ import annotations

import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prompts, run_cli, write_jsonl

from dspine_batch.ops.status import format_status, read_status
from dspine_batch.run.progress import Progress, format_seconds
from dspine_batch.run.sink import SinkStats

LINE = re.compile(r"dspine-batch: (\d+)/(~?)(\d+) \((\d+\.\d)%, (\S+) left\) rows done")


def _inputs(tmp_path, kind: str):
    rows = prompts(30)
    if kind == "jsonl":
        return write_jsonl(tmp_path / "in.jsonl", rows)
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=7)
        return tmp_path / "in.parquet"
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    return tmp_path / "ds"


@pytest.mark.parametrize("kind, approx", [("parquet", ""), ("jsonl", "~"), ("dataset", "")])
def test_log_lines_show_total_percentage_and_time_left(tmp_path, capfd, kind, approx):
    src = _inputs(tmp_path, kind)
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), "--log-interval", "0", "--commit-rows", "5",
                    "--max-in-flight", "2", "--engine-arg", "latency=0.001"], env={"DSPINE_BATCH_PROGRESS": "log"}) == 0
    found = [m.groups() for m in map(LINE.search, capfd.readouterr().err.splitlines()) if m]
    assert len(found) >= 2 and all(total == "30" and mark == approx for _, mark, total, _, _ in found)
    done, _, _, pct, left = found[-1]
    assert (done, pct) == ("30", "100.0")
    assert any(left != "-" for *_, left in found[:-1])  # while rows were left, a time


def test_the_bar_gets_the_estimated_total_of_a_json_lines_read():
    stream = io.StringIO()
    bar = Progress("bar", None, 0, stream=stream, taken=lambda: SinkStats(rows=5), read=lambda: 10,
                   share=lambda: 0.25)
    bar.tick()
    bar.close()
    assert "5/40" in stream.getvalue() and "%" in stream.getvalue()


def test_format_seconds():
    assert [format_seconds(x) for x in (4.4, 425, 11520)] == ["4s", "7m05s", "3h12m"]


def test_status_counts_the_rows_left_of_a_dead_json_lines_job(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "5", "--max-in-flight", "1",
                    "--engine-arg", "crash_after=12"]) == 75
    st = read_status(str(out))
    assert st["input_rows"] == 40 and st["rows_remaining"] == 40 - st["rows_done"] - st["rows_failed"] > 0
    assert f"remaining {st['rows_remaining']:,} of 40 input rows" in format_status(st)
    json.dumps(st, default=str)
