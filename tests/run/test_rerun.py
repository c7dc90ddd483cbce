"""No-op reruns (``run.rerun``): a finished shard's rerun ends before any engine loads, with the exit code a
full run would give; rows left over, a changed setting or a damaged part still go the normal way."""

from __future__ import annotations

import json
import os

from helpers import prompts, read_output, run_cli, scripted_engine, write_jsonl

from dspine_batch.outdir.output import list_parts, open_output


class Opens:
    """An engine loader that counts how often the job opened an engine."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, model: str, draft: str, args: dict[str, str]):
        self.count += 1
        return scripted_engine(model, draft, args)


def _job(tmp_path, rows: list[dict] | None = None):
    src = write_jsonl(tmp_path / "in.jsonl", rows if rows is not None else prompts(30))
    return ["generate", str(src), "-o", str(tmp_path / "out"), "--commit-rows", "7", "--num-samples", "2"]


def test_a_finished_run_again_never_opens_the_engine(tmp_path, capfd):
    args, opens = _job(tmp_path), Opens()
    assert run_cli(args, loader=opens) == 0 and opens.count == 1
    out = tmp_path / "out"
    before = read_output(out)
    (out / "_SUCCESS").unlink()  # e.g. lost with a copy: a rerun puts it back
    capfd.readouterr()
    assert run_cli(args, loader=opens) == 0
    err = capfd.readouterr().err
    assert opens.count == 1, err
    assert "nothing left to do: all 30 input rows are committed" in err and "loading the model" not in err
    assert (out / "_SUCCESS").exists() and read_output(out) == before
    state = open_output(str(out)).read_state("00000-of-00001")
    assert state["state"] == "done" and state["starts"] == 2 and state["rows_done"] == 30


def test_rows_left_open_the_engine_once(tmp_path, capfd):
    args, opens = _job(tmp_path), Opens()
    assert run_cli(args, loader=opens) == 0
    out = tmp_path / "out"
    before = read_output(out)
    os.unlink(list_parts(str(out))[1].path)  # a part lost after its commit: its rows are generated again
    capfd.readouterr()
    assert run_cli(args, loader=opens) == 0 and opens.count == 2
    err = capfd.readouterr().err
    assert "nothing left to do" not in err and err.count("is missing") == 1  # the parts were checked once
    assert read_output(out) == before


def test_a_changed_setting_is_still_refused(tmp_path, capfd):
    args, opens = _job(tmp_path), Opens()
    assert run_cli(args, loader=opens) == 0
    capfd.readouterr()
    assert run_cli([*args, "--max-new-tokens", "9"], loader=opens) == 2
    err = capfd.readouterr().err
    assert "max_new_tokens: 256 -> 9" in err and "the model was not loaded" in err and opens.count == 1  # before
    assert run_cli([*args, "--engine-arg", "block_size=4"], loader=opens) == 2  # the engine as asked: changed
    assert opens.count == 2  # only a loaded engine tells its identity


def test_shards_and_the_error_budget(tmp_path, capfd):
    rows = prompts(20) + [{"id": "bad", "prompt": ""}]
    args, opens = _job(tmp_path, rows), Opens()
    codes = [run_cli([*args, "--shard", f"{i}/2", "--max-error-rate", "0"], loader=opens) for i in (0, 1)]
    assert sorted(codes) == [0, 3] and opens.count == 2  # the shard with the bad row is over the budget
    capfd.readouterr()
    again = [run_cli([*args, "--shard", f"{i}/2", "--max-error-rate", "0"], loader=opens) for i in (0, 1)]
    err = capfd.readouterr().err
    assert again == codes and opens.count == 2, err
    assert "of shard 0/2 are committed" in err and "of shard 1/2 are committed" in err
    total = sum(json.loads((tmp_path / "out" / "_dspine" / f"state-0000{i}-of-00002.json").read_text())["rows_done"]
                for i in (0, 1))
    assert total == 21
