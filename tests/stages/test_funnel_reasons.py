"""Why a staged job's rows were not kept, as the funnel counts them and each row says it: a judge whose structured
output was cut by length before its JSON closed is "cut by length", not "no field"; the reasons add up to the rows
not kept; and every stage's report says why a proposal source did not run (the engine's reasons, one engine for every
stage), where a stage once said "no reason recorded"."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import read_output, run_cli, staged_job
from helpers import stage_docs as _docs

from dspine_batch.engines.explain import SourceTally
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.ops.funnel import DROPS, drop_reason, funnel


@dataclass
class ExplainingEngine(ScriptedEngine):
    """The scripted engine with an ``explain()``: suffix matches never run, for a reason; once closed it tells another
    (the reference engine, closed, drops its draft: what it says then is not its run's)."""

    tally: SourceTally = field(default_factory=SourceTally)
    closed: bool = False

    def close(self):
        self.closed = True
        super().close()

    def run(self, requests, max_in_flight):
        for res in super().run(requests, max_in_flight):
            yield self.tally.add(res)

    def explain(self):
        why = "closed" if self.closed else "is off in this test"
        return self.tally.explain(lambda src, ran: None if ran else f"{src} {why}")


def test_a_judge_cut_by_length_is_reported_as_such_and_the_reasons_add_up(tmp_path, capsys):
    src, out = _docs(tmp_path, 6), tmp_path / "out"
    job = staged_job(tmp_path, src, out, where="score >= 1", judge="max-new-tokens = 8")  # every judge answer cut
    assert run_cli(["generate", "--config", job],
                   loader=lambda m, d, a: ExplainingEngine.from_args(a)) == 0
    judge = read_output(out / "judge")
    assert judge and all(r["finish_reason"] == "length" and not r["kept"] for r in judge)
    for r in judge:  # '{"score": 1, "reas' never held a whole score: cut, and said so
        assert r["dropped_by"].startswith("where score >= 1: cut by length"), r["dropped_by"]
        assert "no field" not in r["dropped_by"]
    stages = {s["stage"]: s for s in funnel(str(out))}
    assert stages["judge"]["dropped"]["cut by length"] == len(judge)
    for name, s in stages.items():
        assert set(s["dropped"]) == set(DROPS)
        assert sum(s["dropped"].values()) == s["rows"] - s["kept"], name
        assert s["filtered"] == s["dropped"]["where false"] + s["dropped"]["no field"] + s["dropped"]["cut by length"]

    capsys.readouterr()
    assert run_cli(["report", str(out)]) == 0
    text = capsys.readouterr().out
    head = text.splitlines()[1].split()
    row = next(line.split() for line in text.splitlines() if line.startswith("judge "))
    assert row[head.index("cut-length")] == str(len(judge)) and row[head.index("kept")] == "0"

    for name in ("questions", "answers", "judge"):  # each stage's own report: every source's line says why
        capsys.readouterr()
        assert run_cli(["report", str(out / name)]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines()
                 if line.startswith(("  dspine draft", "  suffix ", "  forced "))]
        assert lines and not any("no reason recorded" in line for line in lines), (name, lines)
        assert any(line.startswith("  suffix       not run — suffix is off in this test") for line in lines)


def test_drop_reasons():
    where = "score >= 4"
    assert drop_reason(None, "ok", "stop", where) is None
    assert drop_reason("error", "error", "error", where) == "error"
    assert drop_reason("dedup exact on score", "ok", "stop", where) == "duplicate"
    assert drop_reason("select: rank 2 of 4", "ok", "stop", where) == "not selected"
    assert drop_reason("where score >= 4", "ok", "stop", where) == "where false"
    assert drop_reason("where score >= 4: no field 'score'", "ok", "stop", where) == "no field"
    assert drop_reason("where score >= 4: TypeError: '>=' not supported", "ok", "stop", where) == "no field"
    # written before rows said "cut by length": a missing field in an output that reached its token limit
    assert drop_reason("where score >= 4: no field 'score'", "ok", "length", where) == "cut by length"
    assert drop_reason("where score >= 4", "ok", "length", where) == "where false"  # read whole, and false
