"""URLs versus local paths, secrets kept out of every line we print, and ``--storage-option`` values.

A string is a URL when it starts with ``scheme://`` (two or more letters: ``C:\\`` stays a path). Anything we
print or write (logs, manifest, state files, reports, errors) goes through ``redact`` first: a URL may carry a
password (``s3://key:secret@bucket``, ``s3://:secret@bucket``) or a signed query string (``?X-Amz-Signature=...``,
``?sig=...``), and a message from a store's SDK may quote an Azure connection string (``AccountKey=...;``), a SAS
token or an option by name (``account_key='...'``, s3fs's ``key=``/``secret=``/``token=``, ``password=``,
``--api-key ...``). Structured values (the manifest's config and fingerprint fields) go through ``redacted``, which
also replaces the value of every key named like a credential (``is_secret_name``): ``--engine-arg api_key=...``
is written as ``"<redacted>"``.

A credential is left out of the run's identity on purpose, not hashed into it: it decides who may ask, not what
is answered, so a rotated key resumes the same run; and a digest of a short password in a file anyone who can
list OUTDIR reads could be guessed back offline.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from dspine_batch.errors import UsageError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# userinfo in any scheme://user:pass@host (the user may be empty), anywhere in a line
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+://)[^/@\s:]*:[^@\s]*@")  # a password may hold "/"
# a bare user on http(s) is a token (https://TOKEN@host); on az:// or abfs:// it is a container name: kept there
_HTTP_USER = re.compile(r"(?i)(https?://)[^/@\s:]+@")
# query parameters that carry a credential (presigned S3/GCS URLs, Azure SAS, plain tokens)
_SECRET_PARAMS = re.compile(r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|"
                            r"x-goog-credential|sig|signature|token|access_token|secret|password|key|sv|se|sp|skoid|"
                            r"sktid|sks|skv|api_key|apikey)=)[^&\s#]*")
# an Azure connection string's secret fields (``AccountKey=...;SharedAccessSignature=...``), anywhere in a line
_CONN_FIELDS = re.compile(r"(?i)\b((?:AccountKey|SharedAccessSignature|SharedAccessKey)=)[^;\s]*")
# a secret-carrying storage option quoted by name, as ``key=value``, ``key: value`` or a dict's ``'key': 'value'``
_SECRET_OPTIONS = re.compile(r"(?i)(\b(?:account_key|sas_token|connection_string|client_secret|credential|"
                             r"aws_secret_access_key|aws_session_token)['\"]?\s*[:=]\s*['\"]?)"
                             r"[^'\"\s,;}&]+")

# the last word of a key name that holds a credential (``aws_secret_access_key``, ``hf_token``, ``X-Amz-Signature``,
# s3fs's ``key``/``secret``/``token``), or a whole name written as one word (``AccountKey``, ``connection_string``)
_SECRET_LAST = ("key", "secret", "token", "password", "passwd", "pwd", "credential", "credentials", "sig",
                "signature", "sas", "apikey", "accountkey", "accesskey", "sharedaccesskey", "sharedaccesssignature")
_SECRET_WHOLE = ("connectionstring", "sastoken")
_NOT_SECRET = frozenset({"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token",
                         "mask_token", "dedup_key"})  # tokenizer special tokens, our dedup column: no credentials
_WORDS = "|".join(sorted(_SECRET_LAST, key=len, reverse=True)) + r"|connection[_-]?string"
_NAME = rf"(?!(?:bos|eos|pad|unk|sep|cls|mask)_token\b)(?:[\w.-]*[_.-])?(?:{_WORDS})"
# a credential by name in a line: ``name=value``, ``"name": "value"``, ``--name value`` / ``--name=value``
_NAMED = re.compile(rf"(?i)(?<![\w.-])({_NAME}\s*=\s*['\"]?|['\"]{_NAME}['\"]\s*:\s*['\"]?)[^'\"\s,;&}}]+")
_FLAG = re.compile(rf"(?i)(?<![\w-])(--{_NAME}(?:=|\s+)['\"]?)(?!--)[^'\"\s,;&}}]+")
REDACTED = "<redacted>"

# scheme -> (fsspec protocol package, the extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
    "hf": ("huggingface_hub", "hf"),
}
AZURE_SCHEMES = ("az", "abfs", "abfss")
# schemes whose stores can create an object only if it is absent (If-None-Match: *) and swap one on its ETag
# (If-Match), with a primitives module here: S3's API (``storage.s3``: AWS, MinIO, R2, Ceph, moto) and Azure Blob
# Storage (``storage.azure``: Azure, Azurite). Only these are accepted as OUTDIR.
OUTDIR_SCHEMES = ("s3", "s3a", *AZURE_SCHEMES)
# why a store cannot hold an OUTDIR, said in the one line that refuses it
NO_CREATE_ONLY = {
    "hf": "the Hugging Face Hub has no create-if-absent write, so two writers could both commit the same part",
    "http": "plain HTTP has no create-if-absent write (and is read-only in fsspec)",
    "https": "plain HTTP has no create-if-absent write (and is read-only in fsspec)",
    # GCS has the preconditions (ifGenerationMatch), but no emulator that honours them could be tested against
    "gs": "exactly-once commits on GCS are not implemented yet (inputs from gs:// work)",
    "gcs": "exactly-once commits on GCS are not implemented yet (inputs from gcs:// work)",
    "memory": "the memory:// store lives in one process only",
}


def scheme(path: str) -> str | None:
    """The URL scheme (lower case), None for a local path (``file://`` counts as local)."""
    m = _URL.match(path)
    if not m or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_url(path: str) -> bool:
    return scheme(path) is not None


def local_path(path: str) -> str:
    """``file:///x`` -> ``/x``; anything else unchanged."""
    return path[len("file://"):] if path.lower().startswith("file://") else path


def is_secret_name(name: str) -> bool:
    """Whether a key of this name holds a credential (``api_key``, ``secret``, ``sas_token``, ``AccountKey``)."""
    n = name.lower()
    if n in _NOT_SECRET:
        return False
    return re.split(r"[_.\-]", n)[-1] in _SECRET_LAST or re.sub(r"[_.\-]", "", n).endswith(_SECRET_WHOLE)


def redact(text: str) -> str:
    """``text`` with every URL password, secret-carrying query value (SAS tokens included), connection-string
    secret (``AccountKey=``, ``SharedAccessSignature=``) and credential quoted by name (``key=``, ``password=``,
    ``"api_key": ...``, ``--api-key ...``) replaced by ``***``. Cheap enough to run on every line we print."""
    if "://" not in text and "=" not in text and ":" not in text and "--" not in text:
        return text
    text = _USERINFO.sub(r"\1***@", text)
    text = _HTTP_USER.sub(r"\1***@", text)
    text = _SECRET_PARAMS.sub(r"\1***", text)
    text = _CONN_FIELDS.sub(r"\1***", text)
    text = _SECRET_OPTIONS.sub(r"\1***", text)
    text = _NAMED.sub(r"\1***", text)
    return _FLAG.sub(r"\1***", text)


def redacted(value: Any, text: bool = True) -> Any:
    """A structured value (a config, the fingerprint's fields) as it may be written where others read it: the value
    of every key named like a credential replaced by ``REDACTED``, and (``text``) every string through
    ``redact``."""
    if isinstance(value, str):
        return redact(value) if text else value
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and is_secret_name(k) and v not in (None, "")
                else redacted(v, text) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(x, text) for x in value]
    return value


def join(base: str, *names: str) -> str:
    """``base/name`` for URLs (always ``/``) and local paths alike."""
    if not is_url(base):
        return os.path.join(base, *names)
    out = base.rstrip("/")
    for n in names:
        out += "/" + n.strip("/")
    return out


def strip_url(url: str) -> str:
    """A URL without its trailing slash and with no query string (an OUTDIR URL names a prefix)."""
    parts = urlsplit(url)
    if parts.query:
        raise UsageError(f"{redact(url)}: a query string is not allowed in an output URL; pass settings with "
                         "--storage-option KEY=VALUE")
    return url.rstrip("/")


def parse_options(pairs: list[str] | tuple[str, ...], env: str | None = None) -> dict[str, object]:
    """``--storage-option KEY=VALUE`` (repeatable) over ``DSPINE_BATCH_STORAGE_OPTIONS`` (a JSON object, or
    ``k=v,k=v``). Values that read as JSON (numbers, true/false, objects) are decoded; dotted keys build nested
    dicts (``client_kwargs.region_name=eu-west-1``), as fsspec filesystems take them."""
    out: dict[str, object] = {}
    env = os.environ.get("DSPINE_BATCH_STORAGE_OPTIONS") if env is None else env
    items: list[str] = []
    if env and env.strip():
        text = env.strip()
        if text.startswith("{"):
            try:
                loaded = json.loads(text)
            except ValueError as e:
                raise UsageError(f"DSPINE_BATCH_STORAGE_OPTIONS: not a JSON object ({e.msg})") from e
            if not isinstance(loaded, dict):
                raise UsageError("DSPINE_BATCH_STORAGE_OPTIONS: not a JSON object")
            out.update(loaded)
        else:
            items.extend(p for p in text.split(",") if p.strip())
    items.extend(pairs)
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--storage-option {key or item!r}: expected KEY=VALUE, e.g. endpoint_url=http://...")
        try:
            parsed: object = json.loads(value)
        except ValueError:
            parsed = value
        node = out
        *path, last = key.split(".")
        for k in path:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise UsageError(f"--storage-option {key}: {k} is both a value and a group")
            node = child
        node[last] = parsed
    return out


def query_params(url: str) -> list[tuple[str, str]]:
    return parse_qsl(urlsplit(url).query)
