"""``dspine-batch slurm``: render the sbatch scripts of a job file (and optionally submit them).

A job file is a ``generate --config`` TOML plus a ``[slurm]`` table (ignored by ``generate``)::

    [slurm]
    template = "cpu-reference"   # or "gpu-sglang", or a path to your own template
    shards = 8                   # array tasks = shards (--shard I/N is explicit in the script)
    max_parallel = 8             # --array=0-7%8
    time = "04:00:00"
    partition = "cpu"

Rendering fills ``{{name}}`` placeholders of ``scripts/slurm/<template>.sbatch`` (an ``#SBATCH`` line whose
placeholder comes out empty is dropped) and writes the array script and the finalize script next to the logs.
``--submit`` runs ``sbatch --parsable`` on the array script, then on the finalize script with
``--dependency=afterok:<array job id>``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspine_batch.config import load_toml_raw
from dspine_batch.errors import UsageError
from dspine_batch.storage.urls import is_url

TEMPLATE_DIR_ENV = "DSPINE_BATCH_SLURM_TEMPLATES"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
DEFAULT_ENGINE = {"cpu-reference": "reference", "gpu-sglang": "sglang"}
SRUN = "srun --ntasks=1 --cpus-per-task=${SLURM_CPUS_PER_TASK:-1} --kill-on-bad-exit=1"
# srun delivers a forwarded signal to the task's whole process group (checked on Slurm 22.05): USR1 would
# kill SGLang's scheduler/detokenizer children (default action) instead of letting in-flight requests
# finish. So the SGLang task runs in the batch shell and the shell signals dspine-batch alone.
DEFAULT_LAUNCHER = {"cpu-reference": SRUN, "gpu-sglang": ""}

# [slurm] keys and their defaults; anything else in the table is an error (typos must not pass silently).
DEFAULTS: dict[str, Any] = {
    "template": "cpu-reference",
    "job_name": None,  # default: the job file's stem
    "shards": 1,
    "max_parallel": None,  # --array=0-(N-1)%max_parallel
    "time": "04:00:00",
    "partition": None,
    "finalize_partition": None,  # default: partition
    "account": None,
    "qos": None,
    "cpus_per_task": 4,
    "gpus_per_task": 1,
    "mem": None,
    "signal_lead": 180,  # seconds before the time limit that USR1 arrives
    "max_restarts": 20,  # self-requeues after exit 75 (SLURM_RESTART_COUNT counts every restart)
    "log_dir": None,  # default: OUTDIR + ".logs" (not inside OUTDIR: it must hold only our files)
    "script_dir": None,  # default: log_dir
    "workdir": None,  # default: the current directory (relative inputs resolve against it)
    "setup": "",  # shell lines run first in every script, e.g. "source /opt/venv/bin/activate"
    "dspine_batch": "dspine-batch",  # the command on the compute nodes
    "launcher": None,  # default: DEFAULT_LAUNCHER of the template ("" = run dspine-batch in the batch shell)
    "engine": None,  # default: the job file's engine, else the template's
    "generate_args": [],  # extra generate flags
    "finalize_args": [],  # e.g. ["--compact"]
    "finalize_time": "01:00:00",
    "extra_sbatch": [],  # raw "#SBATCH ..." lines (or bare options: "--constraint=a100")
    "prepare": False,  # a one-task job before the array runs `dspine-batch prepare` (kernels, model, cost model)
    "prepare_time": "00:30:00",
    "cache_dir": None,  # DSPINE_CACHE_DIR of every script: a shared folder the prepare job fills for all tasks
}


@dataclass
class Rendered:
    array_script: Path
    finalize_script: Path
    outdir: str
    log_dir: str
    shards: int
    array: str
    values: dict[str, Any] = field(default_factory=dict)
    prepare_script: Path | None = None  # ``[slurm] prepare``: submitted first, the array depends on it


def template_dir() -> Path:
    env = os.environ.get(TEMPLATE_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "scripts" / "slurm"


def find_template(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".sbatch" or os.sep in name:
        if not p.is_file():
            raise UsageError(f"slurm template {name}: no such file")
        return p
    p = template_dir() / f"{name}.sbatch"
    if not p.is_file():
        have = sorted(x.stem for x in template_dir().glob("*.sbatch")) if template_dir().is_dir() else []
        raise UsageError(f"slurm template {name!r} not found in {template_dir()} (have: {', '.join(have) or '-'}; "
                         f"set {TEMPLATE_DIR_ENV} or pass a path)")
    return p


def render_text(text: str, values: dict[str, str]) -> str:
    """Fill ``{{name}}``; drop ``#SBATCH`` lines whose placeholders are all empty; unknown names are errors."""
    out = []
    for line in text.splitlines():
        names = PLACEHOLDER.findall(line)
        for n in names:
            if n not in values:
                raise UsageError(f"slurm template: unknown placeholder {{{{{n}}}}}")
        if names and line.lstrip().startswith("#SBATCH") and all(values[n] == "" for n in names):
            continue
        out.append(PLACEHOLDER.sub(lambda m: values[m.group(1)], line))
    return "\n".join(out) + "\n"


def _q(v: str) -> str:
    return shlex.quote(v)


def _words(v: Any) -> list[str]:
    if v is None:
        return []
    return shlex.split(v) if isinstance(v, str) else [str(x) for x in v]


def slurm_settings(job: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    table = {k.replace("-", "_"): v for k, v in (job.get("slurm") or {}).items()}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted((set(table) | set(overrides)) - set(DEFAULTS))
    if unknown:
        raise UsageError(f"[slurm] {', '.join(unknown)}: unknown key(s) (known: {', '.join(DEFAULTS)})")
    s = {**DEFAULTS, **table, **overrides}
    try:
        s["shards"] = int(s["shards"])
        s["signal_lead"] = int(s["signal_lead"])
        s["max_restarts"] = int(s["max_restarts"])
    except (TypeError, ValueError) as e:
        raise UsageError(f"[slurm] shards/signal_lead/max_restarts: expected integers ({e})") from e
    if s["shards"] < 1:
        raise UsageError("[slurm] shards: expected an integer >= 1")
    return s


def render(job_file: str, outdir: str | None = None, overrides: dict[str, Any] | None = None,
           array: str | None = None, extra_generate: list[str] | None = None) -> Rendered:
    job = load_toml_raw(job_file)
    gen = job.get("generate", job)
    s = slurm_settings(job, overrides or {})
    outdir = outdir or gen.get("output")
    if not outdir:
        raise UsageError(f"{job_file}: no `output` in the job file; pass -o OUTDIR")
    workdir = os.path.abspath(s["workdir"] or os.getcwd())
    if is_url(outdir):  # an object-store OUTDIR: logs stay on the cluster's file system, under workdir
        outdir = outdir.rstrip("/")
        default_logs = os.path.join(workdir, "dspine-batch-logs", outdir.split("://", 1)[1].replace("/", "_"))
    else:
        outdir = os.path.abspath(os.path.join(workdir, outdir))
        default_logs = outdir.rstrip("/") + ".logs"
    log_dir = os.path.abspath(os.path.join(workdir, s["log_dir"] or default_logs))
    script_dir = os.path.abspath(os.path.join(workdir, s["script_dir"] or log_dir))
    name = s["job_name"] or Path(job_file).stem
    n = s["shards"]
    array = array or f"0-{n - 1}" + (f"%{int(s['max_parallel'])}" if s["max_parallel"] else "")
    _check_array(array, n)
    tpl_name = str(s["template"])
    engine = s["engine"] or gen.get("engine") or DEFAULT_ENGINE.get(tpl_name, "reference")
    extra = [ln if ln.startswith("#SBATCH") else f"#SBATCH {ln}" for ln in _words_lines(s["extra_sbatch"])]
    values = {
        "job_name": name, "array": array, "num_shards": str(n), "cpus_per_task": str(s["cpus_per_task"]),
        "gpus_per_task": str(s["gpus_per_task"] or ""), "mem": str(s["mem"] or ""), "time": str(s["time"] or ""),
        "partition": str(s["partition"] or ""), "finalize_partition": str(s["finalize_partition"] or s["partition"]
                                                                          or ""),
        "account": str(s["account"] or ""), "qos": str(s["qos"] or ""), "signal_lead": str(s["signal_lead"]),
        "log_dir": log_dir, "workdir": workdir, "extra_sbatch": "\n".join(extra), "setup": str(s["setup"] or ""),
        "dspine_batch": str(s["dspine_batch"]), "config": _q(os.path.abspath(job_file)), "outdir": _q(outdir),
        "engine": _q(str(engine)),
        "launcher": str(s["launcher"] if s["launcher"] is not None else DEFAULT_LAUNCHER.get(tpl_name, SRUN)),
        "generate_args": " ".join(_q(w) for w in [*_words(s["generate_args"]), *(extra_generate or [])]),
        "finalize_args": " ".join(_q(w) for w in _words(s["finalize_args"])),
        "finalize_time": str(s["finalize_time"]), "max_restarts": str(s["max_restarts"]),
        "prepare_time": str(s["prepare_time"]),
        "cache_env": f"export DSPINE_CACHE_DIR={_q(os.path.abspath(os.path.join(workdir, s['cache_dir'])))}"
        if s["cache_dir"] else "",
    }
    if any(c.isspace() for c in log_dir + workdir):
        raise UsageError("slurm: log_dir and workdir must not contain whitespace (#SBATCH lines are not quoted)")
    os.makedirs(log_dir, exist_ok=True)  # Slurm does not create the directory of --output
    os.makedirs(script_dir, exist_ok=True)
    arr = Path(script_dir) / f"{name}.sbatch"
    fin = Path(script_dir) / f"{name}-finalize.sbatch"
    prep = Path(script_dir) / f"{name}-prepare.sbatch" if s["prepare"] else None
    scripts = [(arr, find_template(tpl_name)), (fin, find_template("finalize"))]
    for path, tpl in scripts + ([(prep, find_template("prepare"))] if prep else []):
        text = render_text(tpl.read_text(), values)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)
    return Rendered(arr, fin, outdir, log_dir, n, array, values, prep)


def _words_lines(v: Any) -> list[str]:
    if not v:
        return []
    return [v] if isinstance(v, str) else [str(x) for x in v]


def _check_array(spec: str, n: int) -> None:
    """Array indices are shard indices: each must be in 0..n-1."""
    body = spec.split("%", 1)[0]
    for piece in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::\d+)?)?", piece.strip())
        if not m:
            raise UsageError(f"--array {spec!r}: expected indices like 0-7, 3 or 1,5 (optionally %K)")
        hi = int(m.group(2) or m.group(1))
        if int(m.group(1)) > hi or hi >= n:
            raise UsageError(f"--array {spec!r}: indices must lie in 0..{n - 1} (shards = {n})")


def sbatch(script: Path, *args: str) -> str:
    """Submit; returns the job id (``sbatch --parsable`` prints ``id`` or ``id;cluster``)."""
    try:
        p = subprocess.run(["sbatch", "--parsable", *args, str(script)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise UsageError("sbatch not found: run this on a Slurm login node (or use --no-submit)") from e
    if p.returncode != 0:
        raise UsageError(f"sbatch {script.name} failed: {(p.stderr or p.stdout).strip()}")
    return p.stdout.strip().split(";")[0]


def submit(r: Rendered, finalize: bool = True, dependency: str | None = None) -> dict[str, Any]:
    prepare_id = None
    if r.prepare_script is not None:  # first; the array starts once it succeeded (and is cancelled if it failed)
        prepare_id = sbatch(r.prepare_script, *([f"--dependency={dependency}"] if dependency else []))
        dependency = f"afterok:{prepare_id}"
    args = [f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if prepare_id else \
        [f"--dependency={dependency}"] if dependency else []
    array_id = sbatch(r.array_script, *args)
    out: dict[str, Any] = {"array_job_id": array_id, "finalize_job_id": None, "prepare_job_id": prepare_id,
                           "prepare_script": str(r.prepare_script) if r.prepare_script else None, "outdir": r.outdir,
                           "log_dir": r.log_dir, "array": r.array, "shards": r.shards,
                           "array_script": str(r.array_script), "finalize_script": str(r.finalize_script),
                           "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if finalize:
        out["finalize_job_id"] = sbatch(r.finalize_script, f"--dependency=afterok:{array_id}",
                                        "--kill-on-invalid-dep=yes")
    return out
