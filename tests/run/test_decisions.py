"""The engine's decisions about its proposal sources (``engines.decisions``): recorded in the shard's state at
every commit, added up across a kill and a resume, said once in the log, shown by ``report``."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import prompts, run_cli, write_jsonl

from dspine_batch.engines import decisions
from dspine_batch.engines.explain import SourceTally
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.ops.report import format_report, summarize
from dspine_batch.outdir.output import open_output

TAG = "00000-of-00001"


@dataclass
class ExplainingEngine(ScriptedEngine):
    """The scripted engine with an ``explain()``: its rounds are all the draft's (stats.by_source), suffix
    matches never run, for a reason."""

    tally: SourceTally = field(default_factory=SourceTally)

    def run(self, requests, max_in_flight):
        for res in super().run(requests, max_in_flight):
            yield self.tally.add(res)

    def explain(self):
        return self.tally.explain(lambda src, ran: "told not to (test)" if src == "suffix" else None,
                                  {"dspine": {"chooser": "the test"}})


def explaining(model, draft, args):
    return ExplainingEngine.from_args(args)


def test_the_record_survives_a_kill_adds_up_on_resume_and_the_report_says_why(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--commit-rows", "5", "--max-in-flight", "4"]
    assert run_cli([*args, "--engine-arg", "crash_after=17"], loader=explaining) == 75  # a transient death
    err = capfd.readouterr().err
    assert err.count("suffix, so far: not run — told not to (test)") == 1  # once, early
    first = open_output(str(out)).read_state(TAG)["decisions"]
    assert first["suffix"] == {"rounds": 0, "proposed": 0, "accepted": 0, "ran": False, "why": "told not to (test)"}
    assert first["dspine"]["ran"] and first["dspine"]["rounds"] > 0 and first["dspine"]["chooser"] == "the test"

    assert run_cli(args, loader=explaining) == 0  # resumed: a new engine counts from zero, the record adds up
    assert capfd.readouterr().err.count("so far: not run — told not to (test)") == 1
    s = summarize(str(out))
    final = open_output(str(out)).read_state(TAG)["decisions"]
    assert final["dspine"]["rounds"] >= s["by_source"]["dspine"]["verify_steps"] > first["dspine"]["rounds"]
    text = format_report(s)
    assert "  suffix       not run — told not to (test)" in text and "  dspine draft " in text

    assert run_cli(args, loader=explaining) == 0  # a no-op rerun (no engine) keeps the record
    assert open_output(str(out)).read_state(TAG)["decisions"] == final


def test_merge_and_combine():
    a = {"dspine": {"rounds": 2, "proposed": 8, "accepted": 3, "ran": True, "why": None, "x": 1}}
    b = {"dspine": {"rounds": 1, "proposed": 4, "accepted": 1, "ran": False, "why": "slow", "x": 2},
         "suffix": {"rounds": 0, "proposed": 0, "accepted": 0, "ran": False, "why": "off"}}
    m = decisions.merge(a, b)
    assert m["dspine"] == {"rounds": 3, "proposed": 12, "accepted": 4, "ran": True, "why": "slow", "x": 2}
    assert m["suffix"]["why"] == "off"
    c = decisions.combine([b, {"suffix": {"rounds": 0, "ran": False, "why": "other"}}, b])
    assert c["suffix"]["why"] == "off / other" and c["dspine"]["rounds"] == 2


def test_a_broken_explain_never_fails_the_run_and_reasons_are_logged_once():
    class Broken:
        def explain(self):
            raise RuntimeError("bug")

    class Moving:
        n = 0

        def explain(self):
            self.n += 1
            return {"forced": {"rounds": 0, "ran": False, "why": f"tau {self.n}\nchanges"}}

    assert decisions.explain(Broken()) is None and decisions.explain(object()) is None
    said: list[str] = []
    log = decisions.DecisionLog(Moving(), None, said.append)
    for _ in range(3):
        log.note()
    assert said == ["forced, so far: not run — tau 1 changes"]
    assert log.record()["forced"]["why"] == "tau 4 changes"


def test_the_log_ends_with_the_report_s_own_source_lines(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "7"], loader=explaining) == 0
    err = capfd.readouterr().err.splitlines()
    start = err.index("dspine-batch: proposal sources (as `dspine-batch report` shows them):")
    logged = [line.removeprefix("dspine-batch:   ") for line in err[start + 1:start + 4]]
    report = format_report(summarize(str(out))).splitlines()
    shown = [line.removeprefix("  ") for line in report if line.startswith(("  dspine draft", "  suffix", "  forced"))]
    assert logged == shown and len(shown) == 3
    assert shown[0].startswith("dspine draft ") and "verify steps" in shown[0]
    assert shown[1] == "suffix       not run — told not to (test)"


def test_a_source_that_ran_is_never_said_not_to_have_run():
    hardly = {"rounds": 4, "proposed": 9, "accepted": 2, "ran": False, "why": "hardly ran (4 rounds): slow"}
    line = decisions.render(hardly)
    assert line == "4 verify steps, 2 of 9 proposed tokens accepted (0.222); tau 1.500 tokens a step"  # counts alone
    assert decisions.render({"rounds": 0, "ran": False, "why": "off"}) == "not run — off"
    assert decisions.render({"rounds": 0, "ran": False, "why": None}) == "not run (no reason recorded)"
