"""Real object-store servers on 127.0.0.1 for the object-store tests, no patched client, and nothing reaches any
other address. S3: moto's server mode (as s3fs's own suite uses), a fresh bucket per test; ``s3env`` is what a
process needs to talk to it (endpoint and dummy credentials), set in this process too. Azure Blob Storage: Azurite
(``scripts/ci/install_azurite.sh``), started as a subprocess for the session, a fresh container per test; ``azenv``
holds its connection string. Without Azurite the Azure tests skip, except under ``CI=true`` (or
``DSPINE_REQUIRE_AZURITE=1``, which ``scripts/ci/test.sh`` sets), where they fail."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

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


# -- Azure Blob Storage: Azurite ----------------------------------------------------------------------------------
# Azurite's well-known development account (published in Azurite's README; it only opens the local emulator)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _in_ci() -> bool:
    """``CI=true`` (what CI services set), or ``DSPINE_REQUIRE_AZURITE=1`` (what ``scripts/ci/test.sh`` sets)."""
    return any(os.environ.get(k, "").lower() not in ("", "0", "false", "no") for k in ("CI", "DSPINE_REQUIRE_AZURITE"))


def need(what: str, why: str) -> None:
    """Outside CI a missing test dependency skips; in CI (``CI=true``) it fails, so a machine that lost Azurite or
    adlfs cannot turn the Azure tests into silent skips."""
    if _in_ci():
        pytest.fail(f"{what} is missing in CI: {why}", pytrace=False)
    pytest.skip(f"{what} is missing: {why}")


def azurite_binary() -> str | None:
    """``$DSPINE_AZURITE``, else what ``scripts/ci/install_azurite.sh`` installed, else ``azurite-blob`` on PATH."""
    if os.environ.get("DSPINE_AZURITE"):
        return os.environ["DSPINE_AZURITE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    default = Path(os.environ.get("AZURITE_DIR") or Path(cache) / "dspine-batch" / "azurite")
    local = default / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


def azurite_connection_string(endpoint: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")


@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An Azurite blob server on 127.0.0.1 (a port the OS picks), in memory, for the whole session; stopped at
    the end. ``http://127.0.0.1:PORT`` (the account is the path's first segment)."""
    for module in ("adlfs", "azure.storage.blob"):
        if importlib.util.find_spec(module) is None:
            need(module, "pip install -e '.[test]' (scripts/setup.sh) installs it")
    binary = azurite_binary()
    if binary is None:
        need("azurite", "bash scripts/ci/install_azurite.sh installs it (Node.js and npm needed)")
    work = tmp_path_factory.mktemp("azurite")
    log = work / "azurite.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
                                 "--extentMemoryLimit", "1024", "--skipApiVersionCheck", "--loose", "--silent",
                                 "--disableTelemetry"], cwd=work, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            m = re.search(r"listens on http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
            if m:
                port = int(m.group(1))
            elif proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"azurite did not start: {log.read_text(errors='replace')[-2000:]}", pytrace=False)
            else:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def azenv(azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What a process needs to talk to Azurite (a connection string, as a user would set it), set here too."""
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(azurite_endpoint),
           "DSPINE_BATCH_LEASE_SECONDS": "4", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in list(os.environ):
        if k.startswith("AZURE_") and k not in env:
            monkeypatch.delenv(k)
    for k in ("DSPINE_BATCH_STORAGE_OPTIONS", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    from dspine_batch.storage import fs

    fs.set_options({})
    return env


@pytest.fixture
def container(azenv: dict[str, str]) -> str:
    """A fresh container on Azurite; its name."""
    from azure.storage.blob import BlobServiceClient

    name = f"t-{uuid.uuid4().hex[:12]}"
    BlobServiceClient.from_connection_string(azenv["AZURE_STORAGE_CONNECTION_STRING"]).create_container(name)
    return name


@pytest.fixture
def az(azenv: dict[str, str]):
    """A plain adlfs filesystem on Azurite (no listings cache), for the tests' own uploads and reads."""
    import adlfs

    return adlfs.AzureBlobFileSystem(connection_string=azenv["AZURE_STORAGE_CONNECTION_STRING"],
                                     skip_instance_cache=True, use_listings_cache=False)
