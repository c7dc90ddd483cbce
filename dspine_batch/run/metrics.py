"""A run's Prometheus metrics: pushed to a Pushgateway (``--metrics-push``) every ``--metrics-interval`` seconds and
at the end, and/or written for node_exporter's textfile collector (``--metrics-textfile``), as Prometheus's guidance
for batch jobs has it: grouped by job (``--job-name``) and shard, ``dspine_batch_last_success_timestamp_seconds`` set
only when the shard's run succeeds (what an alert waits on).

Nothing here counts anything: every value is read from what the run already keeps, so the metrics, ``status``,
``report`` and the log cannot disagree. Rows, tokens, tau and the per-source counts come from each stage's state
file fields (``ShardState``: the done-set's committed rows, and tallies carried across starts, so a killed and
resumed job's figures are the job's, never this process's from zero), rows expected and the time left from the
progress (``Progress.expected`` / ``eta``), the draft's state from the engine's record (``decisions``), the cost
from ``ops.cost``. The values change at each commit (what a resume keeps), not at each row.

A push runs on a background thread with a short timeout, never on the commit path; one that fails is one warning
line for the whole run and the job goes on. The final push is bounded by the same timeout. Labels carry the job's
name, the shard, a stage's name, a row status and a proposal source: never a prompt, a URL or a credential (the
gateway's own user:password is sent as HTTP basic auth, and never printed).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import basic_auth_handler, default_handler, pushadd_to_gateway, write_to_textfile
from prometheus_client.parser import text_string_to_metric_families

from dspine_batch.ops.cost import job_cost
from dspine_batch.run.stage import Run, Stage

PREFIX = "dspine_batch_"
SUCCESS = PREFIX + "last_success_timestamp_seconds"
SOURCES = ("dspine", "suffix", "forced")  # the parts' per-source columns (``schema.SOURCE_STATS``)
DRAFT_STATES = ("running", "retired", "not_run", "unknown")


def job_name(cfg_name: str | None, outdir: str) -> str:
    """``--job-name``, else the output's own name (its last path component: no bucket, host or credential)."""
    if cfg_name:
        return cfg_name
    path = urlsplit(outdir).path if "://" in outdir else outdir
    return os.path.basename(path.rstrip("/")) or "dspine-batch"


def split_auth(url: str) -> tuple[str, str | None, str | None]:
    """A gateway URL without its ``user:password@`` (sent as basic auth instead), and the two."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc)), parts.username, parts.password


@dataclass
class Snapshot:
    """What the run shows now, read from its stages (``collect`` renders it)."""

    job: str
    shard: str
    stages: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (stage label, its state fields)
    expected: int | None = None
    eta_s: float | None = None
    running: bool = True
    exit_code: int | None = None
    success_at: float | None = None
    outcome_only: bool = False  # finalize's group: how it ended, nothing of a run


def snapshot(run: Run, job: str, running: bool = True) -> Snapshot:
    snap = Snapshot(job, str(run.shard[0]), running=running)
    for st in run.stages:
        if st.state is not None and st.state.fields.get("rows_done") is not None:
            snap.stages.append((stage_label(st), dict(st.state.fields)))
    if run.progress is not None:
        snap.expected = run.progress.expected()
        snap.eta_s = run.progress.eta()
    return snap


def stage_label(st: Stage) -> str:
    return st.name or "generate"


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))


def families(s: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (the grouping labels, job and shard, are the push's or the textfile
    collector's; in a textfile they are labels of every sample)."""
    if s.outcome_only:
        yield _one("running", "1 while the shard runs, 0 once it ended", 0)
        yield _one("exit_code", "The shard's exit code (once it ended)", s.exit_code)
        yield _one("last_success_timestamp_seconds", "When the shard's run last succeeded (Unix time)", s.success_at)
        return
    rows = _gauge("rows", "Rows committed, by stage and status (ok, error, filtered, duplicate)", ("stage", "status"))
    tokens = _gauge("tokens", "Tokens of the committed ok rows, by stage and kind (prompt, generated)",
                    ("stage", "kind"))
    tps = _gauge("tokens_per_second", "Generated tokens per second of the shard's running time (all its starts)",
                 ("stage",))
    tau = _gauge("tau", "Tokens committed per verify step (token-weighted), by stage", ("stage",))
    src_tau = _gauge("source_tau", "Tokens committed per verify step led by a proposal source", ("stage", "source"))
    src_acc = _gauge("source_accepted_tokens", "Proposed tokens accepted, by proposal source", ("stage", "source"))
    src_steps = _gauge("source_verify_steps", "Verify steps led by a proposal source", ("stage", "source"))
    commit = _gauge("commit_latency_seconds", "How long the stage's last part commit took", ("stage",))
    for name, f in s.stages:
        t = f.get("totals") or {}
        done, errors = int(f.get("rows_done") or 0), int(f.get("error_rows") or 0)
        filtered, dup = int(t.get("filtered") or 0), int(t.get("duplicates") or 0)
        for status, n in (("ok", done - errors - filtered - dup), ("error", errors), ("filtered", filtered),
                          ("duplicate", dup)):
            rows.add_metric([name, status], max(n, 0))
        gen = int(t.get("completion_tokens") or 0)
        tokens.add_metric([name, "prompt"], int(t.get("prompt_tokens") or 0))
        tokens.add_metric([name, "generated"], gen)
        elapsed = float(f.get("elapsed_s") or 0.0)
        tps.add_metric([name], gen / elapsed if elapsed > 0 else 0.0)
        if t.get("verify_steps"):
            tau.add_metric([name], float(t.get("spec_tokens") or 0.0) / t["verify_steps"])
        by = t.get("by_source") or {}
        for src in SOURCES:
            steps, acc = int(by.get(f"{src}_verify_steps") or 0), int(by.get(f"{src}_tokens_accepted") or 0)
            src_steps.add_metric([name, src], steps)
            src_acc.add_metric([name, src], acc)
            if steps:
                src_tau.add_metric([name, src], (acc + steps) / steps)
        commit.add_metric([name], float(f.get("commit_s") or 0.0))
    yield from (rows, tokens, tps, tau, src_tau, src_acc, src_steps, commit)
    first = s.stages[0][1] if s.stages else {}
    expected = _gauge("rows_expected", "The shard's input rows (estimated while a JSON Lines input is read), by its "
                      "first stage", ("stage",))
    eta = _gauge("eta_seconds", "Time left for the shard's first stage at this run's rate", ("stage",))
    if s.stages and s.expected is not None:
        expected.add_metric([s.stages[0][0]], s.expected)
    if s.stages and s.eta_s is not None:
        eta.add_metric([s.stages[0][0]], s.eta_s)
    yield from (expected, eta)
    yield _one("engine_deaths", "Engine deaths of the shard, all starts", first.get("engine_deaths", 0))
    yield _one("watchdog_firings", "Watchdog (--stall-seconds) firings of the shard, all starts",
               first.get("watchdog_firings", 0))
    yield _one("retried_rows", "Committed rows --retry-errors / --retry-length took out to generate again, all "
               "starts", first.get("retried_rows", 0))
    yield _one("starts", "Starts of the shard (the first, then each resume or requeue)", first.get("starts", 0))
    yield _one("duration_seconds", "The shard's running time, all starts", first.get("elapsed_s", 0.0))
    yield _one("start_timestamp_seconds", "When this start of the shard began", first.get("started_at"))
    yield _one("running", "1 while the shard runs, 0 once it ended", int(s.running))
    yield _one("exit_code", "The shard's exit code (once it ended)", s.exit_code)
    draft = _gauge("draft_state", "The DSpine draft: 1 for its state (running, retired, not_run, unknown)", ("state",))
    rec = (first.get("decisions") or {}).get("dspine")
    state = "unknown" if rec is None else "retired" if rec.get("stopped") else \
        "running" if rec.get("ran") or rec.get("rounds") else "not_run"  # unknown: the engine does not say
    for name in DRAFT_STATES:
        draft.add_metric([name], int(name == state))
    yield draft
    cost = job_cost([first]) if first else None
    if cost is not None:
        yield _one("machine_hours", "Machine-hours of the shard, all starts", cost["machine_hours"])
        yield _one("cpu_seconds", "CPU-seconds of the shard's process(es), all starts", cost["cpu_s"])
        yield _one("gpu_seconds", "GPU-seconds of the shard (elapsed x GPUs), all starts", cost["gpu_s"])
        yield _one("cost", "What the shard cost at --price-per-hour", cost["cost"])
        yield _one("cost_per_million_tokens", "Cost per million generated tokens at --price-per-hour",
                   cost["cost_per_million_tokens"])
    yield _one("last_success_timestamp_seconds", "When the shard's run last succeeded (Unix time)", s.success_at)


def _one(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(PREFIX + name, doc)
    if value is not None:
        g.add_metric([], float(value))
    return g


def labelled(fams: Iterator[Metric], names: list[str], values: list[str]) -> Iterator[Metric]:
    """The families with the grouping labels on every sample: a textfile has no grouping key (the Pushgateway
    adds job and shard from its URL), so its samples carry them."""
    for fam in fams:
        out = GaugeMetricFamily(fam.name, fam.documentation, labels=[])
        out.samples = [s._replace(labels={**dict(zip(names, values, strict=True)), **s.labels}) for s in fam.samples]
        yield out


class _Collector:
    def __init__(self, snap: Snapshot, grouped: bool):
        self.snap, self.grouped = snap, grouped

    def collect(self) -> Iterator[Metric]:
        fams = families(self.snap)
        return fams if self.grouped else labelled(fams, ["job", "shard"], [self.snap.job, self.snap.shard])


def registry_of(snap: Snapshot, grouped: bool = True) -> CollectorRegistry:
    """The snapshot as a registry; ``grouped`` False: job and shard as labels (the textfile)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(snap, grouped))
    return reg


def previous_success(path: str) -> float | None:
    """The success time an earlier run wrote to the textfile (kept when this run does not succeed)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    try:
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == SUCCESS:
                    return float(sample.value)
    except ValueError:
        return None
    return None


class Metrics:
    """The run's exporter: ``start`` (a thread pushing/writing every ``interval`` s), ``close`` (the final one)."""

    def __init__(self, run: Run | None, push: str | None, textfile: str | None, job: str, interval: float,
                 log: Callable[[str], None], timeout: float = 5.0):
        self.run, self.textfile, self.job, self.interval, self.log = run, textfile, job, interval, log
        self.timeout = timeout
        self.push_url, user, password = split_auth(push) if push else (None, None, None)
        self.handler: Callable[..., Callable[[], None]] = default_handler
        if user is not None:
            def handler(url: str, method: str, timeout: float | None, headers: list, data: bytes) -> Callable:
                return basic_auth_handler(url, method, timeout, headers, data, user, password)
            self.handler = handler
        self.success_at = previous_success(textfile) if textfile else None
        self.warned = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one export at a time (the thread's and the final one)
        self._thread: threading.Thread | None = None

    def start(self) -> Metrics:
        self._thread = threading.Thread(target=self._loop, name="dspine-batch-metrics", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        assert self.run is not None
        while not self._stop.wait(self.interval):
            if not self.run.owned:  # not this shard's run yet (its lock may be another worker's)
                continue
            try:  # the run's figures read while the loop moves them: a read that races is taken again next time
                snap = snapshot(self.run, self.job)
            except RuntimeError:
                continue
            self.export(snap)

    def close(self, rc: int | None) -> None:
        """The final export: the exit code, and the success time when the run succeeded (``rc`` 0). Nothing when
        the run never held its shard (a bad option, or another worker's lock: that worker's figures stand)."""
        self._stop.set()
        assert self.run is not None
        if self._thread is not None:
            self._thread.join(self.timeout + 1)
        if not self.run.owned:
            return
        snap = snapshot(self.run, self.job, running=False)
        snap.exit_code = rc
        if rc == 0:
            self.success_at = time.time()
        self.export(snap, final=True)

    def export(self, snap: Snapshot, final: bool = False) -> None:
        snap.success_at = self.success_at
        with self._lock:
            reg = registry_of(snap)
            if self.textfile:
                try:
                    # a temporary file renamed over it: the collector reads it whole
                    write_to_textfile(self.textfile, registry_of(snap, grouped=False))
                except OSError as e:
                    self._warn(f"--metrics-textfile {self.textfile}: {e.strerror or e}")
            if self.push_url:
                try:
                    # POST (add): the group's other metrics stay, so a failed night keeps the last success time
                    pushadd_to_gateway(self.push_url, job=self.job, registry=reg, grouping_key={"shard": snap.shard},
                                       timeout=self.timeout, handler=self.handler)
                except Exception as e:  # any failure of a push is the gateway's: the job goes on
                    self._warn(f"--metrics-push to {self.push_url} failed ({_why(e)}); the job goes on, metrics "
                               f"are pushed again every {self.interval:g}s and at the end")

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            self.log(f"warning: {message}")


def _why(e: Exception) -> str:
    reason = getattr(e, "reason", None)
    return str(reason or e).strip()[:160] or type(e).__name__


def finalized(outdir: str, push: str | None, textfile: str | None, name: str | None,
              log: Callable[[str], None]) -> None:
    """``finalize`` succeeded: the job's success time, in a group of its own (shard ``finalize``), once."""
    if not push and not textfile:
        return
    job = job_name(name, outdir)
    exporter = Metrics(None, push, textfile, job, 0.0, log)
    exporter.success_at = time.time()
    exporter.export(Snapshot(job, "finalize", running=False, exit_code=0, outcome_only=True))


def watch(run: Run, log: Callable[[str], None]) -> Metrics | None:
    """The run's exporter, started, when --metrics-push or --metrics-textfile asks for one."""
    cfg = run.cfg
    if not cfg.metrics_push and not cfg.metrics_textfile:
        return None
    return Metrics(run, cfg.metrics_push, cfg.metrics_textfile, job_name(cfg.job_name, run.outdir),
                   cfg.metrics_interval, log).start()
