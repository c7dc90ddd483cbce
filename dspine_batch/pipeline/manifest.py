"""Run identity: the fingerprint and ``_manifest.json``.

Resuming is only safe if the run is the same run: same inputs (paths, sizes, a content hash of what is
read), same generation settings, same model and draft. The manifest is created once per OUTDIR (atomically:
link a temp file to the final name, which fails if another shard got there first) and every later start
compares against it; a mismatch is refused with a list of what changed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import sys
import time
from typing import Any

from dspine_batch import __version__
from dspine_batch.digest import content_digest
from dspine_batch.errors import FingerprintMismatch, UsageError, disk_full_named
from dspine_batch.pipeline.sources import InputFile
from dspine_batch.storage import fs as store
from dspine_batch.storage.urls import is_url, redact, redacted

MANIFEST = "_manifest.json"
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


def diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two fingerprint field dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff(a, b, name + "."))
        elif isinstance(a, list) and isinstance(b, list) and name == "inputs":
            out.extend(_diff_inputs(a, b))
        elif json.dumps(a, default=str) != json.dumps(b, default=str):
            out.append(f"{name}: {_short(a)} -> {_short(b)}")
    return out


def _diff_inputs(a: list[dict], b: list[dict]) -> list[str]:
    old, new = {x["name"]: x for x in a}, {x["name"]: x for x in b}
    out = [f"inputs: {n} removed" for n in old if n not in new] + [f"inputs: {n} added" for n in new if n not in old]
    for n in old.keys() & new.keys():
        for k in ("kind", "split", "size", "digest"):
            if old[n].get(k) != new[n].get(k):
                out.append(f"inputs: {n} changed ({k} {_short(old[n].get(k))} -> {_short(new[n].get(k))})")
                break
    if not out and [x["name"] for x in a] != [x["name"] for x in b]:
        out.append("inputs: order changed (row ids and shards depend on it)")
    return out


def _short(v: Any) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


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


def read_manifest(outdir: str) -> dict[str, Any] | None:
    path = os.path.join(outdir, MANIFEST)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: unreadable manifest ({e}); use --overwrite to start over") from e


def create_or_check(outdir: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create ``_manifest.json`` if absent (atomic, first writer wins), else verify it matches.

    Returns the manifest in force. Raises ``FingerprintMismatch`` listing what changed."""
    existing = read_manifest(outdir)
    if existing is None:
        tmp = os.path.join(outdir, f".{MANIFEST}.{os.getpid()}.tmp")
        path = os.path.join(outdir, MANIFEST)
        try:
            with disk_full_named(path, lambda: os.path.getsize(tmp) if os.path.exists(tmp) else 0,
                                 "no manifest was created"):
                with open(tmp, "w") as f:
                    json.dump(manifest, f, indent=2, sort_keys=True, default=str)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, path)  # fails if it exists: create-if-absent
            return manifest
        except FileExistsError:
            existing = read_manifest(outdir)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    assert existing is not None
    return check_manifest(outdir, existing, manifest)


def check_manifest(outdir: str, existing: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """``existing`` (the manifest in OUTDIR) if ``manifest`` is the same run, else ``FingerprintMismatch``."""
    old_schema = existing.get("fingerprint_fields", {}).get("schema_version")
    new_schema = manifest["fingerprint_fields"].get("schema_version")
    if existing.get("fingerprint") != manifest["fingerprint"] and old_schema != new_schema:
        raise FingerprintMismatch(
            f"{outdir} was written by another dspine-batch version (schema_version: {old_schema} -> {new_schema}; "
            "one folder never mixes parts of two output schemas): finish it with the version that started it "
            "(its committed rows are intact), or --overwrite to start over")
    if existing.get("fingerprint") != manifest["fingerprint"]:
        changes = diff(existing.get("fingerprint_fields", {}), manifest["fingerprint_fields"]) or ["(unknown)"]
        raise FingerprintMismatch(
            f"{outdir} holds a different run (fingerprint {existing.get('fingerprint')} != "
            f"{manifest['fingerprint']}); changed: " + "; ".join(changes[:8])
            + ("; ..." if len(changes) > 8 else "") + ". Use the original settings to resume, "
            "or --overwrite to start over.")
    if existing.get("num_shards") != manifest["num_shards"]:
        raise FingerprintMismatch(
            f"{outdir} was started with {existing.get('num_shards')} shards, now {manifest['num_shards']}; "
            "use the same --shard N (or --overwrite)")
    return existing


STAGES_FILE = "_stages.json"  # a job of several stages: OUTDIR/<stage>/ each an output of its own
# a stage's name: it names OUTDIR/<name>/, so never a path ('..', '/'); checked when the job is read and again
# when ``_stages.json`` is read back (a file anyone with write access to OUTDIR could have edited)
STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def stage_names(outdir: str) -> list[str] | None:
    """The stages of a staged OUTDIR in order (``dspine_batch.stages``), None for an ordinary output. A name that
    is not a stage's (``../other``) is a ``UsageError`` naming the file: readers join each name to OUTDIR, and
    ``finalize`` writes under it."""
    try:
        if is_url(outdir):
            from dspine_batch.storage.objects import ObjectStore

            body = ObjectStore(outdir).get(STAGES_FILE)
            names = json.loads(body)["stages"] if body is not None else None
        else:
            with open(os.path.join(outdir, STAGES_FILE)) as f:
                names = json.load(f)["stages"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(names, list):
        return None
    bad = next((n for n in names if not isinstance(n, str) or not STAGE_NAME.match(n)), None)
    if bad is not None or not names:
        where = f"{redact(outdir.rstrip('/'))}/{STAGES_FILE}"
        raise UsageError(f"{where}: {bad!r} is not a stage name (letters, digits, '_', '-', '.'; it names a folder "
                         "of OUTDIR)" if bad is not None else f"{where}: lists no stages")
    return names

