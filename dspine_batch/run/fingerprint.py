"""Run identity: the fingerprint that ``_manifest.json`` holds.

Resuming is only safe if the run is the same run: same inputs (paths, sizes, a content hash of what is
read), same generation settings, same model and draft. ``outdir.manifest`` creates the manifest once per OUTDIR
and checks every later start against it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import sys
import time
from typing import Any

from dspine_batch import __version__
from dspine_batch.digest import content_digest
from dspine_batch.inputs.sources import InputFile
from dspine_batch.storage import fs as store
from dspine_batch.storage.urls import redact, redacted


def describe_inputs(files: list[InputFile]) -> list[dict[str, Any]]:
    out = []
    for inp in files:
        parts = inp.content_files()
        sizes = [store.size(p) for p in parts]
        digests = [content_digest(p, store.open_sampling, n) for p, n in zip(parts, sizes, strict=True)]
        out.append({"name": inp.name, "path": redact(inp.path), "kind": inp.kind, "split": inp.split,
                    "size": sum(sizes), "digest": hashlib.sha256("".join(digests).encode()).hexdigest()[:32]})
    return out


def fingerprint(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def versions() -> dict[str, str]:
    import pyarrow

    out = {"dspine_batch": __version__, "python": platform.python_version(), "pyarrow": pyarrow.__version__}
    for dist in ("torch", "sglang", "tokenizers"):  # metadata only: importing torch costs seconds
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if "dspine" in sys.modules:
        out["dspine"] = getattr(sys.modules["dspine"], "__version__", "unknown")
    return out


def build_manifest(fields: dict[str, Any], config: dict[str, Any], num_shards: int,
                   schema: list[str]) -> dict[str, Any]:
    """The manifest of a run. It is read by anyone who can list OUTDIR (credentials belong in the environment or
    ``--storage-option``, which are never written), so the config goes through ``redacted`` (URL secrets, and
    ``--engine-arg api_key=...`` or any key named like a credential), and so do the fingerprint's fields (an
    engine's identity may hold its server arguments) before the fingerprint is taken: a credential is not part of
    the run's identity (``storage.urls`` says why), so a rotated key resumes the same run. The fields lose those
    keys' values only (``text=False``): the fingerprint of a run without one stays what it was."""
    fields = redacted(fields, text=False)
    return {"schema_version": 1, "tool": "dspine-batch", "fingerprint": fingerprint(fields),
            "fingerprint_fields": fields, "num_shards": num_shards, "config": redacted(config), "versions": versions(),
            "output_columns": schema, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "created_by": f"{socket.gethostname()}:{os.getpid()}"}
