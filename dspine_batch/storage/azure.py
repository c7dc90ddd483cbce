"""The primitives of an exactly-once OUTDIR (``primitives.Primitives``) on Azure Blob Storage
(``az://container/prefix``, ``abfs://``, ``abfss://``), through azure-storage-blob's synchronous clients.

Blob Storage has what the commit protocol needs, under its own names: Put Blob with ``If-None-Match: *``
(``upload_blob(overwrite=False)``: the loser of a race gets 409 BlobAlreadyExists), conditional Put Blob and Get
Blob (``etag=..., match_condition=MatchConditions.IfNotModified``: 412 ConditionNotMet when the ETag is stale),
Copy Blob (server-side; within one account it completes at once on Azurite and usually on Azure, else we poll its
status until it does), Blob Batch deletes (256 a request) and strongly consistent listings. Every request of the
commit protocol and the lease goes through our client; only ``ObjectStore.open`` (reading a part back) and the
readers users point at OUTDIR go through adlfs.

Why a client of our own and not adlfs's: adlfs holds an *async* client whose retry policy cannot be set (the
SDK's default backs off 15 s and more after one 503), and it turns errors into ``OSError``s that lose the
difference between "already exists", "precondition failed" and "no such container"; the protocol needs all three.
Ours is built from the credentials adlfs resolved (``--storage-option account_name=... account_key=...``,
``connection_string=...``, ``sas_token=...``, or ``AZURE_STORAGE_CONNECTION_STRING``,
``AZURE_STORAGE_ACCOUNT_NAME``/``_KEY``, ``AZURE_STORAGE_SAS_TOKEN``, azure-identity's default chain otherwise),
so both talk to the same account as the same principal; its own retries are few and short, under
``fs.retrying``'s.

Answers become what ``fs.retrying`` and the callers branch on: 404 BlobNotFound -> ``FileNotFoundError``,
409 BlobAlreadyExists and 412 -> ``FileExistsError``, ContainerNotFound -> one line (``FatalError``); 403, 5xx,
429 and dropped connections pass through to ``fs.transient``/``fs.permanent`` unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dspine_batch.errors import FatalError, UsageError
from dspine_batch.storage.fs import retrying, store_errors
from dspine_batch.storage.primitives import Listed, RemotePrimitives

T = TypeVar("T")
BATCH = 256  # Blob Batch: at most 256 sub-requests a batch
CONCURRENCY = 16  # Get Blob requests in flight for ``cat_many`` (the commit records a resume reads)
COPY_WAIT_S = 600.0  # a pending server-side copy (cross-region, or a busy account): how long we poll it
_ATTR = "_dspine_blob_service"  # our client, kept on the adlfs filesystem it mirrors (and dropped with it)
_BUILD = threading.Lock()  # the committer's threads may ask for the client at once: build it once


class CopyFailed(ConnectionError):
    """A server-side copy the store reported ``failed`` or ``aborted``: transient (``fs.transient`` retries a
    ``ConnectionError``), as copying the same committed source again is idempotent."""


def service_client(fs: Any) -> Any:
    """A synchronous ``BlobServiceClient`` for the account and credentials the adlfs filesystem ``fs`` uses; one
    per filesystem (the SDK's clients are thread-safe and keep a connection pool). Kept on the instance, not in a
    dict keyed by it: fsspec filesystems compare equal by their arguments, and two with the same arguments may
    hold different credentials (read from the environment when built)."""
    with _BUILD:
        client = fs.__dict__.get(_ATTR)
        if client is None:
            client = fs.__dict__[_ATTR] = _build(fs)
        return client


def _build(fs: Any) -> Any:
    """The client itself: a connection string first, else the account with adlfs's credential, key or SAS (the
    order adlfs connects in), else azure-identity's default chain."""
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.storage.blob import BlobServiceClient, ExponentialRetry

    kw: dict[str, Any] = {"retry_policy": ExponentialRetry(initial_backoff=0.5, increment_base=2, retry_total=2,
                                                           random_jitter_range=1),
                          "connection_timeout": 10, "read_timeout": 60}
    conn = getattr(fs, "connection_string", None)
    if conn:
        client = BlobServiceClient.from_connection_string(conn, **kw)
    else:
        name = getattr(fs, "account_name", None)
        if not name:
            raise UsageError("az://: which storage account? Set AZURE_STORAGE_CONNECTION_STRING, or "
                             "AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or "
                             "an Azure login), or pass --storage-option account_name=...")
        host = getattr(fs, "account_host", None) or f"{name}.blob.core.windows.net"
        url = host if "://" in host else f"https://{host}"
        credential: Any = None
        sas = getattr(fs, "sas_token", None)
        if getattr(fs, "sync_credential", None) is not None:  # adlfs built a DefaultAzureCredential pair
            credential = fs.sync_credential
        elif getattr(fs, "account_key", None):
            credential = AzureNamedKeyCredential(name, fs.account_key)
        elif sas:
            url += sas if sas.startswith("?") else f"?{sas}"
        elif not getattr(fs, "anon", False):
            from azure.identity import DefaultAzureCredential

            credential = DefaultAzureCredential()
        client = BlobServiceClient(url, credential=credential, **kw)
    return client


def _answer(call: Callable[[], T], container: str, what: str) -> T:
    """``call()`` with Azure's answers turned into the exceptions the store-neutral code branches on."""
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

    try:
        return call()
    except ResourceNotFoundError as e:
        if _code(e) == "ContainerNotFound":
            raise FatalError(f"{what}: no such container ({container}); create it first or fix the URL") from None
        raise FileNotFoundError(what) from e
    except ResourceModifiedError as e:  # 412 ConditionNotMet
        raise FileExistsError(f"{what}: changed (412)") from e
    except ResourceExistsError as e:
        if _code(e) in ("BlobAlreadyExists", "ContainerAlreadyExists") or getattr(e, "status_code", None) == 412:
            raise FileExistsError(f"{what}: already exists") from e
        raise  # another 409 (a lease or a pending copy on the blob): transient, retried


def _code(e: BaseException) -> str:
    code = getattr(e, "error_code", None)
    return str(getattr(code, "value", code) or "")


def _quoted(etag: str | None) -> str | None:
    """ETags as the store sends them in headers (``"0x8D..."``): listings give them bare."""
    if not etag:
        return etag
    return etag if etag.startswith('"') else f'"{etag}"'


class AzurePrimitives(RemotePrimitives):
    """The requests on one Azure Blob Storage prefix (``fs`` an adlfs filesystem, used for its path rules and its
    resolved credentials; ``path``/``url_of`` the store's naming of a name relative to the prefix)."""

    def __init__(self, fs: Any, path: Callable[[str], str], url_of: Callable[[str], str], display: str):
        self.fs, self.path, self.url_of, self.display = fs, path, url_of, display
        self._service: Any = None

    @property
    def service(self) -> Any:
        if self._service is None:
            with store_errors(self.display):
                self._service = service_client(self.fs)
        return self._service

    def _split(self, rel: str) -> tuple[str, str]:
        container, key, _ = self.fs.split_path(self.path(rel))
        return container, key

    def _blob(self, rel: str) -> tuple[Any, str]:
        container, key = self._split(rel)
        return self.service.get_blob_client(container, key), container

    def _run(self, rel: str, call: Callable[[Any], T]) -> T:
        """``call(blob_client)`` with answers translated and transient failures retried."""
        blob, container = self._blob(rel)
        what = self.url_of(rel)
        return retrying(lambda: _answer(lambda: call(blob), container, what), what)

    # -- reads and plain writes ----------------------------------------------------------------------------------
    def get(self, rel: str) -> bytes | None:
        try:
            return self._run(rel, lambda b: b.download_blob().readall())
        except FileNotFoundError:
            return None

    def _walk(self, rel: str) -> list[Any]:
        """One listing of what is directly under ``rel``: blobs and the "directories" (``BlobPrefix``) above
        deeper ones."""
        container, key = self._split(rel)
        client = self.service.get_container_client(container)
        start = f"{key.rstrip('/')}/" if key else ""
        what = self.url_of(rel)
        return retrying(lambda: _answer(lambda: list(client.walk_blobs(name_starts_with=start, delimiter="/",
                                                                       include=["metadata"])), container, what),
                        what)

    def names(self, rel: str) -> list[str]:
        return [item.name.rstrip("/").rsplit("/", 1)[-1] for item in self._walk(rel)]

    def list(self, rel: str) -> dict[str, Listed]:
        """Blobs only: ``BlobPrefix`` entries and the empty folder markers of a hierarchical-namespace account
        (``hdi_isfolder``) are "directories"."""
        out = {}
        for item in self._walk(rel):
            if item.name.endswith("/") or not hasattr(item, "size"):
                continue
            if str((getattr(item, "metadata", None) or {}).get("hdi_isfolder", "")).lower() == "true":
                continue
            name = item.name.rsplit("/", 1)[-1]
            out[name] = Listed(name, int(item.size or 0), _quoted(item.etag))
        return out

    def cat_many(self, paths: list[str]) -> dict[str, bytes | None]:
        """One Get Blob each, ``CONCURRENCY`` at a time (each retried on its own)."""
        def one(path: str) -> bytes | None:
            container, key, _ = self.fs.split_path(path)
            blob = self.service.get_blob_client(container, key)
            what = f"{self.display}: {key}"
            try:
                return retrying(lambda: _answer(lambda: blob.download_blob().readall(), container, what), what)
            except FileNotFoundError:
                return None

        if not paths:
            return {}
        with ThreadPoolExecutor(min(CONCURRENCY, len(paths)), thread_name_prefix="dspine-az-get") as pool:
            return dict(zip(paths, pool.map(one, paths), strict=True))

    def put(self, rel: str, data: bytes, durable: bool = True) -> None:
        self._run(rel, lambda b: b.upload_blob(data, overwrite=True))

    def upload(self, local: str, rel: str) -> None:
        """Put Blob, or staged blocks above the SDK's single-put size (4 blocks in flight); a retry reopens the
        file and starts over (the staging name is unique, so a half-written attempt is never seen)."""
        def send(b: Any) -> None:
            with open(local, "rb") as f:
                b.upload_blob(f, overwrite=True, max_concurrency=4)

        self._run(rel, send)

    def delete(self, rel: str) -> None:
        try:
            self._run(rel, lambda b: b.delete_blob())
        except FileNotFoundError:
            pass

    # -- conditional requests -------------------------------------------------------------------------------------
    def head(self, rel: str) -> dict[str, Any] | None:
        try:
            props = self._run(rel, lambda b: b.get_blob_properties())
        except FileNotFoundError:
            return None
        return {"size": int(props.size), "etag": _quoted(props.etag)}

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """One Get Blob: the bytes and the ETag of exactly those bytes come in the same answer."""
        def read(b: Any) -> tuple[bytes, str]:
            stream = b.download_blob()
            return stream.readall(), stream.properties.etag

        try:
            data, etag = self._run(rel, read)
        except FileNotFoundError:
            return None
        return data, str(_quoted(etag))

    def create(self, rel: str, data: bytes, durable: bool = True, then: str = "") -> str | None:
        """Put Blob with ``If-None-Match: *``: the new ETag, None when the blob exists (409 BlobAlreadyExists)."""
        try:
            out = self._run(rel, lambda b: b.upload_blob(data, overwrite=False))
        except FileExistsError:
            return None
        return _quoted(out.get("etag")) or ""

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Put Blob with ``If-Match: etag``: the new ETag, None when the blob changed or is gone (412)."""
        from azure.core import MatchConditions

        try:
            out = self._run(rel, lambda b: b.upload_blob(data, overwrite=True, etag=etag,
                                                         match_condition=MatchConditions.IfNotModified))
        except (FileExistsError, FileNotFoundError):
            return None
        return _quoted(out.get("etag")) or ""

    def copy(self, src: str, dst: str, size: int | None = None) -> None:
        """Copy Blob from the source blob's URL (same account: authorised by our own credential) and wait until
        its status is ``success``; a failed or aborted copy raises (and is retried: copying again is idempotent,
        the record names the source). ``size`` is S3's concern (its single-copy limit); Copy Blob has none."""
        source, _ = self._blob(src)

        def start(b: Any) -> None:
            status = b.start_copy_from_url(source.url).get("copy_status")
            deadline = time.monotonic() + COPY_WAIT_S
            delay = 0.05
            while status == "pending":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server-side copy still pending after {COPY_WAIT_S:.0f}s")
                time.sleep(delay)
                delay = min(2.0, delay * 2)
                status = b.get_blob_properties().copy.status
            if status != "success":
                raise CopyFailed(f"server-side copy {status}")

        self._run(dst, start)

    def delete_many(self, rels: list[str]) -> None:
        """Blob Batch deletes, 256 blobs a request; an absent blob is fine, any other refusal raises."""
        container, _ = self._split(rels[0])
        keys = [self._split(r)[1] for r in rels]
        client = self.service.get_container_client(container)
        for i in range(0, len(keys), BATCH):
            chunk = keys[i:i + BATCH]
            retrying(lambda c=chunk: _answer(lambda: self._delete_batch(client, c), container, self.display),
                     self.url_of(rels[0]))

    @staticmethod
    def _delete_batch(client: Any, keys: list[str]) -> None:
        from azure.core.exceptions import HttpResponseError

        try:
            responses = list(client.delete_blobs(*keys, raise_on_any_failure=False))
        except HttpResponseError as e:
            if getattr(e, "status_code", None) not in (400, 405, 501):
                raise
            # the batch endpoint refused as such (an account or emulator without Blob Batch): one by one
            for key in keys:
                try:
                    client.delete_blob(key)
                except HttpResponseError as e2:
                    if getattr(e2, "status_code", None) != 404:
                        raise
            return
        for resp in responses:
            code = resp.status_code
            if code not in (200, 202, 404):
                err = HttpResponseError(message=f"batch delete: {code} {resp.reason or ''}".strip())
                err.status_code = code
                raise err

    def check_container(self) -> None:
        """Get Container Properties: one line for a missing container or a 403, before any work."""
        container, _ = self._split("x")
        client = self.service.get_container_client(container)
        with store_errors(self.display):
            retrying(lambda: _answer(client.get_container_properties, container, self.display), self.display)
