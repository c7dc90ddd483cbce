"""The one job path as a matrix (issue 50): {one stage, three stages with explode / where / dedup} x {a local
directory, ``s3://`` on moto, ``az://`` on Azurite} x {kill -9 at each step of a commit, kill -9 inside a
``--retry-errors`` take-out, --retry-errors after a fixed input line, a row the engine dies on twice, a stall}.

Every cell is a real run through the CLI on the scripted engine; the rerun is the same command started at once
(what a requeue or a person does: no waiting out a dead worker's lease); the result is every stage's rows exactly
once, equal to an uninterrupted run of the same job, and ``finalize`` exit 0 with ``_SUCCESS``. A local worker is
killed by ``tests/killpoint_cli.py`` at an exact call of the local protocol; an object-store worker by the fault
proxy at an exact request (``faultproxy``), before the store sees it. The cells are generated, not hand-copied:
one body per scenario, parameterised by job shape and store, as Delta Lake runs its log tests against every store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from faultproxy import FaultProxy
from helpers import ROOT, VOLATILE, stage_docs, staged_job, subprocess_env, write_jsonl

STAGES = ("questions", "answers", "judge")
TIMEOUT = 300


@dataclass
class Where:
    """One cell's output location: what to pass as -o, how a reader lists its parts, how a child reaches it."""

    url: str
    fs: object | None  # an fsspec filesystem for a URL (None: local)
    prefix: str  # the store path (bucket/key) or the local path
    env: dict[str, str]
    endpoint: str | None = None  # the store's real endpoint (the proxy goes in front of it)
    store: str = "local"

    def sub(self, name: str) -> Where:
        return Where(f"{self.url}/{name}", self.fs, f"{self.prefix}/{name}", self.env, self.endpoint, self.store)

    def parts(self) -> list[str]:
        if self.fs is None:
            return sorted(str(p) for p in Path(self.prefix).glob("*.parquet"))
        return sorted(self.fs.glob(f"{self.prefix}/*.parquet"))

    def rows(self, drop: tuple[str, ...] = VOLATILE) -> list[dict]:
        files = self.parts()
        if not files:
            return []
        t = ds.dataset(files, filesystem=self.fs, format="parquet").to_table()
        rows = [{k: v for k, v in r.items() if k not in drop} for r in t.to_pylist()]
        return sorted(rows, key=lambda r: (r["row_id"], r["sample_index"]))

    def exists(self, rel: str) -> bool:
        if self.fs is None:
            return Path(self.prefix, rel).exists()
        return self.fs.exists(f"{self.prefix}/{rel}")

    def via(self, proxy_url: str) -> dict[str, str]:
        """The environment that sends a child's requests through the proxy."""
        if self.store == "s3":
            return {"AWS_ENDPOINT_URL": proxy_url}
        from conftest import azurite_connection_string

        return {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(proxy_url)}


@pytest.fixture(params=["local", "s3", "az"])
def where(request, tmp_path) -> Where:
    """The -o of a cell: a local directory, a prefix on moto's S3, or on Azurite."""
    if request.param == "local":
        return Where(str(tmp_path / "out"), None, str(tmp_path / "out"), {})
    if request.param == "s3":
        env, bucket, fs = (request.getfixturevalue(n) for n in ("s3env", "bucket", "s3"))
        return Where(f"s3://{bucket}/out", fs, f"{bucket}/out", dict(env), env["AWS_ENDPOINT_URL"], "s3")
    env, container, fs = (request.getfixturevalue(n) for n in ("azenv", "container", "az"))
    return Where(f"az://{container}/out", fs, f"{container}/out", dict(env),
                 request.getfixturevalue("azurite_endpoint"), "az")


@dataclass
class Shape:
    """A job: one stage, or three (questions -> explode answers -> judge with where and dedup)."""

    name: str
    src: Path
    args: Callable[[str], list[str]]  # -o value -> generate's arguments

    def outputs(self, w: Where) -> list[Where]:
        return [w] if self.name == "one" else [w.sub(s) for s in STAGES]


def _shape(name: str, tmp_path: Path, rows: list[dict] | None = None, more: tuple[str, ...] = ()) -> Shape:
    src = write_jsonl(tmp_path / "docs.jsonl", rows) if rows is not None else stage_docs(tmp_path, 9)
    common = ["--commit-rows", "2", "--commit-seconds", "0.05", "--max-in-flight", "4", "--max-error-rate", "1",
              "--engine-arg", "latency=0.01", *more]
    if name == "one":
        return Shape(name, src, lambda out: ["generate", str(src), "-o", out, "--id-column", "doc_id",
                                             "--prompt-template", "Write about: {{ text }}", "--max-new-tokens", "24",
                                             *common])
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)

    def args(out: str) -> list[str]:
        d = jobs / str(abs(hash(out)))
        d.mkdir(exist_ok=True)
        return ["generate", "--config", staged_job(d, src, out), *common]

    return Shape(name, src, args)


@pytest.fixture(params=["one", "three"])
def shape(request, tmp_path) -> Shape:
    return _shape(request.param, tmp_path)


def _child(args: list[str], env: dict[str, str], kill_at: str | None = None) -> subprocess.Popen:
    script = "killpoint_cli.py" if kill_at else "scripted_cli.py"
    extra = {**env, **({"DSPINE_TEST_KILL_AT": kill_at} if kill_at else {})}
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / script), *args], env=subprocess_env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)


def _run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    p = _child(args, env)
    _, err = p.communicate(timeout=TIMEOUT)
    return p.returncode, err.decode(errors="replace")


def _decided(rows: list[dict]) -> tuple[list[dict], list[tuple], list[str]]:
    """Rows without the verdict that depends on commit order (which of two rows with one dedup key is kept: a kill
    changes the order), and what must not change: how many rows each verdict got, and the kept rows' keys."""
    plain = [{k: v for k, v in r.items() if k not in ("kept", "dropped_by")} for r in rows]
    verdicts = sorted((r.get("kept"), (r.get("dropped_by") or "").split(" ")[0]) for r in rows)
    return plain, verdicts, sorted(r["dedup_key"] for r in rows if r.get("kept") and r.get("dedup_key"))


def _same(shape: Shape, got: Where, want: Where, skip: Callable[[dict], bool] = lambda r: False) -> None:
    """Every output of ``got`` exactly once and equal to ``want``'s (rows for which ``skip`` holds aside)."""
    for g, w in zip(shape.outputs(got), shape.outputs(want), strict=True):
        rows = g.rows()
        keys = [(r["row_id"], r["sample_index"]) for r in rows]
        assert len(keys) == len(set(keys)), f"{g.url}: a row twice"
        assert _decided([r for r in rows if not skip(r)]) == _decided([r for r in w.rows() if not skip(r)]), g.url


def _finalized(where: Where) -> None:
    rc, err = _run(["finalize", where.url], where.env)
    assert rc == 0, err[-3000:]
    assert where.exists("_SUCCESS")


_REFERENCES: dict[tuple, Where] = {}


def _reference(shape: Shape, tmp_path: Path, retry: bool = False) -> Where:
    """An uninterrupted local run of ``shape`` (then ``--retry-errors`` when ``retry``): what a cell must equal.
    Run once per job (its input, its arguments, its job file) and read by every cell of that job: the scripted
    engine is deterministic, so a second reference would be the same rows (~1-1.5 s a cell, over ~70 cells)."""
    key = (retry, *_job_key(shape))
    if key not in _REFERENCES:
        ref = Where(str(tmp_path / "ref"), None, str(tmp_path / "ref"), {})
        assert _run(shape.args(ref.url), {})[0] == 0
        if retry:
            assert _run([*shape.args(ref.url), "--retry-errors"], {})[0] == 0
        _REFERENCES[key] = ref
    return _REFERENCES[key]


def _job_key(shape: Shape) -> tuple:
    """What a run of ``shape`` depends on, without the paths that differ per cell: the input's bytes and the
    arguments, a job file read in place of its name, the input's path and the output's written as SRC and OUT."""
    args = [Path(a).read_text() if a.endswith(".toml") else a for a in shape.args("OUT")]
    return (Path(shape.src).read_bytes(), *(a.replace(str(shape.src), "SRC") for a in args))


# -- kill -9 at each step of a commit ----------------------------------------------------------------------------
# step -> (local kill point, the object-store request the proxy kills the worker at, before the store sees it)
KILLS = {
    "uploaded": ("before:link:commit-*.json:3", (b"PUT ", b"/_dspine/keys/commit-")),  # bytes there, no record
    "recorded": ("before:rename:train-*.parquet:3", (b"PUT ", b"-copy-source")),  # record, not published
    "published": ("after:rename:train-*.parquet:3", None),  # published, cleanup not done (object store: below)
}
PUBLISHED_REMOTE = {"s3": (b"POST ", b"?delete"), "az": (b"POST ", b"comp=batch")}  # the batched delete of staged


def _kill_remote(where: Where, args: list[str], marker: tuple[bytes, bytes], nth: int = 3) -> int:
    """Run ``args`` through a proxy that kills the worker at the ``nth`` request matching ``marker``; the exit
    status (-9 when the kill landed)."""
    seen, worker = [0], {}

    def hook(chunk: bytes) -> bool:
        if chunk.startswith(marker[0]) and marker[1] in chunk.split(b"\r\n\r\n", 1)[0]:
            seen[0] += 1
            if seen[0] == nth and "pid" in worker:
                os.kill(worker.pop("pid"), signal.SIGKILL)
                return True
        return False

    proxy = FaultProxy(where.endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    try:
        p = _child(args, {**where.env, **where.via(proxy.url)})
        worker["pid"] = p.pid
        p.communicate(timeout=TIMEOUT)
        return p.returncode
    finally:
        proxy.close()


@pytest.mark.parametrize("step", list(KILLS))
def test_kill9_at_a_commit_step_then_the_same_command_at_once(tmp_path, shape, where, step):
    ref = _reference(shape, tmp_path)
    args = shape.args(where.url)
    if where.store == "local":
        p = _child(args, where.env, KILLS[step][0])
        p.communicate(timeout=TIMEOUT)
        rc = p.returncode
    else:
        marker = KILLS[step][1] or PUBLISHED_REMOTE[where.store]
        rc = _kill_remote(where, args, marker, nth=1 if step == "published" else 3)
    assert rc == -signal.SIGKILL, f"the kill at {step} did not land (exit {rc})"
    rc, err = _run(args, where.env)  # at once: no waiting for the dead worker's lease
    assert rc == 0, err[-3000:]
    _same(shape, where, ref)
    _finalized(where)


# -- kill -9 inside a --retry-errors take-out -------------------------------------------------------------------
def test_kill9_inside_a_retry_take_out_then_the_same_command_at_once(tmp_path, where):
    rows = [{"doc_id": f"d{i:02d}", "text": f"Document {i} says the tides follow the moon."} for i in range(9)]
    shape = _shape("three", tmp_path, rows, ("--engine-arg", "error_every=5"))
    ref = _reference(shape, tmp_path, retry=True)
    args = shape.args(where.url)
    assert _run(args, where.env)[0] == 0
    retry = [*args, "--retry-errors"]
    if where.store == "local":
        p = _child(retry, where.env, "after:replace:supersede-*.json:1")  # the journal written, nothing swapped
        p.communicate(timeout=TIMEOUT)
        rc = p.returncode
    else:
        rc = _kill_remote(where, retry, (b"PUT ", b"/_dspine/keys/commit-"), nth=1)  # journal put, swap not sent
    assert rc == -signal.SIGKILL, f"the kill inside the take-out did not land (exit {rc})"
    rc, err = _run(retry, where.env)
    assert rc == 0, err[-3000:]
    _same(shape, where, ref)
    _finalized(where)


# -- --retry-errors after a fixed input line --------------------------------------------------------------------
def test_retry_errors_after_a_fixed_input_line(tmp_path, where, request):
    rows = [{"doc_id": f"d{i:02d}", "text": f"Document {i} says the tides follow the moon."} for i in range(9)]
    broken = [dict(r) for r in rows]
    del broken[4]["text"]
    for kind in ("one", "three"):
        d = tmp_path / kind
        d.mkdir()
        shape = _shape(kind, d, rows)
        ref = Where(str(d / "ref"), None, str(d / "ref"), {})
        assert _run(shape.args(ref.url), {})[0] == 0
        out = where.sub(kind)
        write_jsonl(shape.src, broken)
        assert _run(shape.args(out.url), where.env)[0] == 0
        first = shape.outputs(out)[0].rows()
        assert {r["row_id"]: r["status"] for r in first}["d04"] == "error"
        write_jsonl(shape.src, rows)  # the failed line fixed
        rc, err = _run([*shape.args(out.url), "--retry-errors"], where.env)
        assert rc == 0, err[-3000:]
        _same(shape, out, ref)
        _finalized(out)


# -- a row the engine dies on twice; a stall --------------------------------------------------------------------
def test_a_poison_row_ends_as_an_error_row_and_the_rest_equals_an_uninterrupted_run(tmp_path, shape, where):
    ref = _reference(shape, tmp_path)
    poison = "d04" if shape.name == "one" else "0:d04"  # as the engine sees it (a stage's rows carry its index)
    args = [*shape.args(where.url), "--engine-arg", f"poison={poison}"]
    codes = [_run(args, where.env)[0] for _ in range(3)]
    assert codes == [75, 75, 0], codes
    first = shape.outputs(where)[0].rows()
    assert [r["status"] for r in first if r["row_id"] == "d04"] == ["error"]
    lineage = (lambda r: r["row_id"] == "d04") if shape.name == "one" else \
        (lambda r: r.get("root_id") == "d04" or r["row_id"] == "d04")
    _same(shape, where, ref, skip=lineage)
    _finalized(where)


def test_a_stall_is_stopped_and_the_same_command_finishes_it(tmp_path, shape, where):
    ref = _reference(shape, tmp_path)
    args = shape.args(where.url)
    rc, err = _run([*args, "--stall-seconds", "1", "--engine-arg", "stall_after=7"], where.env)
    assert rc == 75 and "stalled: nothing produced" in err, err[-3000:]
    assert _run(args, where.env)[0] == 0
    _same(shape, where, ref)
    _finalized(where)


def test_the_matrix_reads_what_it_wrote(tmp_path):
    """The harness itself: a reference read back has every stage and row (a cell can only pass on real output)."""
    shape = _shape("three", tmp_path)
    ref = _reference(shape, tmp_path)
    counts = [len(w.rows()) for w in shape.outputs(ref)]
    assert counts[0] == 9 and all(counts), counts
    assert json.loads((Path(ref.prefix) / "_stages.json").read_text())["stages"] == list(STAGES)


# -- a lost answer to a conditional write ------------------------------------------------------------------------
def _losing(where: Where, args: list[str], marker: tuple[bytes, bytes, bytes], nth: int) -> tuple[int, str, int]:
    """Run ``args`` through a proxy that forwards the ``nth`` request matching ``marker`` (method, path part, a
    header) and cuts the connection when the store's answer comes: the write happened, the worker never hears
    of it and retries. (exit status, stderr, how many answers were lost)."""
    seen, lost = [0], [0]

    def hook(chunk: bytes) -> object:
        head = chunk.split(b"\r\n\r\n", 1)[0]
        if chunk.startswith(marker[0]) and marker[1] in head and marker[2] in head.lower():
            seen[0] += 1
            if seen[0] == nth:
                lost[0] += 1
                return "lose"
        return False

    proxy = FaultProxy(where.endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    try:
        p = _child(args, {**where.env, **where.via(proxy.url)})
        _, err = p.communicate(timeout=TIMEOUT)
        return p.returncode, err.decode(errors="replace"), lost[0]
    finally:
        proxy.close()


@pytest.mark.parametrize("where", ["s3", "az"], indirect=True)
@pytest.mark.parametrize("write", ["record create", "record swap"])
def test_a_lost_answer_to_a_conditional_write_is_read_back(tmp_path, shape, where, write):
    """The commit record's create-only write (If-None-Match) or a retry's record swap (If-Match) reaches the store
    and its answer is lost: the worker reads the record back by its token, so it neither stops nor damages the
    part; the job ends exactly once, as an uninterrupted one (a local directory has no answer to lose)."""
    # parts of exactly 3 rows (by count, not by time): an error row always shares its part with rows that did
    # not fail, so --retry-errors swaps that part's record (a part of errors only is removed, with no swap to
    # lose; with parts cut by time that depended on the machine's speed)
    more = ("--engine-arg", "error_every=5", "--commit-rows", "3", "--commit-seconds", "600")
    shape = _shape(shape.name, tmp_path, None, more)
    ref = _reference(shape, tmp_path, retry=write == "record swap")
    args = shape.args(where.url)
    if write == "record create":
        rc, err, lost = _losing(where, args, (b"PUT ", b"/_dspine/keys/commit-", b"if-none-match"), nth=2)
    else:
        assert _run(args, where.env)[0] == 0
        rc, err, lost = _losing(where, [*args, "--retry-errors"], (b"PUT ", b"/_dspine/keys/commit-", b"if-match"),
                                nth=1)
    assert lost == 1, "no answer was lost"
    assert rc == 0, err[-3000:]
    assert not where.exists("_dspine/damaged") and "damaged" not in err
    _same(shape, where, ref)
    _finalized(where)
