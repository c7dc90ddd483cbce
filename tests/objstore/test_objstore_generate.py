"""Inputs and OUTDIR on S3 (issue 39), against a real S3 server on 127.0.0.1 (``conftest``): generate from s3://
Parquet (a glob) and JSONL.gz into an s3:// OUTDIR gives the local run's rows; the ops work on the URL; the
readers users point at OUTDIR see exactly the committed rows; 403, a missing bucket, an unknown scheme and a
store without create-if-absent are one line each; no secret reaches any log, manifest, state file or report."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from faultproxy import FaultProxy
from foreign_readers import counts_elsewhere
from helpers import VOLATILE, prompts, read_output, run_cli

GEN = ["--num-samples", "2", "--temperature", "0.8", "--seed", "5", "--commit-rows", "7"]
N = 50


def read_s3_output(s3, prefix: str, drop: tuple[str, ...] = VOLATILE) -> list[dict]:
    """What a reader globbing OUTDIR/*.parquet sees, as ``helpers.read_output`` shapes it."""
    files = sorted(s3.glob(f"{prefix}/*.parquet"))
    t = ds.dataset(files, filesystem=s3, format="parquet").to_table() if files else pa.table({})
    rows = [{k: v for k, v in r.items() if k not in drop} for r in t.to_pylist()]
    return sorted(rows, key=lambda r: (r["row_id"], r["sample_index"]))


def _inputs(tmp_path: Path, s3, bucket: str) -> Path:
    """Two Parquet files and one JSONL.gz, locally under ``in/`` and the same on the store under ``in/``."""
    d = tmp_path / "in"
    d.mkdir()
    rows = prompts(N)
    pq.write_table(pa.Table.from_pylist(rows[:20]), d / "a-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), d / "a-1.parquet")
    with gzip.open(d / "more.jsonl.gz", "wt") as f:
        for r in prompts(30, start=1000):
            f.write(json.dumps(r) + "\n")
    for p in d.iterdir():
        s3.put_file(str(p), f"{bucket}/in/{p.name}")
    return d


def test_s3_inputs_into_s3_outdir_equal_the_local_run(tmp_path, s3, bucket, capsys):
    d = _inputs(tmp_path, s3, bucket)
    assert run_cli(["generate", str(d / "a-*.parquet"), *GEN, "-o", str(tmp_path / "ref")]) == 0
    out = f"s3://{bucket}/out/2026-12-05"
    assert run_cli(["generate", f"s3://{bucket}/in/a-*.parquet", *GEN, "-o", out]) == 0
    assert not Path("s3:").exists() and not (tmp_path / "s3:").exists()  # never a local "s3:" folder
    got = read_s3_output(s3, f"{bucket}/out/2026-12-05")
    assert len(got) == 2 * N and got == read_output(tmp_path / "ref")
    names = s3.ls(f"{bucket}/out/2026-12-05", detail=False)
    assert f"{bucket}/out/2026-12-05/_SUCCESS" in names
    assert not s3.ls(f"{bucket}/out/2026-12-05/_dspine/staging", detail=False) \
        if s3.exists(f"{bucket}/out/2026-12-05/_dspine/staging") else True
    # a rerun resumes: nothing left, no engine loaded
    capsys.readouterr()
    assert run_cli(["generate", f"s3://{bucket}/in/a-*.parquet", *GEN, "-o", out]) == 0
    assert "nothing left to do" in capsys.readouterr().err
    # JSONL.gz from the store
    assert run_cli(["generate", str(d / "more.jsonl.gz"), *GEN, "-o", str(tmp_path / "ref2")]) == 0
    assert run_cli(["generate", f"s3://{bucket}/in/more.jsonl.gz", *GEN, "-o", f"s3://{bucket}/out2"]) == 0
    assert read_s3_output(s3, f"{bucket}/out2") == read_output(tmp_path / "ref2")
    # the ops on the URL
    capsys.readouterr()
    assert run_cli(["status", out, "--json", "--verify"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["rows_done"] == N and st["complete"] and not st["damaged_parts"] and st["parts_verified"] == st["parts"]
    assert run_cli(["finalize", out]) == 0
    plot = tmp_path / "accept.png"
    assert run_cli(["report", out, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["output_rows"] == 2 * N and s3.exists(f"{bucket}/out/2026-12-05/_report.json")
    pytest.importorskip("matplotlib")
    assert run_cli(["report", out, "--plot", str(plot)]) == 0 and plot.stat().st_size > 0
    assert run_cli(["export", out, "-o", f"s3://{bucket}/exports/results.jsonl"]) == 0
    lines = s3.cat_file(f"{bucket}/exports/results.jsonl").decode().splitlines()
    assert len(lines) == N and {json.loads(x)["custom_id"] for x in lines} == {r["id"] for r in prompts(N)}


def test_readers_see_exactly_the_committed_rows(tmp_path, s3, s3env, bucket):
    d = _inputs(tmp_path, s3, bucket)
    out = f"{bucket}/out"
    assert run_cli(["generate", str(d / "a-*.parquet"), *GEN, "-o", f"s3://{out}"]) == 0
    # what a crashed writer leaves: an uncommitted part under _dspine/staging and a stray key file
    s3.put_file(str(next(iter(sorted(Path(tmp_path).glob("in/a-0.parquet"))))), f"{out}/_dspine/staging/"
                "train-00000-of-00001-000099.parquet.deadbeef")
    want = 2 * N
    # pyarrow through fsspec and through its own S3 client, pandas, polars, duckdb, datasets: in a process of their
    # own (foreign_readers.py says why). datasets' offline mode refuses every remote path, s3:// included; the Hub
    # is pointed at a closed local port instead, so the readers still reach no address but 127.0.0.1
    hub = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    got = counts_elsewhere({"store": "s3", "prefix": out, "endpoint": s3env["AWS_ENDPOINT_URL"]}, env=hub)
    assert got == dict.fromkeys(["pyarrow+s3fs", "pyarrow-s3", "pandas", "polars", "duckdb", "datasets"], want)


def test_bad_places_are_one_line_each(tmp_path, s3, s3env, s3_endpoint, bucket, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in prompts(5)))

    def err(args: list[str], env: dict[str, str] | None = None, code: int | None = None) -> str:
        capsys.readouterr()
        rc = run_cli(args, env)
        e = capsys.readouterr().err.strip()
        assert rc == (code if code is not None else rc) and rc != 0, (rc, e)
        assert "Traceback" not in e and len(e.splitlines()) == 1, e
        return e

    e = err(["generate", str(src), "-o", "s3://no-such-bucket-here/out"], code=1)
    assert "no such bucket" in e
    proxy = FaultProxy(s3_endpoint, mode="deny")
    try:
        e = err(["generate", str(src), "-o", f"s3://{bucket}/denied"], {"AWS_ENDPOINT_URL": proxy.url}, code=1)
        assert "access denied" in e and "403" in e
    finally:
        proxy.close()
    assert not s3.exists(f"{bucket}/denied/_manifest.json")  # nothing half-committed
    e = err(["generate", str(src), "-o", "hf://datasets/me/out"], code=2)
    assert "cannot be an output directory" in e and "create-if-absent" in e
    e = err(["generate", "nosuchscheme://x/in.jsonl", "-o", str(tmp_path / "o")], code=2)
    assert "unknown URL scheme" in e
    e = err(["generate", f"s3://{bucket}/missing.jsonl", "-o", str(tmp_path / "o2")], code=2)
    assert "no such file" in e
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_no_secret_in_any_log_manifest_state_or_report(tmp_path, s3, s3env, bucket, capsys):
    secret, opt_secret, url_secret = "SECRETinENV0001", "SECRETinOPT0002", "SECRETinURL0003"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in prompts(12)))
    env = {"AWS_SECRET_ACCESS_KEY": secret}
    out = f"s3://{bucket}/sec"
    capsys.readouterr()
    opt = f"client_kwargs.aws_session_token={opt_secret}"
    assert run_cli(["generate", str(src), "-o", out, "--storage-option", opt, "--commit-rows", "5"], env) == 0
    assert run_cli(["status", out], env) == 0
    assert run_cli(["report", out], env) == 0
    # a URL with a password in it, and a signed query string: refused, and the line shows neither
    assert run_cli(["generate", f"s3://AKIA:{url_secret}@{bucket}/x.jsonl?X-Amz-Signature={url_secret}", "-o",
                    str(tmp_path / "o")], env) != 0
    assert run_cli(["generate", str(src), "-o", f"https://u:{url_secret}@example.invalid/out"], env) != 0
    logs = capsys.readouterr()
    stored = b"".join(s3.cat_file(p) for p in s3.find(f"{bucket}/sec") if not p.endswith(".parquet"))
    for s in (secret, opt_secret, url_secret):
        assert s not in logs.out and s not in logs.err
        assert s.encode() not in stored
    assert "***" in logs.err


def test_default_part_size_is_the_outdirs_own(tmp_path, s3, bucket):
    """Without --commit-rows a local OUTDIR commits every 1,000 rows and an object store every 10,000 (a part
    there costs requests and a GET on every resume); a given --commit-rows is taken as given on both."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(prompts(2500)), src)
    fast = ["--engine-arg", "zero_cost=1", "--commit-seconds", "3600"]
    assert run_cli(["generate", str(src), *fast, "-o", str(tmp_path / "local")]) == 0
    assert len(list((tmp_path / "local").glob("*.parquet"))) == 3  # 1000 + 1000 + 500
    assert run_cli(["generate", str(src), *fast, "-o", f"s3://{bucket}/one"]) == 0
    assert len(s3.glob(f"{bucket}/one/*.parquet")) == 1
    assert run_cli(["generate", str(src), *fast, "--commit-rows", "1000", "-o", f"s3://{bucket}/three"]) == 0
    assert len(s3.glob(f"{bucket}/three/*.parquet")) == 3


@pytest.fixture
def methods_seen(s3env, s3_endpoint, monkeypatch):
    """The method of every request this process sends to S3 from here on (through a proxy that only counts)."""
    from dspine_batch.storage import fs

    seen: list[bytes] = []

    def hook(chunk: bytes) -> bool:
        seen.append(chunk.split(b" ", 1)[0])
        return False

    proxy = FaultProxy(s3_endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    fs.set_options({})
    yield seen
    proxy.close()


def test_small_objects_are_read_with_one_get_each(bucket, methods_seen):
    """A commit record, the manifest or a batch of records is one GET an object, no HEAD before it (s3fs asks an
    object's size first unless told not to): a resume or a finalize reads every record, and on a real store each
    request is tens of milliseconds."""
    from dspine_batch.storage.objects import ObjectStore

    store = ObjectStore(f"s3://{bucket}/out")
    for i in range(3):
        store.put(f"_dspine/keys/r{i}.json", b"{}")
    methods_seen.clear()
    got = store.cat_many([store.path(f"_dspine/keys/r{i}.json") for i in range(3)] + [store.path("missing")])
    assert got == {**{store.path(f"_dspine/keys/r{i}.json"): b"{}" for i in range(3)}, store.path("missing"): None}
    assert store.get("_dspine/keys/r0.json") == b"{}"
    assert sorted(methods_seen) == [b"GET"] * 5, methods_seen


def test_a_part_is_read_with_one_head(bucket, s3, methods_seen):
    """``read_part`` (a resume's parents, a finalize's checks, the tallies of a lagging state) asks an object's size
    once: pyarrow handed the filesystem asked for its info and opened it twice, five HEADs a part."""
    from dspine_batch.outdir.output import read_part

    with s3.open(f"{bucket}/out/train-00000-of-00001-000001.parquet", "wb") as f:
        pq.write_table(pa.table({"row_id": ["a", "b"], "kept": [True, False], "extra": [1, 2]}), f)
    url = f"s3://{bucket}/out/train-00000-of-00001-000001.parquet"
    t = read_part(url, ["row_id"], ("kept", "missing"))
    assert t.column_names == ["row_id", "kept"] and t.column("row_id").to_pylist() == ["a", "b"]
    assert methods_seen.count(b"HEAD") == 1 and set(methods_seen) == {b"HEAD", b"GET"}, methods_seen
