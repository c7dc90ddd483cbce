"""Readers we did not write, counting the rows under an object-store OUTDIR — run as a process of its own.

Why a process: these readers bring native clients with threads of their own (pyarrow's AWS SDK, polars' Rust
runtime, duckdb calling back into Python from its worker threads); kept out of the test process, none of them can
outlive its test there, and a crash in one is this process's exit status, named, not the whole suite's.

    python foreign_readers.py '{"store": "s3", "prefix": "bucket/out", "endpoint": "http://127.0.0.1:PORT"}'
    python foreign_readers.py '{"store": "az", "prefix": "container/out", "conn": "DefaultEndpointsProtocol=…"}'

Prints one JSON object: reader name → rows it counted.
"""

from __future__ import annotations

import json
import sys
import tempfile


def s3_counts(prefix: str, ep: str) -> dict[str, int]:
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=ep, skip_instance_cache=True, use_listings_cache=False)
    opts = {"endpoint_url": ep, "key": "testing", "secret": "testing"}
    native = pafs.S3FileSystem(endpoint_override=ep, scheme="http", access_key="testing", secret_key="testing",
                               region="us-east-1")
    popts = {"aws_endpoint_url": ep, "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
             "aws_region": "us-east-1", "aws_allow_http": "true"}
    out = {
        "pyarrow+s3fs": ds.dataset(f"{prefix}/", filesystem=fs, format="parquet").count_rows(),
        "pyarrow-s3": ds.dataset(f"{prefix}/", filesystem=native, format="parquet").count_rows(),
        "pandas": len(pd.read_parquet(f"s3://{prefix}/", storage_options=opts)),
        "polars": pl.scan_parquet(f"s3://{prefix}/*.parquet", storage_options=popts).select(pl.len()).collect()
        .item(),
    }
    con = duckdb.connect()
    con.register_filesystem(fs)  # fsspec: no httpfs extension download needed
    out["duckdb"] = con.execute(f"select count(*) from read_parquet('s3://{prefix}/*.parquet')").fetchall()[0][0]
    con.close()
    import datasets

    # datasets' offline mode refuses every remote path, s3:// included; the caller points the Hub at a closed
    # local port instead, so this still reaches no address but 127.0.0.1
    with tempfile.TemporaryDirectory() as cache:
        dset = datasets.load_dataset("parquet", data_files=f"s3://{prefix}/*.parquet", storage_options=opts,
                                     split="train", cache_dir=cache)
        out["datasets"] = dset.num_rows
    return out


def az_counts(prefix: str, conn: str) -> dict[str, int]:
    import adlfs
    import duckdb
    import pandas as pd
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    fs = adlfs.AzureBlobFileSystem(connection_string=conn, skip_instance_cache=True)
    out = {
        "pyarrow+adlfs": ds.dataset(f"{prefix}/", filesystem=fs, format="parquet").count_rows(),
        "parquet-footers": sum(pq.ParquetFile(f, filesystem=fs).metadata.num_rows
                               for f in fs.glob(f"{prefix}/*.parquet")),
        "pandas": len(pd.read_parquet(f"abfs://{prefix}/", storage_options={"connection_string": conn})),
    }
    con = duckdb.connect()
    con.register_filesystem(fs)  # fsspec: no azure extension download needed
    out["duckdb"] = con.execute(f"select count(*) from read_parquet('abfs://{prefix}/*.parquet')").fetchall()[0][0]
    con.close()
    return out


def counts_elsewhere(spec: dict, env: dict[str, str] | None = None, timeout: float = 300) -> dict[str, int]:
    """Run this file on ``spec`` in a fresh interpreter (``env`` over this process's environment)."""
    import os
    import subprocess

    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"the readers' process exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable(all_threads=True)
    spec = json.loads(sys.argv[1])
    got = s3_counts(spec["prefix"], spec["endpoint"]) if spec["store"] == "s3" else az_counts(spec["prefix"],
                                                                                             spec["conn"])
    print(json.dumps(got))
