"""An OUTDIR on an object store (``s3://...``, ``az://...``), exactly-once without rename, fsync or ``flock``.

Written against ``storage.objects.ObjectStore`` only (create-only writes, compare-and-swap, server-side copy,
batched deletes, listings): which store answers, and with which requests, is that module's business.

Layout under the OUTDIR prefix (readers glob ``OUTDIR/*.parquet`` and see committed parts only):
  ``_manifest.json``                        created once, create-only (first shard wins, the others check it)
  ``_dspine/lease-<shard>.json``             shard ownership (``storage.lease``)
  ``_dspine/staging/<part>.<token>``         a part's bytes, uploaded under a unique name (never read by readers)
  ``_dspine/keys/commit-<X>.json``           its **commit record**: rows, outputs, bytes, crc32, the token, and
                                             the part's row-key hashes (what resume loads instead of row ids)
  ``train-<X>.parquet``                      the published part: a server-side copy of the staged one
  ``_dspine/state-<shard>.json``             advisory progress for ``status``

Commit of one part: 1. build it in a local temp file (counting and crc32-ing the bytes); 2. upload it to its
staging name; 3. **create the commit record with a create-only write** (``If-None-Match: *``) - the
linearisation point: the part is committed iff its record exists; 4. publish: copy the staged object to the
final name, then delete the staged one (deletes are batched: one request per many parts). Steps 2-4 run on
``Committer`` threads while the pipeline fills the next part. A crash before 3 leaves orphans that the next start
of the shard deletes (staged objects whose token no record names); a crash after 3 leaves a record whose publish
the next start (or ``finalize``) completes: a copy made idempotent by the record (same bytes, same name). A
failure at 3 that is not a crash (403, the store gone) deletes what 2 uploaded and commits nothing.

Resume trusts records only: each record is checked against its published part (size from one listing; the
crc32 of the bytes under ``finalize`` and ``status --verify``), damaged or lost parts are moved aside to
``_dspine/damaged/`` like on a local disk, and the done-set is loaded from the records' key hashes (one GET a
part, concurrently). Requests per part: upload, record, copy, and a share of one batched delete. Two writers on one
shard (a paused worker whose lease was taken over) cannot both commit: parts are numbered per shard and each
record is created only if absent, so the loser of a number stops (see ``storage.lease``).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dspine_batch.errors import FatalError, UsageError
from dspine_batch.pipeline import remote_compact, remote_supersede
from dspine_batch.pipeline.keyset import KeySet, fallback_id_hashes, key_hashes
from dspine_batch.pipeline.manifest import MANIFEST, check_manifest
from dspine_batch.pipeline.remote_layout import (
    DAMAGED,
    KEYS,
    STAGING,
    STATE,
    SUCCESS,
    keys_fields,
    record_keys,
    record_rel,
    stem,
)
from dspine_batch.pipeline.resume import CLAIM_SPACES, OUTPUT_NAMES, PART_RE, DoneSet, PartCheck, _warn
from dspine_batch.pipeline.sink import CHECKSUM, PART_PREFIX, ChecksumWriter
from dspine_batch.storage.fs import retry_deadline
from dspine_batch.storage.lease import Lease, holder_gone, lease_name, live, read_lease
from dspine_batch.storage.objects import Listed, ObjectStore, check_outdir_url, local_tmp_dir


class ObjectOutput:
    """The ``Output`` of an object-store OUTDIR (see ``outputs.LocalOutput`` for the local one)."""

    remote = True
    # --commit-rows when not given: ten times a local disk's. A part here costs three requests (upload, record,
    # copy), one more object to list and one GET on every resume, and the client's CPU per request; a local part
    # costs an fsync. For any real engine --commit-seconds (5 s) ends a part long before 10,000 rows, so the work a
    # crash can lose is the same as on a local disk; only a very fast job (cheap rows, cheap to redo) gets fewer,
    # larger parts: on the zero-cost pipeline 10x fewer requests, and a resume over 1M rows reads 100 records
    # instead of 1,000 (BENCHMARKS.md, issue 39).
    commit_rows = 10_000

    def __init__(self, url: str):
        check_outdir_url(url)
        self.store = ObjectStore(url)
        self.display = self.store.display
        self.lease: Lease | None = None
        self.committer: Committer | None = None
        self._records: dict[str | None, dict[str, dict[str, Any]]] = {}  # ``records`` of this start

    # -- setup ----------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check the bucket answers (one line for 403 / no bucket, before any work), that the prefix is empty
        or ours (a typo in -o must not mix outputs), and that the store honours conditional writes."""
        self.store.check_bucket()
        foreign = [n for n in self.store.names() if not OUTPUT_NAMES.match(n)]
        if foreign and self.read_manifest() is None:
            raise UsageError(f"{self.display}: not empty and not a dspine-batch output (found {foreign[0]!r}); "
                             "choose a new -o prefix")
        self.store.check_conditional_writes()

    def lock(self, tag: str) -> Lease:
        self.lease = Lease(self.store, tag, before_release=self._drain)
        return self.lease

    def _drain(self) -> None:
        """Before the lease goes: let queued commits land (or fail) while the shard is still ours."""
        if self.committer is not None:
            try:
                self.committer.flush()
            except BaseException:  # noqa: BLE001 - raised to the caller by the commit or flush that saw it
                pass

    def held_locks(self) -> list[str]:
        """Leases whose holder may be alive (unexpired, and not provably dead: ``storage.lease.holder_gone``)."""
        return [n.removeprefix(f"{STATE}/").removesuffix(".json") for n in self._leases() if _held(self._lease_of(n))]

    def _leases(self) -> list[str]:
        return [f"{STATE}/{n}" for n in self.store.list(STATE) if n.startswith("lease-") and n.endswith(".json")]

    def _lease_of(self, rel: str) -> dict[str, Any] | None:
        tag = rel.removeprefix(f"{STATE}/lease-").removesuffix(".json")
        return read_lease(self.store, tag)

    def read_manifest(self) -> dict[str, Any] | None:
        data = self.store.get(MANIFEST)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise UsageError(f"{self.store.url_of(MANIFEST)}: unreadable manifest ({e}); use --overwrite to start "
                             "over") from e

    def create_or_check(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create ``_manifest.json`` only if absent (first shard wins), else check it is this run's."""
        body = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        if self.store.create(MANIFEST, body):
            return manifest
        existing = self.read_manifest()
        assert existing is not None
        return check_manifest(self.display, existing, manifest)

    def wipe(self) -> None:
        """--overwrite: delete what dspine-batch wrote here (never ``_dspine/damaged/``, never leases)."""
        top = [n for n in self.store.list("") if OUTPUT_NAMES.match(n)]
        ours = [f"{KEYS}/{n}" for n in self.store.list(KEYS)] + [f"{STAGING}/{n}" for n in self.store.list(STAGING)]
        ours += [f"{STATE}/{n}" for n in self.store.list(STATE) if not n.startswith("lease-")]
        ours += [f"{STATE}/{space}/{n}" for space in CLAIM_SPACES  # a stage's dedup claims
                 for n in self.store.list(f"{STATE}/{space}")]
        self.store.delete_many(ours + top)

    def free_bytes(self) -> int | None:
        return None

    def recover(self) -> None:
        """Finish a ``finalize --compact`` a crash interrupted (``remote_compact``), before any record is read."""
        remote_compact.recover(self)

    def forget_records(self) -> None:
        """The records this start read are stale (a retry changed some): read them again when next asked."""
        self._records.clear()

    # -- --retry-errors (``remote_supersede``) ----------------------------------------------------------------------
    def recover_retry(self, tag: str) -> str | None:
        return remote_supersede.recover(self, tag)

    def drop_rows(self, tag: str, part: str, ids: set[str]) -> int:
        return remote_supersede.drop_rows(self, tag, part.rsplit("/", 1)[-1], ids)

    def update_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the manifest (a retry's accepted change) with a compare-and-swap on the one read; a swap whose
        answer was lost (its retry meets 412) is read back: the manifest now holding our bytes is our swap."""
        got = self.store.get_with_etag(MANIFEST)
        body = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        if got is not None and got[0] == body:
            return
        if got is None or (self.store.replace(MANIFEST, body, got[1]) is None and self.store.get(MANIFEST) != body):
            raise FatalError(f"{self.store.url_of(MANIFEST)}: changed or gone while a retry updated it; run again")

    # -- state ----------------------------------------------------------------------------------------------------
    def read_state(self, tag: str) -> dict[str, Any]:
        data = self.store.get(f"{STATE}/state-{tag}.json")
        try:
            return json.loads(data) if data else {}
        except ValueError:
            return {}

    def write_state(self, tag: str, state: dict[str, Any]) -> None:
        """Advisory; written by the committer after the commits queued before it (a state file never counts rows
        whose record is not there yet), at most every ``STATE_SECONDS`` while a run goes on."""
        state["updated_at"] = time.time()
        body = json.dumps(state, indent=1, sort_keys=True).encode()
        rel = f"{STATE}/state-{tag}.json"
        if self.committer is None or state.get("state") != "running":
            self.flush()
            self.store.put(rel, body)
        else:
            self.committer.submit_state(rel, body)

    def states(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for n in sorted(self.store.list(STATE)):
            if n.startswith("state-") and n.endswith(".json"):
                tag = n[len("state-"):-len(".json")]
                out.append((tag, self.read_state(tag)))
        return out

    def write_success(self) -> None:
        """``_SUCCESS`` with a create-only write: exists at most once, never rewritten."""
        self.flush()
        self.store.create(SUCCESS, b"")

    def read_blob(self, rel: str) -> bytes | None:
        return self.store.get(rel)

    def has_blob(self, rel: str) -> bool:
        return self.store.head(rel) is not None

    def write_blob(self, rel: str, local: str) -> None:
        """An advisory file put whole (a GET sees the old bytes or the new, never a mix)."""
        self.store.upload(local, rel)

    def has_success(self) -> bool:
        return self.store.head(SUCCESS) is not None

    def remove_success(self) -> None:
        self.store.delete(SUCCESS)

    # -- the commit -----------------------------------------------------------------------------------------------
    def commit_part(self, name: str, table: pa.Table, keys: np.ndarray | None = None,
                    rows: int | None = None, token: str | None = None) -> dict[str, Any]:
        """Step 1 here, steps 2-4 on the committer (``Committer``): returns once the part is built and queued,
        so the pipeline fills the next part while this one travels. Returns the record it will commit. ``token``:
        the record's, when a journal must name it before the commit (``remote_compact``)."""
        if self.committer is None:
            self.committer = Committer(self)
        self.committer.check()
        self._records.clear()
        token = token or uuid.uuid4().hex[:16]
        fd, tmp = tempfile.mkstemp(prefix=".dspine-part-", suffix=".parquet", dir=local_tmp_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                w = ChecksumWriter(f)
                pq.write_table(table, w, compression="zstd", row_group_size=256 * 1024)
        except BaseException:
            os.unlink(tmp)
            raise
        meta = json.loads((table.schema.metadata or {}).get(b"dspine_batch.part", b"{}"))
        record = {"part": name, "rows": table.num_rows if rows is None else rows, "outputs": table.num_rows,
                  "error_rows": meta.get("error_rows", 0), "bytes": w.size, CHECKSUM: w.crc,
                  "committed_at": time.time(), "token": token, "staged": f"{STAGING}/{name}.{token}"}
        if keys is not None:  # in the record itself (``remote_layout.keys_fields``)
            record.update(keys_fields(keys))
        self.committer.submit(record, tmp)
        return record

    def upload(self, record: dict[str, Any], tmp: str) -> None:
        """Step 2: the part's bytes to its unique staging name (never read by readers)."""
        self.store.upload(tmp, record["staged"])

    def create_record(self, record: dict[str, Any]) -> None:
        """Step 3, the linearisation point: the create-only write of the commit record. Under a lease, sent (and
        retried) only while the lease is valid: past that another worker may own the shard and have swept this
        part's upload as an orphan."""
        name = record["part"]
        with self.owning():
            created = self.store.create(record_rel(name), json.dumps(record, sort_keys=True).encode())
        if not created:
            theirs = self.record_of(name) or {}
            if theirs.get("token") != record["token"]:  # not our own write whose answer was lost: another's
                raise FatalError(f"{self.store.url_of(record_rel(name))}: another worker committed this part "
                                 "first (its lease was taken over); this worker stops, its uncommitted rows are "
                                 "generated by the other")

    @contextmanager
    def owning(self) -> Iterator[None]:
        """A write as the shard's owner (a commit record, a record swap): refused once the lease is lost, and never
        sent or retried past the lease's validity (``storage.lease``). Without a lease, a plain block."""
        if self.lease is None:
            yield
            return
        self.lease.check()
        with retry_deadline(self.lease.deadline):
            yield

    def discard(self, record: dict[str, Any]) -> None:
        """Best effort removal of an uncommitted part's uploads (a crash leaves them to the next start's sweep).
        A record create that failed after retries may have landed (its answers lost): then the part is committed
        after all, its upload kept for the next start to publish."""
        try:
            if (self.record_of(record["part"]) or {}).get("token") == record["token"]:
                return
            self.store.delete_many([record["staged"]])
        except Exception:  # noqa: BLE001 - the sweep gets them
            pass

    def flush(self) -> None:
        """Wait until every queued part is committed and published (raises what failed)."""
        if self.committer is not None:
            self.committer.flush()

    def publish(self, record: dict[str, Any], delete: bool = True) -> None:
        """Make a committed part visible under its final name; idempotent (the record says what and from where).
        ``delete=False``: the staged object is left for a batched delete (or the next start's sweep)."""
        self.store.copy(record["staged"], record["part"], int(record["bytes"]))
        if delete:
            self.store.delete(record["staged"])

    def record_of(self, name: str) -> dict[str, Any] | None:
        """A part's commit record as the store holds it now (None when absent or unreadable)."""
        data = self.store.get(record_rel(name))
        try:
            rec = json.loads(data) if data else None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) and {"bytes", CHECKSUM, "outputs", "token"} <= rec.keys() else None

    # -- resume ---------------------------------------------------------------------------------------------------
    def records(self, tag: str | None = None) -> dict[str, dict[str, Any]]:
        """Every commit record (of one shard), by part name: fetched concurrently (one GET each), once per start
        (a start sweeps, checks and loads the same records; only this worker adds or moves them meanwhile)."""
        if tag not in self._records:
            self._records[tag] = self._fetch_records(tag)
        return dict(self._records[tag])

    def _fetch_records(self, tag: str | None) -> dict[str, dict[str, Any]]:
        listed = self.store.list(KEYS)
        names = []
        for n in listed:
            if n.startswith("commit-") and n.endswith(".json"):
                part = PART_PREFIX + n.removeprefix("commit-").removesuffix(".json") + ".parquet"
                m = PART_RE.match(part)
                if m and (tag is None or m.group(1) == tag):
                    names.append(part)
        paths = [self.store.path(record_rel(n)) for n in names]
        got = self.store.cat_many(paths)
        out = {}
        for name, path in zip(names, paths, strict=True):
            data = got.get(path)
            try:
                rec = json.loads(data) if isinstance(data, bytes) else None
            except ValueError:
                rec = None
            out[name] = rec if isinstance(rec, dict) else {"part": name, "unreadable": True}
        return dict(sorted(out.items()))

    def remove_staging(self, tag: str | None = None) -> int:
        """Finish every interrupted publish and sweep orphans (uploads no record names) of one shard (all with
        None). Call with the shard's lease held (all of them for None)."""
        records = self.records(tag)
        tokens = {r.get("token") for r in records.values()}
        top = self.store.list("")
        staged = self.store.list(STAGING)
        for name, rec in records.items():
            if rec.get("unreadable") or name in top:
                continue
            if rec["staged"].rsplit("/", 1)[-1] in staged:  # committed, publish interrupted: finish it
                self.publish(rec)
                top[name] = Listed(name, int(rec["bytes"]))
        orphans, unknown = [], 0
        for n in staged:
            part, _, token = n.rpartition(".")
            m = PART_RE.match(part)
            if m and (tag is None or m.group(1) == tag):
                rec = records.get(part)
                if token not in tokens or (rec is not None and part in top and rec.get("token") == token):
                    orphans.append(f"{STAGING}/{n}")
                    unknown += token not in tokens  # uncommitted; the others are copies of published parts
        self.store.delete_many(orphans)
        return unknown

    def check_parts(self, tag: str | None = None, checksum: bool = False) -> list[PartCheck]:
        """Each record against its published part: size (from one listing), and crc32 with ``checksum``."""
        records = self.records(tag)
        top = self.store.list("")
        staged = self.store.list(STAGING)
        checks = []
        for name, rec in records.items():
            url = self.store.url_of(name)
            if rec.get("unreadable"):
                checks.append(PartCheck(url, "unreadable (its commit record)"))
                continue
            info = {"rows": rec["rows"], "outputs": rec["outputs"], "error_rows": rec.get("error_rows", 0)}
            if name not in top:
                if rec["staged"].rsplit("/", 1)[-1] in staged:
                    checks.append(PartCheck(url, None, info, verified=True))  # committed, publish pending
                else:
                    checks.append(PartCheck(url, "missing"))
                continue
            size, want = top[name].size, int(rec["bytes"])
            if size != want:
                what = "truncated" if size < want else "altered"
                checks.append(PartCheck(url, f"{what} ({size:,} bytes, {want:,} committed)"))
                continue
            checks.append(PartCheck(url, None, info, verified=True))
        if checksum:
            good = [c for c in checks if c.problem is None]
            with ThreadPoolExecutor(4) as pool:
                for c, crc in zip(good, pool.map(lambda c: self._crc(c.path.rsplit("/", 1)[-1], records), good),
                                  strict=True):
                    want = int(records[c.path.rsplit("/", 1)[-1]][CHECKSUM])
                    if crc is not None and crc != want:
                        c.problem, c.info = f"altered ({CHECKSUM} {crc:08x}, {want:08x} committed)", None
        return checks

    def _crc(self, name: str, records: dict[str, dict[str, Any]]) -> int | None:
        rec = records[name]
        for rel in (name, rec["staged"]):
            try:
                with self.store.open(rel) as f:
                    crc = 0
                    while chunk := f.read(4 << 20):
                        crc = zlib.crc32(chunk, crc)
                    return crc
            except FileNotFoundError:
                continue
        return None

    def handle_damage(self, check: PartCheck, on_damaged: str, report: Callable[[str], None]) -> None:
        """Like ``resume.handle_damage``: move the part and its record aside to ``_dspine/damaged/`` (copy, then
        delete: the part first, so it is no longer visible before its record goes), or refuse with ``fail``."""
        if on_damaged == "fail":
            raise FatalError(f"{check.path}: committed part is {check.problem}; stopped (--on-damaged-part fail): "
                             "rerun with --on-damaged-part repair to move it aside and regenerate its rows")
        name = check.path.rsplit("/", 1)[-1]
        self._records.clear()
        dest = f"{DAMAGED}/part-{stem(name)}{time.strftime('.%Y%m%dT%H%M%S')}.{uuid.uuid4().hex[:6]}"
        listed = self.store.list("")
        if name in listed:
            self.store.copy(name, dest + ".damaged")
            self.store.delete(name)
        if self.store.head(record_rel(name)) is not None:
            self.store.copy(record_rel(name), dest + ".commit.json")
            self.store.delete(record_rel(name))
        self.remove_success()
        report(f"{check.path}: committed part is {check.problem}; moved aside to {self.store.url_of(dest)}.*, its rows "
               "will be generated again")

    def verify_parts(self, tag: str | None, on_damaged: str, report: Callable[[str], None] = _warn,
                     checksum: bool = True) -> list[PartCheck]:
        good = []
        for check in self.check_parts(tag, checksum):
            if check.problem is None:
                good.append(check)
            else:
                self.handle_damage(check, on_damaged, report)
        return good

    def load_done(self, tag: str, id_column: bool = True, on_damaged: str = "repair",
                  report: Callable[[str], None] = _warn) -> DoneSet:
        """The shard's done-set from its records' key objects (row ids read from the part when a key object
        does not match its record)."""
        records = self.records(tag)
        checks = self.check_parts(tag)
        keys = KeySet()
        rows = errors = outputs = 0
        damaged = 0
        good = []
        for c in checks:
            if c.problem is not None:
                self.handle_damage(c, on_damaged, report)
                damaged += 1
            else:
                good.append((c, records[c.path.rsplit("/", 1)[-1]]))
        for _c, rec in good:
            hashes = record_keys(rec)
            if hashes is None:
                hashes = self._row_hashes(rec, id_column)
            keys.add_many(hashes)
            rows += rec["rows"]
            errors += rec.get("error_rows", 0)
            outputs += rec["outputs"]
        seqs = [int(PART_RE.match(n).group(2)) for n in records]  # type: ignore[union-attr]
        return DoneSet(keys, rows, errors, outputs, max(seqs) + 1 if seqs else 0, damaged)

    def _row_hashes(self, rec: dict[str, Any], id_column: bool) -> np.ndarray:
        name = rec["part"]
        rel = name if self.store.head(name) is not None else rec["staged"]
        with self.store.open(rel) as f:
            t = pq.read_table(f, columns=["row_id"])
        ids = pc.unique(t.column("row_id")).to_pylist()
        return (key_hashes if id_column else fallback_id_hashes)(ids)

    def part_urls(self) -> list[str]:
        """Published committed parts, in (shard, seq) order: what readers and the ops read."""
        return [self.store.url_of(n) for n in sorted(self.store.list("")) if PART_RE.match(n)]

    def lease_states(self) -> dict[str, bool]:
        """shard tag -> whether a live lease holds it (``status``: running, or dead)."""
        out = {}
        for rel in self._leases():
            tag = rel.removeprefix(f"{STATE}/lease-").removesuffix(".json")
            out[tag] = _held(read_lease(self.store, tag))
        return out


def _held(lease: dict[str, Any] | None) -> bool:
    """A lease whose holder may be alive: unexpired, and not provably dead (``holder_gone``)."""
    return live(lease) and holder_gone(lease or {}) is None


class Committer:
    """Steps 2-4 of the commit off the pipeline's thread, with exactly-once kept: uploads run concurrently (a pool
    of ``UPLOADS``), but the commit records are created strictly in part order, each only after the one before
    it was created, by one thread. So one writer's parts are committed in sequence with no gap, which is what
    makes the create-only record a fence between two writers (``storage.lease``); publishing runs on the pool
    after its record. At most ``QUEUE`` parts wait (their local files bound the temp space); the first failure
    stops everything queued after it (their uploads removed) and is raised by the next ``submit``/``flush``."""

    UPLOADS = 4
    QUEUE = 8
    STATE_SECONDS = 1.0
    DELETE_BATCH = 64  # staged copies of published parts removed per batched delete request

    def __init__(self, out: ObjectOutput):
        self.out = out
        self.pool = ThreadPoolExecutor(self.UPLOADS, thread_name_prefix="dspine-upload")
        self.order = ThreadPoolExecutor(1, thread_name_prefix="dspine-commit")
        self.slots = threading.BoundedSemaphore(self.QUEUE)
        self.pending: list[Future[Any]] = []
        self.error: BaseException | None = None
        self._state_at = 0.0
        self.published: list[str] = []  # staged names of published parts, awaiting their batched delete
        self._mu = threading.Lock()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, record: dict[str, Any], tmp: str) -> None:
        self.slots.acquire()
        try:
            upload = self.pool.submit(self._upload, record, tmp)
        except BaseException:
            self.slots.release()
            os.unlink(tmp)
            raise
        self._track(self.order.submit(self._commit, record, upload))

    def _track(self, fut: Future[Any]) -> None:
        with self._mu:
            self.pending = [f for f in self.pending if not f.done()] + [fut]

    def _upload(self, record: dict[str, Any], tmp: str) -> None:
        try:
            if self.error is None:
                self.out.upload(record, tmp)
        finally:
            os.unlink(tmp)

    def _commit(self, record: dict[str, Any], upload: Future[Any]) -> None:
        try:
            upload.result()
            if self.error is not None:
                raise self.error
            self.out.create_record(record)
        except BaseException as e:
            self.error = self.error or e
            self.slots.release()
            self.out.discard(record)
            return
        self.slots.release()
        self._track(self.pool.submit(self._publish, record))

    def _publish(self, record: dict[str, Any]) -> None:
        try:
            self.out.publish(record, delete=False)
        except BaseException as e:  # committed: the next start (or finalize) publishes it
            self.error = self.error or e
            return
        with self._mu:
            self.published.append(record["staged"])
            batch = self.published if len(self.published) >= self.DELETE_BATCH else []
            if batch:
                self.published = []
        if batch:
            self._delete(batch)

    def _delete(self, staged: list[str]) -> None:
        try:
            self.out.store.delete_many(staged)
        except Exception:  # noqa: BLE001 - leftovers of published parts: the next start's sweep removes them
            pass

    def submit_state(self, rel: str, body: bytes) -> None:
        now = time.monotonic()
        if now - self._state_at < self.STATE_SECONDS:
            return
        self._state_at = now
        self._track(self.order.submit(self._put_state, rel, body))

    def _put_state(self, rel: str, body: bytes) -> None:
        if self.error is None:
            try:
                self.out.store.put(rel, body)
            except Exception:  # noqa: BLE001 - advisory; a store that fails here fails the next commit too
                pass

    def flush(self) -> None:
        """Every queued part committed and published (and its staged copy deleted), or the first failure raised."""
        while True:
            with self._mu:
                waiting = [f for f in self.pending if not f.done()]
            if not waiting:
                break
            for f in waiting:
                f.exception()
        with self._mu:
            batch, self.published = self.published, []
        self._delete(batch)
        self.check()


__all__ = ["ObjectOutput", "SUCCESS", "lease_name"]
