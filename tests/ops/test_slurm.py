"""dspine-batch on a live Slurm cluster: array jobs, preemption + requeue, hard kills, afterok finalize.

The `slurm`-marked tests need a running cluster (scripts/ci/ci_slurm.sh starts a one-node one with
scripts/ci/local-cluster.sh and runs `pytest -m slurm tests/ops/test_slurm.py`); without one they skip
with the reason. The unmarked tests at the end (rendering, finalize's shard listing) need no cluster.

Jobs run the scripts rendered by `dspine-batch slurm` from a job file, on the deterministic scripted engine
(latency makes a shard take ~20 s, so there is time to interrupt it), and every final output is compared
with an uninterrupted local run: exactly once, and identical apart from latency_s and attempt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, SMOL_TEMPLATE, prompts, read_output, run_cli, save_tiny_hf, tokenizer_dir, write_jsonl

ROWS, SAMPLES, SHARDS = 160, 2, 4
DSPINE = (sys.executable, "-m", "dspine_batch.cli")  # also in the jobs: no dependence on PATH
JOB = """
inputs = ["{input}"]
output = "out"
engine = "{engine}"
max-new-tokens = 24
temperature = 0.7
seed = 1
num-samples = {samples}
max-in-flight = 2
commit-rows = 4
commit-seconds = 1
grace-seconds = 2          # local cluster: KillWait = 5 s between TERM and KILL
{extra}
[engine_args]
{engine_args}

[slurm]
template = "cpu-reference"
shards = {shards}
cpus_per_task = 1
time = "00:10:00"
signal_lead = 60
"""


# ----------------------------------------------------------------------------------------------- cluster
def _no_cluster_reason() -> str | None:
    if not (shutil.which("sbatch") and shutil.which("sinfo") and shutil.which("squeue")):
        return "no Slurm client tools (sbatch/sinfo/squeue); run scripts/ci/ci_slurm.sh to start a local cluster"
    if not os.environ.get("SLURM_CONF") and not os.path.exists("/etc/slurm/slurm.conf"):
        return "no Slurm cluster configured (SLURM_CONF unset); run scripts/ci/ci_slurm.sh"
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld unreachable"
    if p.returncode != 0:
        return f"sinfo failed: {(p.stderr or p.stdout).strip()[:200]}"
    if not any(s.rstrip("*") in ("idle", "mixed", "allocated", "completing") for s in p.stdout.split()):
        return f"no usable Slurm node (sinfo: {p.stdout.split()})"
    cpus = subprocess.run(["sinfo", "-h", "-o", "%C"], capture_output=True, text=True, timeout=20).stdout.split()
    total = max((int(c.split("/")[-1]) for c in cpus if c.count("/") == 3), default=0)
    if total < SHARDS:
        return (f"the cluster has {total} CPUs; the tests run {SHARDS} one-CPU tasks at once (start it with "
                f"LOCAL_SLURM_CPUS=8, as scripts/ci/ci_slurm.sh does)")
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = _no_cluster_reason()
    if reason:
        pytest.skip(reason)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPINE_BATCH_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def sh(*cmd: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, env=_env(), cwd=cwd, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def job_states(job_id: str) -> dict[str, str]:
    """{'12_0': 'COMPLETED', ...} for an array (or {'13': ...}); finished jobs stay visible (MinJobAge)."""
    out = sh("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i %T").stdout
    return dict(line.split()[:2] for line in out.splitlines() if line.strip())


def wait_done(job_id: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
             "BOOT_FAIL", "DEADLINE"}
    while time.monotonic() < deadline:
        st = job_states(job_id)
        # an array shows one "PENDING" line per not-yet-started range; a requeued task is PENDING again
        if st and all(s in final for s in st.values()):
            return st
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not finished after {timeout}s: {job_states(job_id)}")


def shard_state(outdir: Path, i: int, n: int = SHARDS) -> dict:
    try:
        return json.loads((outdir / "_dspine" / f"state-{i:05d}-of-{n:05d}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_committed(outdir: Path, shards: list[int], min_rows: int, timeout: float = 60) -> None:
    """Until each shard is running with at least min_rows committed (so an interruption loses something)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sts = [shard_state(outdir, i) for i in shards]
        if all(s.get("state") == "running" and s.get("rows_done", 0) >= min_rows for s in sts):
            return
        time.sleep(0.2)
    raise AssertionError(f"shards {shards} did not commit {min_rows} rows in {timeout}s: "
                         f"{[shard_state(outdir, i) for i in shards]}")


def make_job(tmp: Path, engine: str = "scripted", engine_args: str = "latency = 0.4", extra: str = "",
             rows: int = ROWS, shards: int = SHARDS, samples: int = SAMPLES) -> Path:
    inp = write_jsonl(tmp / "in.jsonl", prompts(rows))
    job = tmp / "job.toml"
    job.write_text(JOB.format(input=inp, engine=engine, engine_args=engine_args, extra=extra, shards=shards,
                              samples=samples))
    return job


def submit(job: Path, outdir: Path, *args: str) -> dict:
    p = sh(*DSPINE, "slurm", str(job), "-o", str(outdir), "--submit", "--json",
           "--set", f"dspine_batch={' '.join(DSPINE)}", *args, cwd=job.parent)
    return json.loads(p.stdout)


def logs(info: dict) -> dict[int, str]:
    out = {}
    for f in Path(info["log_dir"]).glob(f"job_{info['array_job_id']}_*.log"):
        out[int(f.stem.rsplit("_", 1)[1])] = f.read_text()
    return out


def assert_exactly_once_and_equal(outdir: Path, reference: list[dict], rows: int = ROWS) -> None:
    got = read_output(outdir)
    keys = [(r["row_id"], r["sample_index"]) for r in got]
    assert len(keys) == len(set(keys)) == rows * SAMPLES
    assert got == reference  # identical to an uninterrupted run (latency_s/attempt excepted)
    assert (outdir / "_SUCCESS").exists()


def attempts(outdir: Path, i: int) -> set[int]:
    tag = f"train-{i:05d}-of-{SHARDS:05d}-"
    return {a for p in outdir.glob(tag + "*.parquet") for a in pq.read_table(p, columns=["attempt"])
            .column("attempt").to_pylist()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The same job run locally, uninterrupted, unsharded (scripted engine without latency)."""
    tmp = tmp_path_factory.mktemp("ref")
    job = make_job(tmp, engine_args="latency = 0")
    assert run_cli(["generate", "--config", str(job), "-o", str(tmp / "out")]) == 0
    return read_output(tmp / "out")


# ----------------------------------------------------------------------------------------------- live tests
@pytest.mark.slurm
def test_array_job_completes_and_finalize_passes(cluster, reference, tmp_path):
    job = make_job(tmp_path, engine_args="latency = 0.1")
    out = tmp_path / "out"
    t0 = time.monotonic()
    info = submit(job, out)
    states = wait_done(info["array_job_id"], 120)
    assert sorted(states.values()) == ["COMPLETED"] * SHARDS, states
    assert wait_done(info["finalize_job_id"], 60) == {info["finalize_job_id"]: "COMPLETED"}
    print(f"4-task array + finalize: {time.monotonic() - t0:.1f}s")
    assert_exactly_once_and_equal(out, reference)

    st = json.loads(sh(*DSPINE, "status", str(out), "--json").stdout)
    assert st["complete"] and st["rows_done"] == ROWS and st["output_rows"] == ROWS * SAMPLES
    assert st["rows_remaining"] == 0 and st["shards_not_started"] == []
    assert sorted(s["shard"] for s in st["shards"]) == [f"{i}/{SHARDS}" for i in range(SHARDS)]
    assert all(s["state"] == "done" and s["starts"] == 1 and s["slurm_job"].startswith(info["array_job_id"] + "_")
               for s in st["shards"])
    rep = json.loads(sh(*DSPINE, "report", str(out), "--json").stdout)
    assert rep["output_rows"] == ROWS * SAMPLES and rep["input_rows"] == ROWS and rep["errors"] == 0
    fin_log = Path(info["log_dir"], f"job-finalize_{info['finalize_job_id']}.log").read_text()
    assert "present exactly once" in fin_log
    task_logs = logs(info)
    assert sorted(task_logs) == list(range(SHARDS))
    for i, text in task_logs.items():
        assert text.count("[dspine-slurm") >= 2 and "restart=0 host=" in text and f"shard={i}/{SHARDS}" in text
        assert "dspine-batch exited 0" in text


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["srun", "direct"])
def test_preempted_tasks_requeue_resume_and_match_uninterrupted_run(cluster, reference, tmp_path, launcher):
    """Three ways a running task is interrupted, all drained (exit 75) and resumed after a requeue:
    1: `scontrol requeue` (what preemption with PreemptMode=REQUEUE does: TERM to every process, then Slurm
       requeues); 2: `scancel --signal=TERM` to the task's step (the wrapper requeues on exit 75; only with
       srun: without it there is no step, so task 2 gets USR1 like task 3);
    3: `scancel --batch --signal=USR1` (= the template's --signal=B:USR1@lead before the time limit: the
       wrapper forwards it, through srun or straight to dspine-batch (the GPU template's default), then
       requeues)."""
    job = make_job(tmp_path)
    out = tmp_path / "out"
    t0 = time.monotonic()
    info = submit(job, out, *(["--set", "launcher="] if launcher == "direct" else []))
    arr = info["array_job_id"]
    assert ("LAUNCH=(srun " in Path(info["array_script"]).read_text()) == (launcher == "srun")
    wait_committed(out, [1, 2, 3], min_rows=6)
    before = {i: shard_state(out, i)["rows_done"] for i in (1, 2, 3)}
    sh("scontrol", "requeue", f"{arr}_1")
    if launcher == "srun":
        sh("scancel", "--signal=TERM", f"{arr}_2")
        sh("scancel", "--batch", "--signal=USR1", f"{arr}_3")
        signals = ((1, "SIGTERM"), (2, "SIGTERM"), (3, "SIGUSR1"))
    else:
        sh("scancel", "--batch", "--signal=USR1", f"{arr}_2", f"{arr}_3")
        signals = ((1, "SIGTERM"), (2, "SIGUSR1"), (3, "SIGUSR1"))
    states = wait_done(arr, 180)
    assert sorted(states.values()) == ["COMPLETED"] * SHARDS, states
    assert wait_done(info["finalize_job_id"], 60) == {info["finalize_job_id"]: "COMPLETED"}
    print(f"[{launcher}] array with 3 interrupted tasks + finalize: {time.monotonic() - t0:.1f}s")
    assert_exactly_once_and_equal(out, reference)

    task_logs = logs(info)
    for i, sig in signals:
        st, text = shard_state(out, i), task_logs[i]
        assert st["state"] == "done" and st["starts"] == 2 and st["attempt"] == 1, st
        assert attempts(out, i) == {0, 1}  # rows committed before and after the requeue, none twice
        # one log per task, appended across the restart (--open-mode=append), with the restart count
        assert "restart=0 host=" in text and "restart=1 host=" in text, text
        assert f"stopped (signal {sig})" in text and "dspine-batch exited 75" in text, text
        m = re.search(r"resuming: ([\d,]+) rows already committed", text)
        assert m and int(m.group(1).replace(",", "")) >= before[i], text  # nothing committed was redone
        # the wrapper requeues only when Slurm is not already doing it
        assert ("requeueing" in text) == (i != 1), text
    assert "USR1: time limit near" in task_logs[3]
    assert shard_state(out, 0)["starts"] == 1 and attempts(out, 0) == {0}


@pytest.mark.slurm
def test_killed_tasks_resubmitted_end_exactly_once(cluster, reference, tmp_path):
    """Task 0: its dspine-batch process gets SIGKILL (OOM killer, node trouble: no drain, no commit, a staging
    file left behind). Task 1: `scancel --signal=KILL`, which Slurm 22.05 turns into an ordinary cancel (TERM,
    KILL after KillWait), so it drains. Neither is requeued; both are resubmitted (--array 0,1) and finalize
    then passes, with the output identical to an uninterrupted run."""
    job = make_job(tmp_path)
    out = tmp_path / "out"
    t0 = time.monotonic()
    info = submit(job, out)
    arr, fin = info["array_job_id"], info["finalize_job_id"]
    wait_committed(out, [0, 1], min_rows=6)
    os.kill(shard_state(out, 0)["pid"], signal.SIGKILL)  # the cluster is this machine
    sh("scancel", "--signal=KILL", f"{arr}_1")
    states = wait_done(arr, 120)
    assert states[f"{arr}_0"] == "FAILED" and states[f"{arr}_1"] == "CANCELLED" and \
        [states[f"{arr}_{i}"] for i in (2, 3)] == ["COMPLETED"] * 2, states
    # afterok can never be satisfied now: --kill-on-invalid-dep cancels the finalize job
    assert wait_done(fin, 60)[fin] == "CANCELLED"
    assert not (out / "_SUCCESS").exists()
    killed = {i: shard_state(out, i) for i in (0, 1)}
    assert killed[0]["state"] == "running" and killed[1]["state"] == "interrupted", killed  # no final state / drained
    assert all(0 < st["rows_done"] < ROWS for st in killed.values())
    task_logs = logs(info)
    assert "dspine-batch exited 0" not in task_logs[0] and "requeueing" not in task_logs[0]
    assert "stopped (signal SIGTERM)" in task_logs[1] and "requeueing" not in task_logs[1]
    p = sh(*DSPINE, "finalize", str(out), check=False)
    assert p.returncode == 1
    assert re.search(rf"missing rows by shard: 0/{SHARDS}: \d+, 1/{SHARDS}: \d+ .*array indices 0,1\)", p.stderr), \
        p.stderr
    assert f"shards not finished: 0/{SHARDS} (running" in p.stderr, p.stderr

    info2 = submit(job, out, "--array", "0,1")  # resubmit only the killed shards, and finalize after them
    assert info2["array"] == "0,1"
    a2 = info2["array_job_id"]
    assert wait_done(a2, 120) == {f"{a2}_0": "COMPLETED", f"{a2}_1": "COMPLETED"}
    assert wait_done(info2["finalize_job_id"], 60) == {info2["finalize_job_id"]: "COMPLETED"}
    print(f"kill -9 / scancel -s KILL + resubmission + finalize: {time.monotonic() - t0:.1f}s")
    assert_exactly_once_and_equal(out, reference)
    for i in (0, 1):
        st = shard_state(out, i)
        assert st["starts"] == 2 and st["rows_before"] >= killed[i]["rows_done"], st  # every committed row kept
        assert "resuming:" in logs(info2)[i]


STAGES = """
[[stages]]
name = "questions"
template = "Questions about: {{ prompt }}"
json-schema = '''{"type": "object", "required": ["questions"],
  "properties": {"questions": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}}}'''

[[stages]]
name = "answers"
explode = "questions"
template = "Answer: {{ questions }}"
dedup = "exact"
dedup-on = "questions"
"""


@pytest.mark.slurm
def test_a_staged_job_as_an_array_is_exactly_once_per_stage(cluster, tmp_path):
    """A two-stage job (questions -> explode -> answers) as a 4-task array plus finalize: every stage exactly
    once across the shards, equal to the same job run locally unsharded, each lineage in its root's shard."""
    rows = 40
    job = make_job(tmp_path, engine_args="latency = 0.05", rows=rows, samples=1)
    job.write_text(job.read_text().replace("temperature = 0.7", "temperature = 0") + STAGES)
    ref = tmp_path / "ref"
    assert run_cli(["generate", "--config", str(job), "-o", str(ref), "--engine-arg", "latency=0"]) == 0
    out = tmp_path / "out"
    info = submit(job, out)
    assert sorted(wait_done(info["array_job_id"], 180).values()) == ["COMPLETED"] * SHARDS
    assert wait_done(info["finalize_job_id"], 60) == {info["finalize_job_id"]: "COMPLETED"}
    assert (out / "_SUCCESS").exists()
    for stage in ("questions", "answers"):
        got = read_output(out / stage)
        keys = [(r["row_id"], r["sample_index"]) for r in got]
        assert len(keys) == len(set(keys)), stage
        assert [(r["row_id"], r["output"]) for r in got] == [(r["row_id"], r["output"]) for r in
                                                              read_output(ref / stage)], stage
    kept = [r["dedup_key"] for r in read_output(out / "answers") if r["kept"]]
    assert len(kept) == len(set(kept))  # dedup held across the array's shards (the key log)
    assert sorted(kept) == sorted(r["dedup_key"] for r in read_output(ref / "answers") if r["kept"])
    assert len(kept) < len(read_output(out / "answers"))  # there were duplicates to drop
    shard_of = {}
    for p in (out / "questions").glob("train-*.parquet"):
        for rid in pq.read_table(p, columns=["row_id"]).column("row_id").to_pylist():
            shard_of[rid] = p.name.split("-of-")[0]
    for p in (out / "answers").glob("train-*.parquet"):
        for root in pq.read_table(p, columns=["root_id"]).column("root_id").to_pylist():
            assert shard_of[root] == p.name.split("-of-")[0]  # a lineage stays in its root's shard


@pytest.mark.slurm
def test_reference_engine_array_on_tiny_model(cluster, tmp_path):
    """The real (reference) engine under Slurm: a tiny random Llama + DSpine draft, 2 shards, finalize."""
    pytest.importorskip("torch")
    import torch

    from dspine import init_draft, load_target

    model, draft = tmp_path / "model", tmp_path / "draft"
    model.mkdir()
    draft.mkdir()
    vocab = tokenizer_dir(model, SMOL_TEMPLATE)
    save_tiny_hf(model, "llama", vocab=vocab, layers=2, max_position_embeddings=96)
    torch.manual_seed(0)
    init_draft(load_target(model), num_layers=1, block_size=4).save(draft)
    job = make_job(tmp_path, engine="reference", engine_args="batch_size = 4", rows=12, shards=2, samples=SAMPLES,
                   extra=f'model = "{model}"\ndraft = "{draft}"\nmax-in-flight = 4')
    job.write_text(job.read_text().replace("max-new-tokens = 24", "max-new-tokens = 6")
                   .replace("max-in-flight = 2\n", "", 1))
    out = tmp_path / "out"
    t0 = time.monotonic()
    info = submit(job, out, "--set", "cpus_per_task=1")
    states = wait_done(info["array_job_id"], 240)
    assert sorted(states.values()) == ["COMPLETED"] * 2, (states, logs(info))
    assert wait_done(info["finalize_job_id"], 120) == {info["finalize_job_id"]: "COMPLETED"}
    print(f"reference engine, 2 tasks + finalize: {time.monotonic() - t0:.1f}s")
    rows = read_output(out)
    assert len({(r["row_id"], r["sample_index"]) for r in rows}) == len(rows) == 12 * SAMPLES
    # speculative columns filled (verify_steps may be 0: cost-aware verification can run only plain steps)
    assert all(r["status"] == "ok" and r["verify_steps"] is not None for r in rows)


# ----------------------------------------------------------------------------------------------- no cluster
def test_render_templates(tmp_path):
    from dspine_batch.ops.slurm import render

    job = make_job(tmp_path)
    r = render(str(job), str(tmp_path / "out"), {"partition": "", "account": "acct1"}, None, ["--seed", "7"])
    text = r.array_script.read_text()
    for want in ("#SBATCH --array=0-3\n", "#SBATCH --signal=B:USR1@60\n", "#SBATCH --requeue\n",
                 "#SBATCH --open-mode=append\n", f"#SBATCH --output={r.log_dir}/%x_%A_%a.log\n",
                 "#SBATCH --account=acct1\n", '--shard "${SLURM_ARRAY_TASK_ID}/4"', "--seed 7",
                 f"--config {job}", "scontrol requeue"):
        assert want in text, want
    assert "--partition" not in text and "{{" not in text and "#SBATCH --mem" not in text
    fin = r.finalize_script.read_text()
    assert f"dspine-batch finalize {r.outdir}" in fin and "--kill-on-invalid-dep=yes" in fin
    for path in (r.array_script, r.finalize_script):
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    gpu = render(str(job), str(tmp_path / "out2"), {"template": "gpu-sglang", "gpus_per_task": 8,
                                                    "engine": "sglang"}, "1,3", [])
    g = gpu.array_script.read_text()
    assert "#SBATCH --gpus-per-task=8\n" in g and "#SBATCH --array=1,3\n" in g and "--engine sglang" in g
    assert "LAUNCH=()" in g and "LAUNCH=(srun " in text  # SGLang: signal dspine-batch alone, not via srun
    assert "{{" not in g and subprocess.run(["bash", "-n", str(gpu.array_script)]).returncode == 0
    assert Path(r.log_dir).is_dir() and not Path(r.log_dir).is_relative_to(r.outdir)


def test_render_rejects_bad_settings(tmp_path):
    from dspine_batch.errors import UsageError
    from dspine_batch.ops.slurm import render

    job = make_job(tmp_path)
    with pytest.raises(UsageError, match="indices must lie in 0..3"):
        render(str(job), str(tmp_path / "o"), {}, "2-4", [])
    with pytest.raises(UsageError, match="unknown key"):
        render(str(job), str(tmp_path / "o"), {"partiton": "x"}, None, [])
    nightly = ROOT / "jobs" / "nightly-synth.toml"
    r = render(str(nightly), str(tmp_path / "n"), {}, None, [])
    assert "#SBATCH --array=0-127%128" in r.array_script.read_text()


def test_finalize_lists_missing_shards_and_generate_ignores_slurm_table(tmp_path):
    job = make_job(tmp_path, engine_args="latency = 0")
    out = tmp_path / "out"
    for i in (0, 2):  # shards 1 and 3 never ran
        assert run_cli(["generate", "--config", str(job), "-o", str(out), "--shard", f"{i}/4"]) == 0
    p = subprocess.run([*DSPINE, "finalize", str(out)], capture_output=True, text=True, env=_env())
    assert p.returncode == 1
    assert re.search(r"missing rows by shard: 1/4: \d+, 3/4: \d+ \(rerun .* array indices 1,3\)", p.stderr), p.stderr
    assert "shards never started: 1/4, 3/4" in p.stderr
    st = json.loads(subprocess.run([*DSPINE, "status", str(out), "--json"], capture_output=True, text=True,
                                   env=_env()).stdout)
    assert st["shards_not_started"] == ["1/4", "3/4"]
    for i in (1, 3):
        assert run_cli(["generate", "--config", str(job), "-o", str(out), "--shard", f"{i}/4"]) == 0
    assert subprocess.run([*DSPINE, "finalize", str(out)], env=_env(), capture_output=True).returncode == 0


def test_prepare_job_runs_first_and_the_array_waits_for_it(tmp_path, monkeypatch):
    """``[slurm] prepare = true``: a prepare script with the array's node settings and cache, submitted first; the
    array depends on it (afterok, cancelled if it fails), finalize on the array."""
    from dspine_batch.ops.slurm import render
    from dspine_batch.ops.slurm import submit as do_submit

    job = make_job(tmp_path)
    settings = {"prepare": True, "cache_dir": str(tmp_path / "shared"), "partition": "cpu",
                "extra_sbatch": ["--constraint=zen4"]}
    r = render(str(job), str(tmp_path / "out"), settings, None, [])
    prep = r.prepare_script.read_text()
    cache = f"export DSPINE_CACHE_DIR={tmp_path}/shared\n"
    for want in ("#SBATCH --partition=cpu\n", "#SBATCH --cpus-per-task=1\n", "#SBATCH --constraint=zen4\n", cache,
                 f"dspine-batch prepare --config {job} --engine scripted"):
        assert want in prep, want
    assert cache in r.array_script.read_text() and "{{" not in prep
    assert subprocess.run(["bash", "-n", str(r.prepare_script)]).returncode == 0
    calls = tmp_path / "sbatch.log"  # a stand-in sbatch: records its arguments, answers job ids 101, 102, ...
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$*" >> {calls}\necho $((100 + $(wc -l < {calls})))\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    info = do_submit(r)
    assert (info["prepare_job_id"], info["array_job_id"], info["finalize_job_id"]) == ("101", "102", "103")
    lines = calls.read_text().splitlines()
    assert lines[0].endswith(str(r.prepare_script)) and "--dependency" not in lines[0]
    assert "--dependency=afterok:101 --kill-on-invalid-dep=yes" in lines[1] and lines[1].endswith(str(r.array_script))
    assert "--dependency=afterok:102" in lines[2] and lines[2].endswith(str(r.finalize_script))
    assert render(str(job), str(tmp_path / "o2"), {}, None, []).prepare_script is None  # off by default
