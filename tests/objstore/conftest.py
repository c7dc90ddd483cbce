"""A real S3 HTTP server on 127.0.0.1 for the object-store tests (moto's server mode, as s3fs's own suite uses):
no patched client, and nothing reaches any other address. One server per test session, a fresh bucket per test;
``s3env`` is what a process needs to talk to it (endpoint and dummy credentials), set in this process too."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

moto_server = pytest.importorskip("moto.server")
pytest.importorskip("s3fs")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "DSPINE_BATCH_LEASE_SECONDS": "4",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "DSPINE_BATCH_STORAGE_OPTIONS", "HTTP_PROXY", "HTTPS_PROXY",
              "http_proxy", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    from dspine_batch.storage import fs

    fs.set_options({})
    return env


@pytest.fixture
def bucket(s3env: dict[str, str]) -> str:
    """A fresh bucket on the test server; its name."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3(s3env: dict[str, str]):
    """A plain s3fs filesystem on the test server, for the tests' own uploads and reads."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3env["AWS_ENDPOINT_URL"], skip_instance_cache=True,
                             use_listings_cache=False)
