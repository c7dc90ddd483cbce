"""``dspine-batch prepare``: fills the per-machine caches a job's first start would fill, idempotently, so the job
that follows measures nothing (the reference engine on the tiny pair, in a temporary cache)."""

from __future__ import annotations

from helpers import prompts, run_cli, write_jsonl

from dspine.decoding import cost


def test_prepare_is_idempotent_and_the_job_after_it_calibrates_nothing(tiny, tmp_path, monkeypatch, capsys):
    from dspine_batch.engines.reference import ReferenceEngine

    model, draft = tiny
    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cost, "_busy", lambda: False)  # kept whatever else runs on this machine

    def tiny_engine(_model, _draft, args):
        return ReferenceEngine.load(str(model), str(draft), args)

    assert run_cli(["prepare"], loader=tiny_engine) == 0
    out = capsys.readouterr().out
    assert "  cost model   calibrated for 8 rows, cached in" in out and "ready in" in out
    (entry,) = (tmp_path / "cache" / "cost").glob("*.json")
    stamp = entry.stat().st_mtime_ns
    assert run_cli(["prepare"], loader=tiny_engine) == 0
    assert "  cost model   already calibrated for 8 rows" in capsys.readouterr().out
    assert entry.stat().st_mtime_ns == stamp

    job = tmp_path / "job.toml"  # a job file's settings: another batch shape is another calibration
    job.write_text('inputs = ["x.jsonl"]\ntemperature = 0.5\n[engine_args]\nbatch_size = 4\n')
    assert run_cli(["prepare", "--config", str(job)], loader=tiny_engine) == 0
    assert "  cost model   calibrated for 4 rows, cached in" in capsys.readouterr().out

    def measured(*a, **k):
        raise AssertionError("the job calibrated although prepare had")

    monkeypatch.setattr(cost, "calibrate", measured)
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "out"), "--max-new-tokens", "6"],
                   loader=tiny_engine) == 0
    assert entry.stat().st_mtime_ns == stamp
