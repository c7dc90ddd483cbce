"""``--retry-errors``: generate again only the rows that failed, with the same settings or from fixed input lines.

Error rows count as done (a rerun would skip them), so a retry first takes them out of the committed parts
(``supersede``: atomically, part by part, before anything is generated); from there they are rows not yet
committed and the ordinary resume generates and commits each exactly once, across kills. ``--retry-length`` also
retries the rows cut at ``max_new_tokens`` (finish_reason ``length``), and lets ``--max-new-tokens`` grow for them:
the one settings change a retry accepts, because a row that stopped before the old limit is not changed by a
larger one (the limit only cuts), so the rows kept and the rows retried are of one run.

A fixed input is accepted when the run is otherwise the same (settings, columns, the other inputs) and, for each
changed JSON Lines input, the row record (``rowrecord``) proves the change touches only failed rows: the same
rows at the same lines, every unchanged line with the id it had, every changed line a row whose old id failed.
Then the manifest takes the new input's digest (and keeps a ``retries`` history) and the record the new lines.
Everything here runs before the model loads, and a refusal leaves OUTDIR as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dspine_batch.config import GenerateConfig
from dspine_batch.errors import FingerprintMismatch, UsageError
from dspine_batch.inputs import rowrecord
from dspine_batch.inputs.sources import InputFile, iter_inputs
from dspine_batch.outdir.keyset import fallback_id_hashes, key_hashes
from dspine_batch.outdir.output import Output, arrow_path, committed_parts
from dspine_batch.requests.fields import RowRequest
from dspine_batch.requests.mapping import Columns, RowIds
from dspine_batch.run.fingerprint import describe_inputs, fingerprint
from dspine_batch.run.rerun import run_changes


@dataclass
class Failed:
    """The rows to retry: per committed part of this shard, their row ids; and every shard's failed id hashes."""

    parts: dict[str, set[str]] = field(default_factory=dict)
    errors: int = 0  # rows of this shard with status error
    lengths: int = 0  # rows of this shard cut by length (with --retry-length)
    all_hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))

    @property
    def rows(self) -> int:
        return self.errors + self.lengths


def find_failed(outdir: str, tag: str, lengths: bool, id_column: bool) -> Failed:
    """Rows whose status is error (or, with ``lengths``, finish_reason length): of this shard for the parts to
    change, of every shard for the proof that a fixed input touched only failed rows. ``outdir``: a local
    directory or an object-store URL (its parts read through the store, ranged)."""
    out = Failed()
    every: list[str] = []
    for part in committed_parts(outdir):
        src = arrow_path(part.path)
        meta = json.loads((pq.read_metadata(src["source"], filesystem=src.get("filesystem")).metadata or {})
                          .get(b"dspine_batch.part", b"{}"))
        if not lengths and meta.get("error_rows", 1) == 0:
            continue
        t = pq.read_table(**src, columns=["row_id", "status", "finish_reason"]).to_pydict()
        errors, cut = set(), set()
        for rid, status, finish in zip(t["row_id"], t["status"], t["finish_reason"], strict=True):
            if status != "ok":
                errors.add(rid)
            elif lengths and finish == "length":
                cut.add(rid)
        cut -= errors
        every += [*errors, *cut]
        if part.shard == tag and (errors or cut):
            out.parts[part.path] = errors | cut
            out.errors += len(errors)
            out.lengths += len(cut)
    out.all_hashes = (key_hashes if id_column else fallback_id_hashes)(every) if every else out.all_hashes
    return out


def prepare(cfg: GenerateConfig, files: list[InputFile], columns: Columns, out: Output, tag: str,
            request: RowRequest, log: Callable[[str], None], extra: dict[str, Any] | None = None) -> int:
    """Before the model loads, with the shard's lock held and the OUTDIR recovered: accept a fixed input (or
    refuse, naming what changed), then take the failed rows out of this shard's parts so the run generates them
    again (on a local disk or an object store: ``Output.drop_rows``). ``extra``: a stage's fingerprint fields
    beyond the job's (its rules; for a later stage the stage it reads, whose new fingerprint a retry of that
    stage made: accepted here as a fixed input is)."""
    manifest = out.read_manifest()
    if manifest is None:
        log("--retry-errors: OUTDIR holds no run yet; nothing to retry")
        return 0
    failed = find_failed(cfg.output if out.remote else out.path, tag, cfg.retry_length,  # type: ignore[attr-defined]
                         columns.id is not None)
    if extra is not None and "inputs" in extra:  # a later stage: its input is its parent stage's output
        manifest = _accept_parent(out, cfg, files, columns, manifest, request, extra, log)
    changed = _changed_inputs(cfg, files, columns, manifest, request, extra)
    if changed:
        manifest = _accept_fixed_inputs(out, files, columns, manifest, changed, failed, cfg.limit, tag, log)
    old_limit = manifest["fingerprint_fields"]["settings"].get("max_new_tokens")
    if cfg.retry_length and old_limit != cfg.max_new_tokens and run_changes(cfg, files, columns, manifest, request,
                                                                            extra):
        _update_manifest(out, manifest, files, {}, {"max_new_tokens": cfg.max_new_tokens})
        log(f"--retry-length: --max-new-tokens {old_limit} -> {cfg.max_new_tokens} for the retried rows (the others "
            "stopped before the old limit: a larger one does not change them)")
    if not failed.rows:
        log("--retry-errors: no failed rows in this shard's committed parts")
        return 0
    out.remove_success()  # no longer true once rows are taken out; the run that finishes writes it again
    for path, ids in failed.parts.items():
        out.drop_rows(tag, path, ids)
    what = f"{failed.errors:,} error rows" + (f" and {failed.lengths:,} cut by length" if cfg.retry_length else "")
    log(f"--retry-errors: {what} taken out of {len(failed.parts)} committed part(s); they are generated again "
        "(readers see each row once: its latest committed attempt)")
    return failed.rows


def _accept_parent(out: Output, cfg: GenerateConfig, files: list[InputFile], columns: Columns,
                   manifest: dict[str, Any], request: RowRequest, extra: dict[str, Any],
                   log: Callable[[str], None]) -> dict[str, Any]:
    """A later stage of a retried job: the stage it reads has a new fingerprint (its fixed input, its rows taken
    out) and nothing else may differ; its manifest takes the new one, with a ``retries`` entry."""
    old = (manifest.get("fingerprint_fields") or {}).get("inputs")
    if old == extra["inputs"]:
        return manifest
    changes = [c for c in run_changes(cfg, files, columns, manifest, request, extra) if not c.startswith("inputs")]
    if changes or not isinstance(old, dict) or old.get("stage") != extra["inputs"].get("stage"):
        raise FingerprintMismatch(f"{out.display}: --retry-errors retries with the same settings; changed: "
                                  + "; ".join(changes[:8] or ["the stage it reads"]) + ". The model was not loaded.")
    fields = {**manifest["fingerprint_fields"], "inputs": extra["inputs"]}
    entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "previous_fingerprint": manifest["fingerprint"],
             "parent_fingerprint": extra["inputs"].get("fingerprint")}
    manifest = {**manifest, "fingerprint_fields": fields, "fingerprint": fingerprint(fields),
                "retries": [*manifest.get("retries", []), entry]}
    out.update_manifest(manifest)
    log(f"--retry-errors: the stage it reads ({extra['inputs'].get('stage')}) was retried; its new rows feed this one")
    return manifest


def _changed_inputs(cfg: GenerateConfig, files: list[InputFile], columns: Columns, manifest: dict[str, Any],
                    request: RowRequest, extra: dict[str, Any] | None = None) -> list[int]:
    """Indices of the inputs whose content changed, when that is all that changed; a refusal naming the change
    when anything else did (settings, columns, inputs added, removed, renamed or reordered)."""
    changes = run_changes(cfg, files, columns, manifest, request, extra)
    if not changes:
        return []
    old = (manifest.get("fingerprint_fields") or {}).get("inputs") or []
    new = describe_inputs(files)
    same_list = [(o.get("name"), o.get("kind"), o.get("split")) for o in old] == \
        [(n["name"], n["kind"], n["split"]) for n in new]
    content = [k for k, (o, n) in enumerate(zip(old, new, strict=False)) if (o.get("size"), o.get("digest"))
               != (n["size"], n["digest"])]
    old_limit = ((manifest.get("fingerprint_fields") or {}).get("settings") or {}).get("max_new_tokens")
    longer = cfg.retry_length and isinstance(old_limit, int) and cfg.max_new_tokens > old_limit
    others = [c for c in changes if not c.startswith("inputs")
              and not (longer and c.startswith("settings.max_new_tokens:"))]
    if others or not same_list:
        raise FingerprintMismatch(f"{cfg.output}: --retry-errors retries with the same settings and the same inputs "
                                  "(their failed lines may be fixed; with --retry-length, a larger --max-new-tokens); "
                                  "changed: " + "; ".join(changes[:8]) + ". The model was not loaded.")
    return content


def _accept_fixed_inputs(out: Output, files: list[InputFile], columns: Columns, manifest: dict[str, Any],
                         changed: list[int], failed: Failed, limit: int | None, tag: str,
                         log: Callable[[str], None]) -> dict[str, Any]:
    for k in changed:
        if files[k].kind not in ("jsonl", "openai"):
            raise FingerprintMismatch(f"{files[k].name}: changed; only a JSON Lines input's failed lines can be fixed "
                                      "for --retry-errors (use the original file, or --overwrite)")
    busy = [h for h in out.held_locks() if h not in (f"lock-{tag}", f"lease-{tag}")]
    if busy:
        raise UsageError(f"--retry-errors: the inputs changed while other shards run ({', '.join(busy)}); retry "
                         "with a fixed input once they have stopped")
    new_rows = _read_rows(files, columns, limit, set(changed))
    failed_set = np.sort(failed.all_hashes)
    notes = {}
    for k in changed:
        old = rowrecord.load(out, k)
        name = files[k].name
        if old is None:
            raise FingerprintMismatch(f"{name}: changed, and OUTDIR has no record of its rows to prove the change "
                                      "touches only failed rows (written by an older version, or never read to the "
                                      "end); use the original file, or --overwrite")
        new = new_rows[k]
        if len(old) != len(new) or not np.array_equal(old["index"], new["index"]):
            raise FingerprintMismatch(f"{name}: rows were added, removed or moved (it had {len(old):,} rows, now "
                                      f"{len(new):,}); --retry-errors accepts fixes to failed lines only")
        edited = old["line"] != new["line"]
        moved_id = ~edited & (old["id"] != new["id"])
        if moved_id.any():
            line = int(old["index"][np.flatnonzero(moved_id)[0]]) + 1
            raise FingerprintMismatch(f"{name}: line {line} is unchanged but its row id changed (an edited line took "
                                      "an id another row had); --retry-errors accepts fixes to failed lines only")
        touched = old["id"][edited]
        good = ~np.isin(touched, failed_set)
        if good.any():
            line = int(old["index"][edited][np.flatnonzero(good)[0]]) + 1
            raise FingerprintMismatch(f"{name}: line {line} changed, but its row did not fail (only failed rows' lines "
                                      "may change for --retry-errors); use the original line, or --overwrite")
        notes[name] = int(edited.sum())
    manifest = _update_manifest(out, manifest, files, notes)
    for k in changed:
        rowrecord.save(out, k, new_rows[k])
    log("--retry-errors: accepted the fixed input(s): " + ", ".join(f"{n} ({c:,} failed line(s) changed, every other "
                                                                  "line as before)" for n, c in notes.items()))
    return manifest


def _read_rows(files: list[InputFile], columns: Columns, limit: int | None, wanted: set[int]) -> dict[int, Any]:
    """The new row record of the inputs in ``wanted``: ids assigned over all inputs in order, as a run does."""
    ids = RowIds(columns.id)
    index = {f.name: k for k, f in enumerate(files)}
    read = [columns.id] if columns.id else []
    parts: dict[int, list[np.ndarray]] = {k: [] for k in wanted}
    for batch in iter_inputs(files, read or None, limit):
        hashes = ids.assign_ids(batch)[2]
        k = index[batch.file.name]
        if k in wanted and batch.digests is not None:
            parts[k].append(rowrecord.rows_of(batch, hashes))
    return {k: np.concatenate(v) if v else np.zeros(0, dtype=rowrecord.ROW) for k, v in parts.items()}


def _update_manifest(out: Output, manifest: dict[str, Any], files: list[InputFile], notes: dict[str, int],
                     settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest with the fixed inputs' digests (and a larger max_new_tokens): so a plain resume accepts them
    too; a ``retries`` entry keeps what changed and the fingerprint before."""
    fields = dict(manifest["fingerprint_fields"])
    fields["inputs"] = describe_inputs(files)
    if settings:
        fields["settings"] = {**fields["settings"], **settings}
    entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "previous_fingerprint": manifest["fingerprint"],
             "changed_lines": notes, "settings": settings or {}}
    manifest = {**manifest, "fingerprint_fields": fields, "fingerprint": fingerprint(fields),
                "retries": [*manifest.get("retries", []), entry]}
    out.update_manifest(manifest)
    return manifest
