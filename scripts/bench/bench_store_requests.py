#!/usr/bin/env python
"""Requests an object-store OUTDIR costs, counted by the server: one ``dspine-batch generate`` into ``s3://`` on a
local S3 server (moto's server mode, its request recorder on), then the same command again (a resume with nothing
left), for each checkout given, alternating, with repeats. Prints requests per committed part by kind (PUT, GET,
HEAD, COPY, batched DELETE, LIST) and those of the resume, per tree: what the commit protocol asks of a store,
independent of the machine's speed and load.

``--dedup exact|minhash``: instead, a one-stage job deduplicating its input's ``text`` (half the rows repeat an
earlier text) run as ``--shards`` shards at once, each its own process; prints every request and those of the
dedup itself (objects under the stage's ``_dspine/dedup/`` or ``_dspine/minhash/``: claims before issue 56, the
key log after), the bytes they carried (PUT bodies; GETs as the size of the object read), and both per 1M rows.

Usage:
    python scripts/bench/bench_store_requests.py --trees /path/to/base /path/to/new --rows 20000 --repeats 2
    python scripts/bench/bench_store_requests.py --trees /path/to/new --dedup exact --shards 2 --rows 100000
    python scripts/bench/bench_store_requests.py --trees /path/to/new --dedup minhash --shards 4 --rows 100000 \
        --commit-seconds 600
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_objstore import BUCKET, start_moto  # noqa: E402
from bench_pipeline import make_input  # noqa: E402


def kind(req: dict) -> str:
    method, url = req.get("method", "?"), req.get("url", "")
    headers = {k.lower(): v for k, v in (req.get("headers") or {}).items()}
    if method == "PUT" and "x-amz-copy-source" in headers:
        return "COPY"
    if method == "POST" and "delete" in url.split("?", 1)[-1]:
        return "DELETE(batch)"
    if method == "GET" and ("list-type" in url or url.rstrip("/").endswith(BUCKET) or "prefix=" in url):
        return "LIST"
    return method


def _records(text: str) -> list[dict]:
    """The recorder's entries: JSON objects one after another (not always one a line)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
    return out


def counted(tree: str, src: Path, rows: int, commit_rows: int, tag: str, endpoint: str, rec: Path) -> dict:
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "dspine_batch.cli", "generate", str(src), "-o", f"s3://{BUCKET}/{tag}", "--engine",
           "scripted", "--engine-arg", "zero_cost=1", "--raw", "--max-in-flight", "1024", "--progress", "none",
           "--commit-rows", str(commit_rows)]
    out = {}
    for step in ("run", "resume"):
        rec.write_text("")
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/start-recording", method="POST"))
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tree)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/stop-recording", method="POST"))
        kinds = collections.Counter(kind(r) for r in _records(rec.read_text()))
        out[step] = dict(sorted(kinds.items()))
    parts = -(-rows // commit_rows)
    out["parts"] = parts
    out["per_part"] = round(sum(out["run"].values()) / parts, 2)
    out["resume_total"] = sum(out["resume"].values())
    return out


def dedup_input(path: Path, rows: int) -> None:
    """``rows`` rows, ``doc_id`` and ``text``; row i's text is text number i mod rows/2 (16 words of its own)."""
    import random

    distinct = max(rows // 2, 1)
    with path.open("w") as f:
        for i in range(rows):
            rng = random.Random(i % distinct)
            f.write(json.dumps({"doc_id": f"d{i}", "text": " ".join(f"w{rng.randrange(5000)}" for _ in range(16))})
                    + "\n")


def dedup_counted(tree: str, src: Path, rows: int, dedup: str, shards: int, tag: str, endpoint: str, rec: Path,
                  s3, commit_seconds: float | None = None) -> dict:
    """One sharded dedup job, every request it made counted at the server, and those of the dedup alone."""
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=tree)
    job = src.parent / f"job-{tag}.toml"
    job.write_text(f'''inputs = ["{src}"]
output = "s3://{BUCKET}/{tag}"
id-column = "doc_id"
max-new-tokens = 4
[[stages]]
name = "notes"
template = "{{{{ text }}}}"
dedup = "{dedup}"
dedup-on = "text"
''')
    space = "dedup" if dedup == "exact" else "minhash"
    rec.write_text("")
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/start-recording", method="POST"))
    procs = [subprocess.Popen([sys.executable, "-m", "dspine_batch.cli", "generate", "--config", str(job), "--engine",
                               "scripted", "--engine-arg", "zero_cost=1", "--raw", "--max-in-flight", "1024",
                               "--progress", "none", "--shard", f"{i}/{shards}",
                               *(["--commit-seconds", str(commit_seconds)] if commit_seconds else [])],
                              env=env, stderr=subprocess.PIPE, cwd=tree)
             for i in range(shards)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(err.decode()[-2000:])
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/stop-recording", method="POST"))
    sizes = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{tag}/"):
        sizes.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    marker = f"/{tag}/notes/_dspine/{space}/"
    total, ours = collections.Counter(), collections.Counter()
    put_bytes = get_bytes = 0
    for r in _records(rec.read_text()):
        k = kind(r)
        total[k] += 1
        path = r.get("url", "").split("?", 1)[0]
        if marker not in path:
            continue
        ours[k] += 1
        headers = {h.lower(): v for h, v in (r.get("headers") or {}).items()}
        if k == "PUT":
            put_bytes += int(headers.get("content-length") or 0)
        elif k == "GET":
            get_bytes += sizes.get(path.split(f"/{BUCKET}/", 1)[-1], 0)
    n_dedup = sum(ours.values())
    parts = sum(1 for key in sizes if key.startswith(f"{tag}/notes/") and key.endswith(".parquet"))
    return {"dedup": dedup, "shards": shards, "all": dict(sorted(total.items())), "dedup_requests": dict(ours),
            "dedup_total": n_dedup, "parts": parts, "dedup_per_part": round(n_dedup / max(parts, 1), 2),
            "dedup_put_bytes": put_bytes, "dedup_get_bytes": get_bytes,
            "dedup_per_1M_rows": round(n_dedup * 1_000_000 / rows),
            "dedup_bytes_per_1M_rows": round((put_bytes + get_bytes) * 1_000_000 / rows),
            "all_per_1M_rows": round(sum(total.values()) * 1_000_000 / rows),
            "log_objects": sum(1 for key in sizes if f"/_dspine/{space}/" in f"/{key}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[str(ROOT)], help="checkouts whose dspine_batch to run")
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--commit-rows", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dedup", choices=("exact", "minhash"), default=None, help="count a sharded dedup job instead")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--commit-seconds", type=float, default=None,
                    help="--dedup: the jobs' --commit-seconds (default the tool's: a slow stage's parts end by time)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_requests_"))
    rec = tmp / "recording.jsonl"
    os.environ.update(MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=str(rec))
    moto, endpoint = start_moto()
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        if a.dedup is not None:
            s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1")
            src = tmp / "in.jsonl"
            dedup_input(src, a.rows)
            runs = []
            for r in range(a.repeats):
                for i, tree in enumerate(a.trees):  # alternating
                    got = dedup_counted(tree, src, a.rows, a.dedup, a.shards, f"d{i}-r{r}", endpoint, rec, s3,
                                        a.commit_seconds)
                    runs.append({"tree": tree, **got})
                    print(f"{tree} #{r}: {got['dedup_total']} dedup requests, {got['dedup_per_1M_rows']:,} per 1M "
                          f"rows", file=sys.stderr)
            print(json.dumps({"rows": a.rows, "runs": runs}, indent=1))
            return
        src = tmp / "in.parquet"
        make_input(src, a.rows)
        report: dict = {"rows": a.rows, "commit_rows": a.commit_rows, "runs": []}
        for r in range(a.repeats):
            for i, tree in enumerate(a.trees):  # alternating
                got = counted(tree, src, a.rows, a.commit_rows, f"t{i}-r{r}", endpoint, rec)
                report["runs"].append({"tree": tree, **got})
                print(f"{tree} #{r}: {got['per_part']} requests a part, resume {got['resume_total']}", file=sys.stderr)
        print(json.dumps(report, indent=1))
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
