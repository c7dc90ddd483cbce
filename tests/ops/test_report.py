"""report and status: numbers computed from committed parts; the plot."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from helpers import prompts, run_cli, write_jsonl

from dspine_batch.ops.report import summarize
from dspine_batch.ops.status import read_status


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    src = write_jsonl(tmp / "in.jsonl", prompts(40) + [{"id": "e1", "prompt": ""}, {"id": "e2", "prompt": ""}])
    out = tmp / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--num-samples", "2", "--commit-rows", "9",
                    "--max-error-rate", "0.5"]) == 0
    return out


def test_summary_matches_the_parts(outdir):
    s = summarize(str(outdir))
    t = ds.dataset(str(outdir), format="parquet").to_table().to_pylist()
    ok = [r for r in t if r["status"] == "ok"]
    assert (s["input_rows"], s["output_rows"], s["ok"], s["errors"]) == (42, 84, 80, 4)
    assert s["completion_tokens"] == sum(r["completion_tokens"] for r in ok)
    steps = sum(r["verify_steps"] for r in ok)
    rounds = sum(r["accept_length"] * r["verify_steps"] for r in ok)
    assert s["tau_token_weighted"] == pytest.approx(rounds / steps, abs=1e-3)
    assert s["accept_rate"] == pytest.approx(sum(r["draft_tokens_accepted"] for r in ok)
                                             / sum(r["draft_tokens_proposed"] for r in ok), abs=1e-4)
    assert sum(s["accept_histogram"]) == steps
    pos = s["accept_rate_by_position"]
    assert pos == sorted(pos, reverse=True) and 0 <= pos[-1] <= pos[0] <= 1
    assert s["finish_reasons"]["error"] == 4  # outputs; the error kinds count rows (2 rows x 2 samples)
    assert s["error_kinds"][0]["count"] == 2 and "empty prompt" in s["error_kinds"][0]["error"]


def test_report_cli_text_json_and_plot(outdir, tmp_path, capsys):
    capsys.readouterr()
    assert run_cli(["report", str(outdir)]) == 0
    text = capsys.readouterr().out
    assert "tau" in text and "42 input rows" in text and "empty prompt" in text
    assert run_cli(["report", str(outdir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input_rows"] == 42
    assert (outdir / "_report.json").exists()
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert run_cli(["report", str(outdir), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_status(outdir, capsys):
    st = read_status(str(outdir))
    assert (st["rows_done"], st["rows_failed"], st["rows_remaining"]) == (40, 2, 0)
    assert st["complete"] and st["fingerprint"] and st["last_commit_at"]
    capsys.readouterr()
    assert run_cli(["status", str(outdir)]) == 0
    assert "done 40  failed 2  remaining 0" in capsys.readouterr().out


def test_report_shows_the_speculation_by_source(tiny, tmp_path, capsys):
    """The reference engine (proposers=auto) on the tiny pair, through the whole CLI: the parts carry the stats
    by source, they add up to the totals, and the report prints a line per source."""
    from dspine_batch.cli import main
    from dspine_batch.engines.reference import ReferenceEngine
    from dspine_batch.engines.registry import engines_replaced

    model, draft = tiny

    def tiny_engine(_model, _draft, args):
        return ReferenceEngine.load(str(model), str(draft), args)

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": "say it again: " + "la " * (i + 2)}
                                             for i in range(4)])
    out = tmp_path / "out"
    with engines_replaced(tiny_engine):
        try:
            main(["generate", str(src), "-o", str(out), "--max-new-tokens", "24", "--progress", "none"])
        except SystemExit as e:
            assert not e.code
    t = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    assert len(t) == 4
    for r in t:
        assert r["verify_steps"] == r["dspine_verify_steps"] + r["suffix_verify_steps"]
        assert r["draft_tokens_accepted"] == r["dspine_tokens_accepted"] + r["suffix_tokens_accepted"]
    s = summarize(str(out))
    assert s["by_source"]["suffix"]["tokens_accepted"] == sum(r["suffix_tokens_accepted"] for r in t) > 0
    capsys.readouterr()
    assert main_report(str(out)) == 0
    text = capsys.readouterr().out
    assert "suffix " in text and "verify steps" in text
    # proposers=suffix: the draft never runs, the log says why once, and so does the report
    out2 = tmp_path / "out2"
    with engines_replaced(tiny_engine):
        try:
            main(["generate", str(src), "-o", str(out2), "--max-new-tokens", "24", "--progress", "none",
                  "--engine-arg", "proposers=suffix"])
        except SystemExit as e:
            assert not e.code
    err = capsys.readouterr().err
    assert err.count("dspine draft, so far: not run — --engine-arg proposers=suffix") == 1
    assert err.count("  dspine draft not run — --engine-arg proposers=suffix (suffix matches only)") == 1  # the end
    assert main_report(str(out2)) == 0
    text = capsys.readouterr().out
    assert "  dspine draft not run — --engine-arg proposers=suffix (suffix matches only)" in text
    assert "  suffix       " in text and "verify steps" in text


def test_the_plot_counts_in_whole_numbers_under_the_job_s_name(outdir):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from dspine_batch.ops.report import plot_figure

    s = summarize(str(outdir)) | {"accept_histogram": [1, 3], "accept_rate_by_position": [0.75]}  # small counts
    fig = plot_figure(s)
    fig.canvas.draw()
    hist = fig.axes[0]
    for ticks in (hist.get_xticks(), hist.get_yticks()):
        assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks)
    assert fig._suptitle.get_text().startswith(f"{outdir.name}: 42 rows")
    plt.close(fig)


def main_report(outdir: str) -> int:
    return run_cli(["report", outdir])


def test_report_says_na_when_no_output_reports_a_prefix_cache(outdir, capsys):
    """The scripted engine does not report cached prompt tokens: the rate is n/a, not 0% (which would claim
    every prompt token was computed)."""
    s = summarize(str(outdir))
    assert s["prefix_cache"] == {"rows": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "hit_rate": None}
    capsys.readouterr()
    assert run_cli(["report", str(outdir)]) == 0
    assert "prefix cache n/a" in capsys.readouterr().out


def test_prefix_cache_hit_rate_counts_only_outputs_that_report_it(tmp_path, capsys):
    """Three parts: one whose rows report cached prompt tokens, one whose rows leave it null, and one written
    before schema 3 (no such column). The rate is cached / prompt tokens over the reporting ok rows only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspine_batch.outdir.output import list_parts

    rows = [{"id": "e1", "prompt": ""}] + prompts(6)  # the error row lands in the first part
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    assert run_cli(["generate", str(src), "-o", str(out), "--commit-rows", "3", "--max-error-rate", "0.5"]) == 0
    parts = list_parts(str(out))
    assert len(parts) == 3
    want_cached = want_prompt = 0
    for k, part in enumerate(parts):
        t = pq.read_table(part.path)
        if k == 0:  # an engine that reports the cache: a made-up count per row (an error row's is not counted)
            ok = [s == "ok" for s in t.column("status").to_pylist()]
            prompt = t.column("prompt_tokens").to_pylist()
            assert ok.count(False) == 1
            cached = [min(3 * (i + 1), p) if o else 5 for i, (o, p) in enumerate(zip(ok, prompt))]
            want_cached += sum(c for c, o in zip(cached, ok) if o)
            want_prompt += sum(p for p, o in zip(prompt, ok) if o)
            col = t.schema.get_field_index("cached_prompt_tokens")
            t = t.set_column(col, t.schema.field(col), pa.array(cached, pa.int32()))
        elif k == 2:  # written by schema 2
            t = t.drop_columns(["cached_prompt_tokens"])
        pq.write_table(t, part.path)
    assert want_cached > 0
    s = summarize(str(out))
    pc = s["prefix_cache"]
    assert pc["rows"] == 2 and pc["rows"] < s["ok"]
    assert (pc["cached_prompt_tokens"], pc["prompt_tokens"]) == (want_cached, want_prompt)
    assert pc["hit_rate"] == pytest.approx(want_cached / want_prompt, abs=1e-4) and want_prompt < s["prompt_tokens"]
    capsys.readouterr()
    assert run_cli(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"prefix cache {want_cached:,} of {want_prompt:,} prompt tokens served from cache" in text
    assert "in the 2 outputs that report it" in text
