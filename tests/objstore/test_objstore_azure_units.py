"""The Azure Blob Storage primitives behind ``ObjectStore`` (``storage.azure``), against a real Azurite on 127.0.0.1
(``conftest``): create-only writes race with exactly one winner, a compare-and-swap with a stale ETag is refused,
server-side copies, batched deletes, listings with sizes and ETags, one line for a missing container or a 403;
and the rules around them that need no server (schemes accepted as OUTDIR, errors classified, secrets redacted)."""

from __future__ import annotations

import threading

import pytest
from faultproxy import FaultProxy

from dspine_batch.errors import FatalError
from dspine_batch.storage.fs import permanent, transient
from dspine_batch.storage.objects import ObjectStore, check_outdir_url
from dspine_batch.storage.urls import redact


def test_create_only_has_one_winner_and_cas_refuses_a_stale_etag(container):
    store = ObjectStore(f"az://{container}/p")
    assert store.create("a.json", b"first") and not store.create("a.json", b"second")
    assert store.get("a.json") == b"first"
    # many writers racing for one name: exactly one wins (If-None-Match: *)
    wins: list[int] = []
    barrier = threading.Barrier(6)

    def race(i: int) -> None:
        barrier.wait()
        if store.create("race.json", str(i).encode()):
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and store.get("race.json") == str(wins[0]).encode()
    # compare-and-swap
    body, etag = store.get_with_etag("a.json")
    assert body == b"first" and etag.startswith('"')
    new = store.replace("a.json", b"v2", etag)
    assert new and new != etag and store.get("a.json") == b"v2"
    assert store.replace("a.json", b"v3", etag) is None  # stale: refused, nothing written
    assert store.get("a.json") == b"v2"
    assert store.replace("gone.json", b"x", etag) is None  # absent: refused too
    assert store.get_with_etag("gone.json") is None and store.head("gone.json") is None
    created = store.create_etag("b.json", b"12345")
    assert created and store.head("b.json") == {"size": 5, "etag": created}
    assert store.create_etag("b.json", b"x") is None


def test_copy_delete_many_and_listing(container):
    store = ObjectStore(f"az://{container}/p")
    store.put("_dspine/staging/x.1", b"part-bytes")
    store.copy("_dspine/staging/x.1", "train-x.parquet", 10)
    assert store.get("train-x.parquet") == b"part-bytes"
    store.copy("_dspine/staging/x.1", "train-x.parquet")  # again: idempotent overwrite
    listed = store.list("")
    assert set(listed) == {"train-x.parquet"} and listed["train-x.parquet"].size == 10
    assert listed["train-x.parquet"].etag
    assert sorted(store.names("")) == ["_dspine", "train-x.parquet"]
    with pytest.raises(FileNotFoundError):
        store.copy("_dspine/staging/missing", "train-y.parquet")
    rels = [f"_dspine/staging/k{i}" for i in range(300)]  # more than one Blob Batch (256)
    for r in rels[:5]:
        store.put(r, b"1")
    store.delete_many(rels + ["_dspine/staging/x.1"])
    assert store.list("_dspine/staging") == {}
    store.delete("train-x.parquet")
    store.delete("train-x.parquet")  # absent: fine
    assert store.list("") == {}
    store.put("a", b"A")
    assert store.cat_many([store.path("a"), store.path("missing")]) == {store.path("a"): b"A",
                                                                         store.path("missing"): None}


def test_missing_container_and_403_are_one_line(azenv, azurite_endpoint, container, monkeypatch):
    with pytest.raises(FatalError, match="no such container") as e:
        ObjectStore("az://no-such-container/out").check_bucket()
    assert len(str(e.value).splitlines()) == 1
    ObjectStore(f"az://{container}/out").check_bucket()
    proxy = FaultProxy(azurite_endpoint, mode="deny")
    try:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                           azenv["AZURE_STORAGE_CONNECTION_STRING"].replace(azurite_endpoint, proxy.url))
        from dspine_batch.storage import fs

        fs.set_options({})
        with pytest.raises(FatalError, match="access denied") as e:
            ObjectStore(f"az://{container}/out").check_bucket()
        assert "403" in str(e.value) and len(str(e.value).splitlines()) == 1
    finally:
        proxy.close()


def test_azure_schemes_are_outdirs_gcs_still_refused():
    for url in ("az://c/out", "abfs://c/out", "abfss://c@acct.dfs.core.windows.net/out"):
        check_outdir_url(url)
    with pytest.raises(Exception, match="not implemented yet"):
        check_outdir_url("gs://b/out")


def test_azure_errors_are_classified():
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError

    def http(status: int, message: str) -> HttpResponseError:
        e = HttpResponseError(message=message)
        e.status_code = status
        return e

    assert transient(http(503, "The server is busy. ErrorCode:ServerBusy"))
    assert transient(http(500, "InternalError")) and transient(http(429, "Too many requests"))
    assert transient(ServiceRequestError("Connection refused")) and transient(ServiceResponseError("reset"))
    assert not transient(http(403, "This request is not authorized. ErrorCode:AuthorizationFailure"))
    assert not transient(http(404, "The specified container does not exist. ErrorCode:ContainerNotFound"))
    assert "access denied" in str(permanent(http(403, "AuthorizationFailure"), "az://c/o"))
    assert "no such container" in str(permanent(http(404, "The specified container does not exist."), "az://c/o"))


@pytest.mark.parametrize("text, secret", [
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=S3CRETkey+/==;EndpointSuffix=core.windows.net",
     "S3CRETkey"),
    ("BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=2024&sig=S3CRETsig", "S3CRETsig"),
    ("not accepted by AzureBlobFileSystem ({'account_key': 'S3CRETopt'})", "S3CRETopt"),
    ("--storage-option account_key=S3CRETopt2", "S3CRETopt2"),
    ("https://acct.blob.core.windows.net/c/b?sv=2024-01-01&se=2026&sp=r&sig=S3CRETurl", "S3CRETurl"),
])
def test_redact_hides_azure_keys_sas_and_connection_strings(text, secret):
    out = redact(text)
    assert secret not in out and "***" in out
