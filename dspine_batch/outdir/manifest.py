"""``_manifest.json``: the run an OUTDIR holds, created once and checked by every later start, on every store.

Resuming is only safe if it is the same run (``run.fingerprint`` builds the fingerprint: inputs, settings, model).
The manifest is created with a create-only write (a hard link on a disk, ``If-None-Match: *`` on a store), so of
shards starting together exactly one creates it and the others check theirs against it; a mismatch is refused with
a list of what changed. ``--retry-errors`` replaces it by compare-and-swap (``update_manifest``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from dspine_batch.errors import FatalError, FingerprintMismatch, UsageError
from dspine_batch.outdir.layout import MANIFEST
from dspine_batch.storage.objects import ObjectStore
from dspine_batch.storage.urls import redact

STAGES_FILE = "_stages.json"  # a job of several stages: OUTDIR/<stage>/ each an output of its own


def _body(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()


def read_manifest(store: ObjectStore) -> dict[str, Any] | None:
    data = store.get(MANIFEST)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as e:
        raise UsageError(f"{store.url_of(MANIFEST)}: unreadable manifest ({e}); use --overwrite to start over") from e


def create_or_check(store: ObjectStore, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create ``_manifest.json`` if absent (first shard wins), else verify it is this run's. Returns the manifest in
    force; raises ``FingerprintMismatch`` listing what changed."""
    if store.create(MANIFEST, _body(manifest), then="no manifest was created"):
        return manifest
    existing = read_manifest(store)
    assert existing is not None
    return check_manifest(store.display, existing, manifest)


def update_manifest(store: ObjectStore, manifest: dict[str, Any]) -> None:
    """Replace the manifest (a retry's accepted change) with a compare-and-swap on the one read; a swap whose answer
    was lost (its retry meets a changed ETag) is read back: the manifest now holding our bytes is our swap."""
    got = store.get_with_etag(MANIFEST)
    body = _body(manifest)
    if got is not None and got[0] == body:
        return
    if got is None or (store.replace(MANIFEST, body, got[1]) is None and store.get(MANIFEST) != body):
        raise FatalError(f"{store.url_of(MANIFEST)}: changed or gone while a retry updated it; run again")


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


# a stage's name: it names OUTDIR/<name>/, so never a path ('..', '/'); checked when the job is read and again
# when ``_stages.json`` is read back (a file anyone with write access to OUTDIR could have edited)
STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def stage_names(outdir: str) -> list[str] | None:
    """The stages of a staged OUTDIR in order (``dspine_batch.stages``), None for an ordinary output. A name that
    is not a stage's (``../other``) is a ``UsageError`` naming the file: readers join each name to OUTDIR, and
    ``finalize`` writes under it."""
    try:
        body = ObjectStore(outdir).get(STAGES_FILE)
        names = json.loads(body)["stages"] if body is not None else None
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
