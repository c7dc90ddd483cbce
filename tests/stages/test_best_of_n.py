"""Best-of-n (issue 55): a scoring stage (the model's log-probabilities of given continuations, one prefill, no
decoding), a select step (the best rows of each group, exactly once) and the recipe jobs/recipes/best-of-n.toml.

Scoring is checked against transformers' log-softmax over the same tokens on a tiny random model; select's
decisions against an uninterrupted, unsharded run under two shards at once and kill -9 at every stage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_output, reference_engine, run_cli, run_shards, write_jsonl

from dspine_batch.engines.base import Request, SamplingParams
from dspine_batch.outdir.output import list_parts
from dspine_batch.stages.score import ScoreSpec, columns
from dspine_batch.stages.select import SelectSpec, decide, parse_select

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "jobs" / "recipes" / "best-of-n.toml"
QUESTIONS = ROOT / "examples" / "questions.jsonl"


# -- scoring ------------------------------------------------------------------------------------------------------
def test_scoring_equals_transformers_log_softmax(tiny):
    """Each continuation token's log-probability after the chat-templated prompt equals transformers' fp32
    log-softmax over the same tokens: one-token labels (read at the prompt's last position), multi-token labels and
    a continuation, batched together with prompts of different lengths; a prompt met again comes from the prefix
    cache with the same numbers."""
    import torch
    import transformers

    eng = reference_engine(tiny, draft=False, dtype="float32", batch_size="3")
    tok = eng.tokenizer
    enc = lambda s: tuple(tok.tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    one = (enc("h"), enc("w"), enc("t"))
    assert all(len(c) == 1 for c in one)
    many = (enc(" two plus two"), enc(" four"))
    assert len(many[0]) > 1
    prompts = [tok.render_chat([{"role": "user", "content": t}]) for t in ("hello world", "what is two plus two?",
                                                                         "the answer")]
    reqs = [Request("a", 0, prompts[0], SamplingParams(), one), Request("b", 0, prompts[1], SamplingParams(), many),
            Request("c", 0, prompts[2], SamplingParams(), (enc(" the answer is four."),)),
            Request("d", 0, prompts[1], SamplingParams(), one)]
    got = eng.score(reqs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny[0]), torch_dtype=torch.float32).eval()
    for r, res in zip(reqs, got, strict=True):
        assert res.error is None and res.row_id == r.row_id and res.prompt_tokens == len(r.prompt_ids)
        for cont, lps in zip(r.continuations, res.continuation_logprobs, strict=True):
            ids = torch.tensor([[*r.prompt_ids, *cont]])
            with torch.no_grad():
                lp = hf(ids).logits[0].float().log_softmax(-1)
            start = len(r.prompt_ids)
            want = [lp[start - 1 + j, t].item() for j, t in enumerate(cont)]
            assert len(lps) == len(cont)
            assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < 1e-4, (r.row_id, lps, want)
    assert eng.prefix is not None
    computed = eng.prefix.computed
    again = eng.score(reqs)  # every prompt now served from the prefix cache: the same numbers, bit for bit
    assert eng.prefix.computed == computed
    assert [r.continuation_logprobs for r in again] == [r.continuation_logprobs for r in got]


def test_scoring_refuses_what_does_not_fit(tiny):
    eng = reference_engine(tiny, draft=False, dtype="float32")
    room = int(eng.target.max_position)
    long = Request("x", 0, [5] * room, SamplingParams(), ((7, 8),))  # room + 1 tokens fed
    empty = Request("y", 0, [5, 6], SamplingParams(), ((),))
    a, b = eng.score([long, empty])
    assert "over the model's context" in a.error and "no tokens" in b.error


def test_label_probabilities_are_normalised_over_the_set():
    spec = ScoreSpec(labels=("Yes", "No", "Maybe"))
    out = columns(spec, [[-0.2, -1.5], [-0.9], [-800.0]])  # a label of two tokens; one far below the others
    assert math.isclose(sum(out["probs"].values()), 1.0, abs_tol=1e-12)
    assert out["score"] == out["probs"]["Yes"] and out["label"] == "No"  # -1.7 (Yes) < -0.9 (No)
    assert math.isclose(out["probs"]["Yes"] / out["probs"]["No"], math.exp(-1.7 + 0.9))
    cont = columns(ScoreSpec(continuation="{{ x }}"), [[-1.0, -2.0, -3.0]])
    assert cont == {"score": -2.0, "logprob_sum": -6.0, "logprob_mean": -2.0, "tokens": 3}


# -- select -------------------------------------------------------------------------------------------------------
def test_select_keeps_the_top_rows_of_a_group_with_stable_ties():
    spec = SelectSpec(keep=2)
    rows = [("r3", 0.5), ("r1", 0.9), ("r2", 0.5), ("r4", None), ("r0", 0.1)]
    got = decide(spec, rows)
    assert got == decide(spec, list(reversed(rows)))  # the order rows arrive in decides nothing
    assert [rid for rid, why in got.items() if why is None] == ["r1", "r2"]  # the tie 0.5 goes to the lower id
    assert got["r3"] == "select: rank 3 of 5" and got["r0"] == "select: rank 4 of 5"
    assert got["r4"] == "select: no number in 'score' (rank 5 of 5)"
    asc = decide(SelectSpec(keep=1, order="asc"), rows)
    assert [rid for rid, why in asc.items() if why is None] == ["r0"]
    above = decide(parse_select({"keep": "all above", "threshold": 0.5}, "stage 3", []), rows)
    assert [rid for rid, why in above.items() if why is None] == ["r1"]
    assert above["r3"] == "select: score 0.5 not above 0.5 (rank 3 of 5)"


@pytest.mark.parametrize("table, why", [
    ({"group": "question"}, "select group 'question'"),
    ({"keep": 0}, "select keep must be"),
    ({"keep": "all above"}, "needs a numeric `threshold`"),
    ({"order": "up"}, "select order 'up'"),
    ({"keep": 2, "threshold": 0.5}, "goes with keep"),
])
def test_bad_select_tables_are_refused(table, why):
    from dspine_batch.errors import UsageError

    with pytest.raises(UsageError, match=why):
        parse_select(table, "stage 3", ["answers"])


def _job(tmp_path: Path, out: Path, extra: str = "", src: Path = QUESTIONS) -> str:
    """The recipe, reading ``src`` into ``out``, with ``extra`` job settings."""
    text = RECIPE.read_text().replace('inputs = ["examples/questions.jsonl"]', f'inputs = ["{src}"]')
    text = text.replace('output = "out/best"', f'output = "{out}"\n{extra}')
    job = tmp_path / f"job-{out.name}.toml"
    job.write_text(text)
    return str(job)


def _selection(out: Path) -> dict[str, tuple]:
    return {r["row_id"]: (r["output"], r["kept"], r["dropped_by"]) for r in read_output(out / "best")}


def test_the_recipe_runs_and_reports_samples_scored_selected(tmp_path, capsys):
    """The recipe on the scripted engine: 4 samples per question, each scored, the best of each question kept (the
    highest score, ties by id), the question asked twice kept once; the funnel shows it."""
    out = tmp_path / "best"
    assert run_cli(["generate", "--config", _job(tmp_path, out)]) == 0
    answers, score, best = (read_output(out / n) for n in ("answers", "score", "best"))
    assert len(answers) == 24 and len(score) == 24 and len(best) == 24
    for r in score:
        got = json.loads(r["output"])
        assert r["structure_kind"] == "json_object" and r["completion_tokens"] == 0
        assert math.isclose(sum(got["probs"].values()), 1.0) and got["score"] == got["probs"]["Yes"]
    groups: dict[str, list] = {}
    for r in best:
        groups.setdefault(r["root_id"], []).append(r)
    for root, rows in groups.items():
        top = max(rows, key=lambda r: (json.loads(r["output"])["score"], [-ord(c) for c in r["row_id"]]))
        picked = [r for r in rows if r["dropped_by"] is None or r["dropped_by"].startswith("dedup")]
        assert picked == [top], root  # exactly one selected per question: the best
        assert sorted(r["dropped_by"] for r in rows if r is not top) == [f"select: rank {k} of 4" for k in (2, 3, 4)]
    kept = [r for r in best if r["kept"]]
    assert len(kept) == 5 and sum((r["dropped_by"] or "").startswith("dedup") for r in best) == 1  # q-06 = q-01
    capsys.readouterr()
    assert run_cli(["report", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[1].split()
    rows = {line.split()[0]: dict(zip(head[1:], line.split()[1:], strict=False)) for line in lines[2:5]}
    assert [rows[n]["rows"] for n in ("answers", "score", "best")] == ["24", "24", "24"]
    assert rows["best"]["kept"] == "5" and rows["best"]["unselected"] == "18" and rows["best"]["duplicate"] == "1"
    assert run_cli(["finalize", str(out)]) == 0


def test_a_scoring_stage_needs_an_engine_that_scores(tmp_path, capsys):
    from helpers import scripted_engine

    def no_score(*a):
        eng = scripted_engine(*a)
        eng.score = None  # as an engine without the entry point
        return eng

    assert run_cli(["generate", "--config", _job(tmp_path, tmp_path / "o")], loader=no_score) == 2
    err = capsys.readouterr().err
    assert "stage 'score': score: the scripted engine cannot score yet" in err and "Traceback" not in err


def _many_questions(tmp_path: Path, n: int = 16) -> Path:
    return write_jsonl(tmp_path / "q.jsonl", [{"id": f"q{i:02d}", "question": f"What is {i} times {i}?"}
                                              for i in range(n)])


def test_two_shards_at_once_decide_each_group_exactly_once(tmp_path):
    src = _many_questions(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli(["generate", "--config", _job(tmp_path, ref, src=src)]) == 0
    run_shards(["generate", "--config", _job(tmp_path, out, 'engine-args = {latency = "0.01"}', src)], 2)
    rows = read_output(out / "best")
    assert len(rows) == len({r["row_id"] for r in rows}) == 64  # every row once, none twice
    assert {r["row_id"].split("#")[0] for r in rows if r["kept"]} == {f"q{i:02d}" for i in range(16)}
    assert sum(r["kept"] for r in rows) == 16  # one per question across the shards
    assert _selection(out) == _selection(ref)
    assert run_cli(["finalize", str(out)]) == 0


def _parts(out: Path, name: str) -> int:
    return len(list_parts(str(out / name)))


def test_kill9_at_every_stage_gives_the_same_selection(tmp_path):
    """kill -9 just before a commit record is created (``killpoint_cli``): in the sampling stage, the scoring stage,
    before the select step's first part and between two of its parts (a group's rows split across the kill); the
    same command then finishes with the selection of an uninterrupted run, every row once."""
    src = _many_questions(tmp_path, 8)
    ref = tmp_path / "ref"
    extra = "commit-rows = 3"
    assert run_cli(["generate", "--config", _job(tmp_path, ref, extra, src)]) == 0
    a, s, b = (_parts(ref, n) for n in ("answers", "score", "best"))
    assert b >= 3
    for n in (1, a + 2, a + s + 1, a + s + 2):  # the select step's parts are the last: it waits for the rest
        out = tmp_path / f"out{n}"
        job = _job(tmp_path, out, extra, src)
        env = {**os.environ, "DSPINE_TEST_KILL_AT": f"before:link:commit-*.json:{n}", "PYTHONPATH": str(ROOT),
               "DSPINE_BATCH_PROGRESS": "none"}
        p = subprocess.run([sys.executable, str(ROOT / "tests" / "killpoint_cli.py"), "generate", "--config", job],
                           env=env, capture_output=True, timeout=300)
        assert p.returncode == -9, p.stderr.decode()[-2000:]
        assert run_cli(["generate", "--config", job]) == 0
        rows = read_output(out / "best")
        assert len(rows) == len({r["row_id"] for r in rows}), n
        assert _selection(out) == _selection(ref), n
        assert run_cli(["finalize", str(out)]) == 0


@pytest.mark.slow
def test_the_recipe_on_the_embedded_model(tmp_path):
    """The recipe end to end on the embedded default (SmolLM2 + the shipped draft): real label probabilities."""
    from dspine_batch.cli import main

    out = tmp_path / "best"
    with pytest.raises(SystemExit) as e:
        main(["generate", str(QUESTIONS), "--config", str(RECIPE), "-o", str(out), "--limit", "2",
              "--max-new-tokens", "24", "--progress", "none"])
    assert e.value.code == 0
    score = read_output(out / "score")
    assert len(score) == 8
    for r in score:
        got = json.loads(r["output"])
        assert 0 < got["score"] < 1 and math.isclose(sum(got["probs"].values()), 1.0)
    best = read_output(out / "best")
    assert sum(r["kept"] for r in best) == 2


def test_an_engine_death_while_scoring_isolates_the_row_it_repeats_on(tmp_path):
    """The engine dies whenever one scoring row is in its batch (``poison``): the rows it died scoring run alone on
    the next start, the one it dies on again becomes an error row, and its group is decided without it."""
    out = tmp_path / "best"
    job = _job(tmp_path, out)
    codes = [run_cli(["generate", "--config", job, "--engine-arg", "poison=1:q-02#1", "--max-error-rate", "1"])
             for _ in range(4)]
    assert codes[0] == 75 and 0 in codes, codes
    bad = [r for r in read_output(out / "score") if r["status"] == "error"]
    assert [r["row_id"] for r in bad] == ["q-02#1"] and "died twice" in bad[0]["error"]
    group = [r for r in read_output(out / "best") if r["root_id"] == "q-02"]
    assert len(group) == 3 and sum(r["dropped_by"] is None for r in group) == 1


def test_the_scores_are_fields_where_and_the_next_stage_read(tmp_path):
    """A scoring stage's `where` reads its own fields (``probs.Yes``), and a continuation score's fields reach the
    next stage's template; rows the `where` drops never reach the select step."""
    out = tmp_path / "best"
    job = Path(_job(tmp_path, out))
    text = job.read_text().replace('score = {labels = ["Yes", "No"]}', 'score = {labels = ["Yes", "No"]}\n'
                                   'where = "probs.Yes > 0.5"')
    job.write_text(text)
    assert run_cli(["generate", "--config", str(job)]) == 0
    score = read_output(out / "score")
    assert {r["row_id"] for r in score if r["kept"]} == \
        {r["row_id"] for r in score if json.loads(r["output"])["probs"]["Yes"] > 0.5}
    assert 0 < sum(r["kept"] for r in score) < len(score)
    assert {r["row_id"].rsplit("#", 1)[0] for r in read_output(out / "best")} == \
        {r["row_id"] for r in score if r["kept"]}
    cont = tmp_path / "cont"
    job2 = Path(_job(tmp_path, cont))
    job2.write_text(job2.read_text().replace('score = {labels = ["Yes", "No"]}',
                                             'score = {continuation = " {{ question }}"}').replace(
        'select = {group = "root_id", by = "score", keep = 1, order = "desc"}',
        'select = {keep = "all above", threshold = -2.0}'))
    assert run_cli(["generate", "--config", str(job2)]) == 0
    selected = []
    for r in read_output(cont / "best"):
        got = json.loads(r["output"])
        assert got["score"] == got["logprob_mean"] and got["tokens"] == len(" " + json.loads(r["context"])["question"])
        selected.append(not (r["dropped_by"] or "").startswith("select"))
        assert selected[-1] == (got["score"] > -2.0), r
    assert 0 < sum(selected) < len(selected)


def test_scoring_alone_never_starts_the_engines_stream(tmp_path):
    """Rows that need no decoding (scoring, the select step) while they are all there is do not start the engine's
    stream: on the reference engine a stream's start can calibrate its cost model (seconds on a busy machine,
    every run while none is cached) — the scoring half of the recipe paid 23 s of it for 5 s of scoring."""
    from helpers import scripted_engine

    out = tmp_path / "best"
    job = Path(_job(tmp_path, out))
    text = job.read_text()
    first = tmp_path / "first.toml"
    first.write_text(text[: text.index("[[stages]]", text.index("[[stages]]") + 1)])
    assert run_cli(["generate", "--config", str(first)]) == 0
    streams = []

    def counting(*a):
        eng = scripted_engine(*a)
        run = eng.run
        eng.run = lambda reqs, n: (streams.append(1), run(reqs, n))[1]
        return eng

    assert run_cli(["generate", "--config", str(job)], loader=counting) == 0
    assert streams == [] and len(read_output(out / "score")) == 24 and len(read_output(out / "best")) == 24
