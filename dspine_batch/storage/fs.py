"""The fsspec filesystem behind a URL, opened with the job's storage options, and the errors it can raise
turned into what the CLI prints: retries with backoff for transient failures, one line for permanent ones.

Storage options are process-wide (set once by the CLI from ``--storage-option`` / the environment): every
reader, writer and op in one process talks to the same stores with the same settings, and threading a dict
through every function that may open a file would touch them all for nothing. Credentials are never taken
as arguments here: s3fs/gcsfs/adlfs find them in the standard places (environment, profile, instance
metadata), and ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` select an S3-compatible endpoint.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from dspine_batch.errors import FatalError, UsageError
from dspine_batch.storage.urls import AZURE_SCHEMES, EXTRAS, is_url, local_path, redact, scheme

T = TypeVar("T")
_OPTIONS: dict[str, Any] = {}
_CACHE: dict[str, Any] = {}
_CONFIGURED: list[bool] = []  # set_options called (the CLI); else the environment's options are used
RETRIES = 8  # our own attempts around each store call (the client retries too, see ``_defaults``)
_DEADLINE: ContextVar[float | None] = ContextVar("dspine_store_deadline", default=None)


def set_options(options: dict[str, Any]) -> None:
    """The storage options for every URL this process opens (``--storage-option``); drops opened filesystems."""
    _OPTIONS.clear()
    _OPTIONS.update(options)
    _CACHE.clear()
    _CONFIGURED[:] = [True]


def options() -> dict[str, Any]:
    return dict(_OPTIONS)


def _defaults(proto: str) -> dict[str, Any]:
    """Per-protocol defaults under the user's options: S3 gets botocore's "standard" retry mode (5xx, throttling
    and connection errors, with backoff) and an endpoint from ``AWS_ENDPOINT_URL[_S3]`` when set. Azure gets no
    listings cache (adlfs caches listings by default, and another worker's commit would stay unseen), and a fresh
    instance whenever ``set_options`` drops ours (adlfs reads ``AZURE_STORAGE_*`` when built, and fsspec's instance
    cache keys on arguments only: a changed connection string would meet the old instance)."""
    if proto in AZURE_SCHEMES:
        return {"use_listings_cache": False, "skip_instance_cache": True}
    if proto not in ("s3", "s3a"):
        return {}
    # no listings cache: a commit protocol must see the store as it is now, not as it was a listing ago
    retries = {"max_attempts": 6, "mode": "standard"}
    out: dict[str, Any] = {"use_listings_cache": False,
                           "config_kwargs": {"retries": retries, "connect_timeout": 10, "read_timeout": 60}}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["endpoint_url"] = endpoint
    return out


def need_library(url: str) -> None:
    """Refuse, in one line naming the extra, a scheme whose fsspec implementation is not installed, and a
    scheme fsspec does not know at all (never taken for a local path)."""
    proto = scheme(url)
    if proto is None:
        return
    try:
        import fsspec
    except ImportError:
        raise UsageError(f"{redact(url)}: reading or writing URLs needs fsspec: pip install 'dspine-batch[s3]'") \
            from None
    if proto in EXTRAS:
        module, extra = EXTRAS[proto]
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"{redact(url)}: {proto}:// needs the {module} package: pip install "
                             f"'dspine-batch[{extra}]'")
    if proto not in fsspec.available_protocols():
        raise UsageError(f"{redact(url)}: unknown URL scheme {proto}:// (fsspec knows no such filesystem; "
                         "for S3 use s3://, and pip install 'dspine-batch[s3]')")


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a URL or a local path."""
    import fsspec

    if not is_url(url):
        return fsspec.filesystem("file"), os.path.abspath(local_path(url))
    need_library(url)
    proto = scheme(url)
    assert proto is not None
    cls = fsspec.get_filesystem_class(proto)
    if not _CONFIGURED:  # used as a library: DSPINE_BATCH_STORAGE_OPTIONS still applies
        from dspine_batch.storage.urls import parse_options

        set_options(parse_options([]))
    if proto not in _CACHE:
        opts = _defaults(proto)
        for k, v in _OPTIONS.items():
            if isinstance(v, dict) and isinstance(opts.get(k), dict):
                opts[k] = {**opts[k], **v}
            else:
                opts[k] = v
        try:
            _CACHE[proto] = cls(**opts)
        except TypeError as e:
            raise UsageError(f"--storage-option: not accepted by {cls.__name__} ({redact(str(e))})") from None
        except ValueError as e:  # adlfs: no account, or a malformed connection string (its text is redacted)
            raise UsageError(f"{redact(url)}: cannot open {proto}:// with these credentials ({redact(str(e))[:200]}); "
                             "see --storage-option and the store's environment variables (docs/cloud.md)") from None
    path = cls._strip_protocol(url)
    return _CACHE[proto], path.rstrip("/") if isinstance(path, str) else path


def _status(e: BaseException) -> int | None:
    """The HTTP status behind an exception from botocore/aiohttp/fsspec, when it carries one."""
    for exc in (e, e.__cause__, e.__context__):
        resp = getattr(exc, "response", None)
        if isinstance(resp, dict):
            code = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code:
                return int(code)
        status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
        if isinstance(status, int):
            return status
    return None


def precondition_failed(e: BaseException) -> bool:
    """A 412 answer to ``If-None-Match``/``If-Match`` (s3fs raises ``FileExistsError`` for some calls and a bare
    ``OSError(EINVAL)`` for others): the condition is the answer, not an error."""
    if isinstance(e, FileExistsError) or _status(e) == 412:
        return True
    text = f"{e} {e.__cause__ or ''}".lower()
    return "precondition" in text or "pre-condition" in text


# azure-core's exceptions for a request that never got an answer (refused, reset, timed out mid-body): named here
# rather than imported, so this module needs no Azure SDK
_AZURE_NO_ANSWER = ("ServiceRequestError", "ServiceResponseError", "ServiceRequestTimeoutError",
                    "ServiceResponseTimeoutError", "IncompleteReadError")


def transient(e: BaseException) -> bool:
    """Worth retrying: throttling, 5xx, timeouts, dropped connections. A 4xx is an answer, not a hiccup. Azure
    says the same with its own names: 503 ServerBusy, 500 InternalError, 429, and azure-core's ``Service*Error``
    for a connection that failed (the S3 and Azure primitives turn 404/409/412 answers into ``FileNotFoundError``/
    ``FileExistsError`` before they reach here)."""
    if isinstance(e, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                      FatalError, UsageError)):
        return False
    if precondition_failed(e):
        return False
    status = _status(e)
    if status is not None:  # 409: a conditional write racing another on the same key (S3 says: retry)
        return status >= 500 or status in (408, 409, 429)
    if any(type(x).__name__ in _AZURE_NO_ANSWER for x in (e, e.__cause__, e.__context__) if x is not None):
        return True
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        w in text for w in ("timeout", "timed out", "connection", "reset", "broken pipe", "throttl", "slowdown",
                            "service unavailable", "internal error", "serverdisconnected", "incompleteread",
                            "endpointconnectionerror", "remotedisconnected", "503", "500", "502", "504"))


@contextmanager
def retry_deadline(at: float) -> Iterator[None]:
    """Inside the block ``retrying`` sends no attempt after ``at`` (a ``time.monotonic()``): a write whose
    authority ends then (a lease renewal, a commit under a lease) must not be resent later, when another worker
    may already own what it writes. The client's own retries of one attempt are not cut short."""
    outer = _DEADLINE.get()
    token = _DEADLINE.set(at if outer is None else min(at, outer))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def retrying(call: Callable[[], T], what: str, attempts: int = RETRIES) -> T:
    """``call()`` with up to ``attempts`` tries and exponential backoff with jitter (0.2 s doubling, capped at
    10 s) on transient errors; permanent ones go straight to ``permanent``. Under ``retry_deadline`` no attempt
    starts after the deadline."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - classified below, re-raised as one line
            if attempt == attempts - 1 or not transient(e):
                raise permanent(e, what) from e
            pause = min(10.0, 0.2 * 2 ** attempt) * (0.5 + random.random())
            deadline = _DEADLINE.get()
            if deadline is not None and time.monotonic() + pause >= deadline:
                raise permanent(e, what) from e
            time.sleep(pause)
    raise AssertionError("unreachable")


def permanent(e: BaseException, what: str) -> BaseException:
    """The one line for a store error that retrying will not fix: no access, no bucket, or out of retries.
    ``FileExistsError``/``FileNotFoundError`` of a key pass through unchanged (callers branch on them)."""
    if isinstance(e, (FileExistsError, FatalError, UsageError)):
        return e
    if precondition_failed(e):
        return FileExistsError(str(e))
    text = redact(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:200]
    status = _status(e)
    low = text.lower()
    if isinstance(e, PermissionError) or status == 403 or "access denied" in low or "forbidden" in low or \
            "authorizationfailure" in low or "authenticationfailed" in low:
        return FatalError(f"{redact(what)}: access denied by the store (403: {text}); check the credentials and "
                          "the bucket (container) policy; nothing was committed by this request")
    if "bucket" in low and ("not exist" in low or "nosuchbucket" in low or "not found" in low):
        return FatalError(f"{redact(what)}: no such bucket ({text}); create it first or fix the URL")
    if "containernotfound" in low or ("container" in low and "not exist" in low):
        return FatalError(f"{redact(what)}: no such container ({text}); create it first or fix the URL")
    if isinstance(e, FileNotFoundError):
        return e
    return FatalError(f"{redact(what)}: the store failed ({text}) after retries; nothing half-committed: run the "
                      "same command again to resume")


@contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Any store exception inside becomes ``permanent``'s one line (no traceback reaches the user)."""
    try:
        yield
    except (FatalError, UsageError, FileExistsError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001
        raise permanent(e, what) from e


def open_file(url: str, mode: str = "rb", block_size: int = 8 << 20) -> Any:
    """A file object for a URL (fsspec, read-ahead buffered by ``block_size``: streamed, never downloaded whole
    first) or a path."""
    if not is_url(url):
        return open(local_path(url), mode)  # noqa: SIM115 - the caller closes it
    fs, path = filesystem(url)
    return retrying(lambda: fs.open(path, mode, block_size=block_size), url)


def open_sampling(url: str, mode: str = "rb") -> Any:
    """``open_file`` for a few scattered small reads (the input digest): 1 MiB blocks, not 8."""
    return open_file(url, mode, block_size=1 << 20)


def info(url: str) -> dict[str, Any]:
    fs, path = filesystem(url)
    return retrying(lambda: fs.info(path), url)


def size(url: str) -> int:
    if not is_url(url):
        return os.path.getsize(local_path(url))
    return int(info(url)["size"])


def exists(url: str) -> bool:
    if not is_url(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url)
    return bool(retrying(lambda: fs.exists(path), url))


def isdir(url: str) -> bool:
    if not is_url(url):
        return os.path.isdir(local_path(url))
    fs, path = filesystem(url)
    return bool(retrying(lambda: fs.isdir(path), url))


def unstrip(url: str, path: str) -> str:
    """A path from ``fs.glob``/``fs.find`` back to a URL of ``url``'s scheme."""
    proto = scheme(url)
    return f"{proto}://{path}" if proto else path


def glob(url: str) -> list[str]:
    """URLs matching a pattern, expanded on the store (one listing, no download)."""
    fs, path = filesystem(url)
    return sorted(unstrip(url, p) for p in retrying(lambda: fs.glob(path), url))


def find(url: str, suffix: str = "") -> list[str]:
    """Every file under a URL "directory" (recursive), ending with ``suffix``."""
    fs, path = filesystem(url)
    found = retrying(lambda: fs.find(path), url)
    return sorted(unstrip(url, p) for p in found if p.endswith(suffix))


def arrow_filesystem(url: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path) for reading Parquet with pyarrow: ranged reads through fsspec."""
    import pyarrow.fs as pafs

    if not is_url(url):
        return pafs.LocalFileSystem(), os.path.abspath(local_path(url))
    fs, path = filesystem(url)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path
