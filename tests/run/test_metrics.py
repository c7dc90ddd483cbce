"""A run's Prometheus metrics (issue 54) against a real Pushgateway and a real Prometheus (Debian's packages,
installed by scripts/ci/install_prometheus.sh), started once for this module on 127.0.0.1 and stopped after.

A job pushes while it runs and at the end; the values equal the report's; a killed (kill -9) and resumed job's
figures are the job's, not twice its committed rows; an array of two shards is two groups the dashboard sums, and
its finalize pushes the job's success; the textfile parses with prometheus_client's parser; a dead gateway costs one
warning line and the job's rows are unaffected; Prometheus, scraping the gateway, answers every query of
jobs/grafana/dspine-batch.json and every rule of jobs/grafana/dspine-batch-alerts.yml with a series for the job, and
the error-rate alert goes pending for a job over its budget. The scripted engine generates (no model): the module
takes seconds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, prompts, run_cli, spawn, write_jsonl
from prometheus_client.parser import text_string_to_metric_families

from dspine_batch.ops.funnel import funnel
from dspine_batch.ops.report import summarize
from dspine_batch.ops.status import read_status
from dspine_batch.outdir.lock import Lock

DASHBOARD = ROOT / "jobs" / "grafana" / "dspine-batch.json"
RULES = ROOT / "jobs" / "grafana" / "dspine-batch-alerts.yml"
FAST = ["--metrics-interval", "0.2", "--commit-rows", "5", "--price-per-hour", "3"]


def _required() -> bool:
    return os.environ.get("DSPINE_REQUIRE_PROMETHEUS", "").lower() not in ("", "0", "false", "no")


def _binary(name: str, env: str) -> str:
    path = os.environ.get(env) or shutil.which(name)
    if path is None:
        why = f"{name} not found (scripts/ci/install_prometheus.sh installs it; or set {env})"
        if _required():
            pytest.fail(f"DSPINE_REQUIRE_PROMETHEUS is set and {why}")
        pytest.skip(why)
    return path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _until(what: str, check: Callable[[], Any], limit: float = 20.0, every: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``limit`` seconds, naming ``what``."""
    deadline = time.monotonic() + limit
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(every)
    pytest.fail(f"{what}: not within {limit:.0f}s (last: {last!r})")


class Servers:
    def __init__(self, tmp: Path):
        self.gw_port, self.prom_port = _port(), _port()
        gw, prom = _binary("prometheus-pushgateway", "DSPINE_PUSHGATEWAY"), _binary("prometheus", "DSPINE_PROMETHEUS")
        self.gateway = f"http://127.0.0.1:{self.gw_port}"
        self.prometheus = f"http://127.0.0.1:{self.prom_port}"
        config = tmp / "prometheus.yml"
        config.write_text(f"""global:
  scrape_interval: 500ms
  scrape_timeout: 400ms
  evaluation_interval: 500ms
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: pushgateway
    honor_labels: true
    static_configs: [{{targets: ["127.0.0.1:{self.gw_port}"]}}]
""")
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.procs = [
            subprocess.Popen([gw, f"--web.listen-address=127.0.0.1:{self.gw_port}",
                              f"--persistence.file={tmp / 'gw.data'}"], **quiet),
            subprocess.Popen([prom, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{self.prom_port}"], **quiet),
        ]
        _until("the Pushgateway answers", lambda: _get(f"{self.gateway}/-/ready"))
        _until("Prometheus is ready", lambda: _get(f"{self.prometheus}/-/ready"))

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def pushed(self, job: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The gateway's samples of ``job``: (name, sorted labels without job) -> value."""
        text = _get(f"{self.gateway}/metrics").decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.labels.get("job") == job and s.name.startswith("dspine_batch_"):
                    out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job")))] = s.value
        return out

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(_get(url))
        assert body["status"] == "success", body
        return body["data"]["result"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(tmp_path_factory.mktemp("prometheus"))
    yield s
    s.stop()


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert found, f"no {name}{labels} in {sorted({n for n, _ in samples})}"
    return sum(found)


def assert_equals_report(samples: dict, out: Path, price: float = 3.0) -> None:
    rep = summarize(str(out))
    assert value(samples, "dspine_batch_rows", status="ok") == rep["ok"]
    assert value(samples, "dspine_batch_rows", status="error") == rep["errors"]
    assert value(samples, "dspine_batch_tokens", kind="generated") == rep["completion_tokens"]
    assert value(samples, "dspine_batch_tokens", kind="prompt") == rep["prompt_tokens"]
    assert value(samples, "dspine_batch_source_verify_steps", source="dspine") == \
        rep["by_source"]["dspine"]["verify_steps"]
    assert value(samples, "dspine_batch_cost") == pytest.approx(rep["cost"]["cost"], abs=5e-6)  # each rounded to 1e-6
    assert rep["cost"]["price_per_hour"] == price


def test_pushes_while_running_and_at_the_end(servers, tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    out = tmp_path / "nightly"
    seen: list[dict] = []
    stop = threading.Event()

    def watch() -> None:  # what the gateway holds while the job runs
        while not stop.is_set():
            with_rows = servers.pushed("nightly")
            if with_rows and value(with_rows, "dspine_batch_running") == 1:
                seen.append(with_rows)
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        rc = run_cli(["generate", str(src), "-o", str(out), "--metrics-push", servers.gateway, *FAST,
                      "--max-in-flight", "4", "--engine-arg", "latency=0.08"])
    finally:
        stop.set()
        t.join()
    assert rc == 0
    assert any(value(s, "dspine_batch_rows", status="ok") > 0 for s in seen), "no push while the job ran"
    final = servers.pushed("nightly")
    assert value(final, "dspine_batch_running") == 0 and value(final, "dspine_batch_exit_code") == 0
    assert value(final, "dspine_batch_rows_expected") == 60
    assert abs(value(final, "dspine_batch_last_success_timestamp_seconds") - time.time()) < 60
    assert all(dict(ls).get("shard") == "0" for _, ls in final)  # the group: job "nightly" (OUTDIR's name), shard 0
    assert_equals_report(final, out)
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1].startswith("dspine-batch: cost: ")  # the log's last line
    assert "per million generated tokens" in err and "warning" not in err


def test_kill_and_resume_counts_each_committed_row_once(servers, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(80))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--job-name", "resumed", "--metrics-push", servers.gateway, *FAST,
            "--max-in-flight", "2"]
    p = spawn([*args, "--engine-arg", "latency=0.05"])
    try:
        _until("the first run commits and pushes",
               lambda: value(servers.pushed("resumed"), "dspine_batch_rows", status="ok") >= 10
               if servers.pushed("resumed") else None, limit=60)
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    assert run_cli(args) == 0
    final = servers.pushed("resumed")
    assert value(final, "dspine_batch_starts") == 2
    assert value(final, "dspine_batch_rows", status="ok") == 80
    assert_equals_report(final, out)  # tokens too: the killed start's committed tokens carried, not counted twice


def test_a_state_file_behind_its_parts_is_not_trusted_for_the_totals(servers, tmp_path):
    """Killed between a part's commit and the state's save after it: the state's tallies miss that part, so the
    resume takes the tallies from the parts (as it does after --retry-errors took rows out)."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--job-name", "lagging", "--metrics-push", servers.gateway, *FAST]
    assert run_cli([*args, "--engine-arg", "crash_after=22"]) == 75  # an engine death: parts of 5 rows committed
    state = out / "_dspine" / "state-00000-of-00001.json"
    fields = json.loads(state.read_text())
    assert fields["rows_done"] >= 10
    fields["rows_done"] -= 5  # as the state was before the last commit
    fields["totals"]["completion_tokens"] -= 7
    state.write_text(json.dumps(fields))
    assert run_cli(args) == 0
    assert_equals_report(servers.pushed("lagging"), out)


def test_array_of_two_shards_is_two_groups_the_dashboard_sums(servers, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    out = tmp_path / "arr"
    for i in range(2):
        assert run_cli(["generate", str(src), "-o", str(out), "--shard", f"{i}/2", "--job-name", "array",
                        "--metrics-push", servers.gateway, *FAST]) == 0
    final = servers.pushed("array")
    assert {dict(ls)["shard"] for _, ls in final} == {"0", "1"}
    per_shard = [value(final, "dspine_batch_rows", status="ok", shard=s) for s in ("0", "1")]
    assert all(per_shard) and sum(per_shard) == 40
    assert_equals_report(final, out)
    whole = read_status(str(out))["cost"]  # status on an array: the whole job's cost, every shard's starts
    assert whole["cost"] == pytest.approx(value(final, "dspine_batch_cost"), abs=5e-6)
    assert whole["machine_hours"] == pytest.approx(value(final, "dspine_batch_machine_hours"), abs=5e-6)
    assert run_cli(["finalize", str(out), "--job-name", "array", "--metrics-push", servers.gateway]) == 0
    ended = {n: v for (n, ls), v in servers.pushed("array").items() if dict(ls)["shard"] == "finalize"}
    assert abs(ended["dspine_batch_last_success_timestamp_seconds"] - time.time()) < 60  # the job as a whole
    assert set(ended) == {"dspine_batch_last_success_timestamp_seconds", "dspine_batch_running",
                          "dspine_batch_exit_code"}
    _until("Prometheus's sum of both shards' groups is the job's rows",
           lambda: [r for r in servers.query('sum by (job) (dspine_batch_rows{job="array"})')
                    if float(r["value"][1]) == 40])


def test_dashboard_queries_and_alert_rules_return_a_series(servers, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "dash"), "--metrics-push", servers.gateway, *FAST,
                    "--engine-arg", "error_every=3", "--max-error-rate", "1"]) == 0
    _until("Prometheus scrapes the job", lambda: servers.query('dspine_batch_running{job="dash"} == 0'))
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["templating"]["list"][0]["query"]["query"] == "label_values(dspine_batch_rows, job)"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 14
    for expr in exprs:  # Grafana's variables as Grafana fills them for one job
        q = expr.replace("$job", "dash").replace("$__rate_interval", "1m")
        _until(f"a series for {expr}", lambda q=q: [r for r in servers.query(q) if r["metric"].get("job") == "dash"],
               limit=10)
    groups = _until("the rules are loaded", lambda: json.loads(_get(f"{servers.prometheus}/api/v1/rules"))
                    ["data"]["groups"])
    rules = [r for g in groups for r in g["rules"]]
    records = {r["name"] for r in rules if r["type"] == "recording"}
    alerts = [r for r in rules if r["type"] == "alerting"]
    assert {a["name"] for a in alerts} == {"DspineBatchNoSuccess", "DspineBatchErrorRate", "DspineBatchJobLate"}
    for name in records:
        _until(f"a series of {name}", lambda name=name: servers.query(f'{name}{{job="dash"}}'), limit=10)
    for a in alerts:  # each compares a recording rule (queried above) with its threshold
        signal_name = a["query"].split(" > ")[0].strip()
        assert signal_name in records, a["query"]
        assert a["health"] in ("ok", "unknown"), a
    ratio = float(servers.query('dspine_batch:error_ratio{job="dash"}')[0]["value"][1])
    assert ratio == pytest.approx(summarize(str(tmp_path / "dash"))["errors"] / 20)
    _until("DspineBatchErrorRate pending for the job over its budget",
           lambda: [a for a in json.loads(_get(f"{servers.prometheus}/api/v1/alerts"))["data"]["alerts"]
                    if a["labels"].get("alertname") == "DspineBatchErrorRate" and a["labels"].get("job") == "dash"],
           limit=10)
    # --retry-errors takes the error rows out of the parts: counted as retried, and the totals are the parts' again
    errors = summarize(str(tmp_path / "dash"))["errors"]
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "dash"), "--metrics-push", servers.gateway, *FAST,
                    "--engine-arg", "error_every=3", "--max-error-rate", "1", "--retry-errors"]) == 0
    again = servers.pushed("dash")
    assert value(again, "dspine_batch_retried_rows") == errors > 0
    assert_equals_report(again, tmp_path / "dash")


def test_textfile_parses_and_says_what_the_report_says(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    out, prom = tmp_path / "tf", tmp_path / "textfile" / "tf.prom"
    prom.parent.mkdir()
    assert run_cli(["generate", str(src), "-o", str(out), "--metrics-textfile", str(prom), *FAST]) == 0
    samples = {}
    for fam in text_string_to_metric_families(prom.read_text()):
        for s in fam.samples:
            assert s.labels["job"] == "tf" and s.labels["shard"] == "0"
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job")))] = s.value
    assert_equals_report(samples, out)
    success = value(samples, "dspine_batch_last_success_timestamp_seconds")
    assert list(prom.parent.iterdir()) == [prom]  # written whole: no temporary file left beside it
    # a rerun that fails keeps the last success time (what the no-success alert reads)
    assert run_cli(["generate", str(src), "-o", str(out), "--metrics-textfile", str(prom), "--temperature", "0.5"]) == 2
    again = {s.name: s.value for fam in text_string_to_metric_families(prom.read_text()) for s in fam.samples}
    assert again["dspine_batch_last_success_timestamp_seconds"] == success and again["dspine_batch_exit_code"] == 2


def test_a_dead_gateway_is_one_warning_and_the_rows_are_unaffected(tmp_path, capfd):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    dead = f"http://user:hunter2@127.0.0.1:{_port()}"  # nothing listens there
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "a"), "--metrics-push", dead, *FAST,
                    "--engine-arg", "latency=0.02", "--max-in-flight", "2"]) == 0
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "--metrics-push" in line]
    assert len(warnings) == 1 and "warning" in warnings[0] and "the job goes on" in warnings[0]
    assert "hunter2" not in err and "user" not in warnings[0]
    assert run_cli(["generate", str(src), "-o", str(tmp_path / "b")]) == 0
    a, b = summarize(str(tmp_path / "a")), summarize(str(tmp_path / "b"))
    assert (a["ok"], a["errors"], a["completion_tokens"]) == (b["ok"], b["errors"], b["completion_tokens"]) == \
        (30, 0, b["completion_tokens"])
    manifest = (tmp_path / "a" / "_manifest.json").read_text()
    assert "hunter2" not in manifest


def test_a_job_of_stages_says_every_stage_as_its_funnel_does(tmp_path):
    """jobs/recipes/qa-from-docs.toml (questions -> answers -> judge with `where` and `dedup`): the one runner's
    metrics for every stage, its filtered and duplicate rows as `report`'s funnel counts them."""
    out, prom = tmp_path / "qa", tmp_path / "qa.prom"
    assert run_cli(["generate", str(ROOT / "examples" / "docs.jsonl"), "--config",
                    str(ROOT / "jobs" / "recipes" / "qa-from-docs.toml"), "-o", str(out), "--metrics-textfile",
                    str(prom)]) == 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(prom.read_text()) for s in fam.samples}
    stages = funnel(str(out))
    assert [s["stage"] for s in stages] == ["questions", "answers", "judge"]
    for s in stages:
        assert value(samples, "dspine_batch_rows", stage=s["stage"], status="filtered") == s["filtered"]
        assert value(samples, "dspine_batch_rows", stage=s["stage"], status="duplicate") == s["duplicates"]
        assert value(samples, "dspine_batch_rows", stage=s["stage"], status="error") == s["errors"]
        assert value(samples, "dspine_batch_rows", stage=s["stage"]) == s["rows"]  # one sample a row
        assert value(samples, "dspine_batch_tokens", stage=s["stage"], kind="generated") == s["completion_tokens"]
    assert sum(s["filtered"] + s["duplicates"] for s in stages) > 0  # the recipe's rules dropped rows
    assert value(samples, "dspine_batch_rows_expected", stage="questions") == 6  # the first stage's input rows


def test_a_start_refused_by_a_live_workers_lock_leaves_that_workers_figures(servers, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    out = tmp_path / "out"
    args = ["generate", str(src), "-o", str(out), "--job-name", "held", "--metrics-push", servers.gateway, *FAST]
    assert run_cli(args) == 0
    before = servers.pushed("held")
    with Lock(str(out), "00000-of-00001"):  # the shard's worker, alive
        assert run_cli(args) == 75
    assert servers.pushed("held") == before
