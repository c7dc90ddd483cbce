"""Ids and names a staged job makes from the user's text (issue 50, the review's suspected items): row ids that
contain '#' or '/' never make two rows of a stage share an id (the '#<sample>' and '/<item>' marks of derived ids
stay unambiguous), and stage names read back from ``_stages.json`` are checked before any reader joins them to
OUTDIR."""

from __future__ import annotations

import json

from helpers import read_output, run_cli, write_jsonl


def _job(tmp_path, src, explode: bool) -> str:
    job = tmp_path / "job.toml"
    second = 'explode = "qs"\ntemplate = "Answer: {{ qs }}"' if explode else 'template = "Again: {{ output }}"'
    job.write_text(f'inputs = ["{src}"]\noutput = "{tmp_path / "out"}"\nid-column = "doc_id"\nmax-new-tokens = 8\n'
                   'max-error-rate = 1\n'
                   '[[stages]]\nname = "first"\ntemplate = "About {{ text }} {{ qs | default(\'\') }}"\n'
                   f'[[stages]]\nname = "second"\n{second}\n')
    return str(job)


def _ids(out, stage) -> list[tuple[str, int]]:
    return sorted((r["row_id"], r["sample_index"]) for r in read_output(out / stage))


def test_a_row_id_ending_in_a_sample_mark_does_not_take_another_rows_sample(tmp_path):
    """Row 'a' asks for two samples (its own n): its second sample's child is 'a#1'. A row whose id *is* 'a#1'
    must get another child id, or one of the two lineages is lost — and finalize called the stage complete."""
    src = write_jsonl(tmp_path / "docs.jsonl", [{"doc_id": "a", "text": "x", "n": 2}, {"doc_id": "a#1", "text": "y"},
                                                 {"doc_id": "b", "text": "z"}, {"doc_id": "b#x", "text": "w"}])
    out = tmp_path / "out"
    assert run_cli(["generate", "--config", _job(tmp_path, src, False)]) == 0
    assert _ids(out, "first") == [("a", 0), ("a", 1), ("a#1", 0), ("b", 0), ("b#x", 0)]
    second = {r["row_id"]: json.loads(r["lineage"]) for r in read_output(out / "second")}
    assert sorted(second) == ["a", "a#1", "a#1#0", "b", "b#x"]  # one child per parent row and sample
    assert run_cli(["finalize", str(out)]) == 0


def test_a_failed_explode_of_a_row_id_ending_in_an_item_mark_keeps_its_own_id(tmp_path):
    """Rows 'b' and 'b/0': 'b' explodes into 'b/0' and 'b/1'; 'b/0' has no list, which is one error row — that
    error row must not take item 0's id. Ids with '/' that explode are sound as they were ('c/0' -> 'c/0/0')."""
    src = write_jsonl(tmp_path / "docs.jsonl", [{"doc_id": "b", "text": "w", "qs": ["q1", "q2"]},
                                                 {"doc_id": "b/0", "text": "z"},
                                                 {"doc_id": "c", "text": "v", "qs": ["q3"]},
                                                 {"doc_id": "c/0", "text": "u", "qs": ["q4"]}])
    out = tmp_path / "out"
    assert run_cli(["generate", "--config", _job(tmp_path, src, True)]) == 0
    rows = {r["row_id"]: r for r in read_output(out / "second")}
    assert sorted(rows) == ["b/0", "b/0/-", "b/1", "c/0", "c/0/0"]
    assert rows["b/0/-"]["status"] == "error" and "qs" in rows["b/0/-"]["error"]
    assert [rows[k]["status"] for k in ("b/0", "b/1", "c/0", "c/0/0")] == ["ok"] * 4
    assert run_cli(["finalize", str(out)]) == 0


def test_stage_names_read_back_are_checked_before_any_reader_uses_them(tmp_path, capsys):
    """``_stages.json`` edited to name '../victim' (another output beside OUTDIR): finalize, status and report
    refuse in one line naming the file, and nothing is written into the other output."""
    src = write_jsonl(tmp_path / "docs.jsonl", [{"doc_id": "a", "text": "x"}])
    victim = tmp_path / "victim"
    assert run_cli(["generate", str(src), "-o", str(victim), "--prompt-template", "{{ text }}"]) == 0
    (victim / "_SUCCESS").unlink()
    out = tmp_path / "out"
    assert run_cli(["generate", "--config", _job(tmp_path, src, False)]) == 0
    (out / "_stages.json").write_text(json.dumps({"stages": ["first", "../victim"], "final": "../victim"}))
    capsys.readouterr()
    for command in (["finalize", str(out)], ["status", str(out)], ["report", str(out)]):
        assert run_cli(command) == 2, command
        err = capsys.readouterr().err
        assert err.strip() == f"dspine-batch: error: {out}/_stages.json: '../victim' is not a stage name (letters, " \
            "digits, '_', '-', '.'; it names a folder of OUTDIR)", err
    assert not (victim / "_SUCCESS").exists()
