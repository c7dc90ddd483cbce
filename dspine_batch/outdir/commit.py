"""The commit of one part, the same on every store: stage -> create-only record -> publish -> cleanup.

Invariant: **a part is committed iff its commit record exists** (``records``); readers glob ``OUTDIR/*.parquet``
and see published parts only, and a part is published only after its record exists, so a reader never sees an
uncommitted part. All samples of a row go into the same part, so "the row's key is in a record" means "done".

1. **stage**: the Parquet bytes, counted and crc32-ed on the way out, under a unique name
   ``_dspine/staging/<part>.<token>`` (never read by readers). On a local disk the file is built right there and
   fsynced; on a store it is built in a local temp file and uploaded;
2. **record**, the linearisation point: the create-only write (``If-None-Match: *``; a hard link on a disk) of
   ``_dspine/keys/commit-<X>.json`` naming the token, the staged name, bytes, crc32 and row keys. Parts are
   numbered per shard, so of two writers of a shard (a worker paused past its lease) exactly one commits a number;
3. **publish**: the staged bytes under the final name (a disk's ``rename`` + directory fsync; a store's
   server-side copy);
4. **cleanup**: a store's staged copies are deleted in batches (one request for many parts); a rename leaves none.

A crash before 2 leaves an orphan upload that the next start of the shard deletes (``recovery``: no record names
its token); a crash after 2 leaves a record whose publish the next start completes. A failure at 1 or 2 that is
not a crash (a full disk, a 403) removes what 1 wrote and commits nothing. A local record is not fsynced (it cost
~10 % of throughput at 1,000-row commits): one lost to a power cut leaves its published part "trusted by row
count", like a part from before records existed, or its staged part an orphan; it can never drop or double rows.

On a store steps 1b-4 run on ``Committer`` threads while the pipeline fills the next part; on a disk
(``Outdir.inline``) they run at once, on the pipeline's thread, which is what a cheap rename wants and what makes a
full disk stop the commit that met it.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from dspine_batch.errors import FatalError, disk_full_named
from dspine_batch.outdir.core import Outdir
from dspine_batch.outdir.layout import record_rel, staged_rel
from dspine_batch.outdir.records import encode, new_record, write_part
from dspine_batch.outdir.watermark import Span
from dspine_batch.storage.local import size_of, unlink_quietly
from dspine_batch.storage.objects import local_tmp_dir

NOT_COMMITTED = "this part was not committed"


def stage(out: Outdir, name: str, table: pa.Table, keys: np.ndarray | None, rows: int | None,
          token: str | None = None, spans: dict[str, list[Span]] | None = None) -> tuple[dict[str, Any], str | None]:
    """Step 1: the part's bytes written (to their staging name on a disk, to a local temp file for a store's
    upload); returns its record-to-be and the temp file to upload (None when built in place)."""
    token = token or uuid.uuid4().hex[:16]
    staged = staged_rel(name, token)
    in_place = out.store.local_path(staged)
    if in_place is not None:
        os.makedirs(os.path.dirname(in_place), exist_ok=True)
        path = in_place
        f = open(path, "wb")  # noqa: SIM115 - closed below
    else:
        fd, path = tempfile.mkstemp(prefix=".dspine-part-", suffix=".parquet", dir=local_tmp_dir())
        f = os.fdopen(fd, "wb")
    try:
        with disk_full_named(out.store.url_of(name), lambda: size_of(path), NOT_COMMITTED):
            with f:
                w = write_part(table, f)
                if in_place is not None:
                    f.flush()
                    os.fsync(f.fileno())
    except BaseException:
        unlink_quietly(path)
        raise
    return new_record(name, table, w, token, staged, rows, keys, spans), (None if in_place is not None else path)


def create_record(out: Outdir, record: dict[str, Any]) -> None:
    """Step 2, the linearisation point: the create-only write of the commit record. Under a lease, sent (and
    retried) only while the lease is valid: past that another worker may own the shard and have swept this part's
    upload as an orphan. A record already there with our token is our own write whose answer was lost."""
    name = record["part"]
    with out.owning():
        created = out.store.create(record_rel(name), encode(record), durable=False, then=NOT_COMMITTED)
    out.forget_records()
    if not created:
        theirs = out.record_of(name) or {}
        if theirs.get("token") != record["token"]:
            raise FatalError(f"{out.store.url_of(record_rel(name))}: another worker committed this part first (its "
                             "lease was taken over); this worker stops, its uncommitted rows are generated by the "
                             "other")


def discard(out: Outdir, record: dict[str, Any]) -> None:
    """Best effort removal of an uncommitted part's staged bytes (a crash leaves them to the next start's sweep).
    A record create that failed after retries may have landed (its answers lost): then the part is committed after
    all, its staged bytes kept for the next start to publish."""
    try:
        if (out.record_of(record["part"]) or {}).get("token") == record["token"]:
            return
        out.store.delete(record["staged"])
    except Exception:  # noqa: BLE001 - the sweep gets them
        pass


class Committer:
    """Steps 1b-4 of each part, in part order. ``inline`` (a local disk): each step runs inside ``submit``, and a
    failure is raised there. Otherwise, with exactly-once kept: uploads run concurrently (a pool of ``UPLOADS``),
    but the records are created strictly in part order, each only after the one before it, by one thread, so one
    writer's parts are committed in sequence with no gap, which is what makes the create-only record a fence between
    two writers (``storage.lease``); publishing runs on the pool after its record. At most ``QUEUE`` parts wait
    (their local files bound the temp space); the first failure stops everything queued after it (their uploads
    removed) and is raised by the next ``submit``/``flush``."""

    UPLOADS = 4
    QUEUE = 8
    STATE_SECONDS = 1.0
    DELETE_BATCH = 64  # staged copies of published parts removed per batched delete request

    def __init__(self, out: Outdir):
        self.out = out
        self.inline = out.inline
        self.error: BaseException | None = None
        self.published: list[str] = []  # staged names of published parts, awaiting their batched delete
        self._mu = threading.Lock()
        if self.inline:
            return
        self.pool = ThreadPoolExecutor(self.UPLOADS, thread_name_prefix="dspine-upload")
        self.order = ThreadPoolExecutor(1, thread_name_prefix="dspine-commit")
        self.slots = threading.BoundedSemaphore(self.QUEUE)
        self.pending: list[Future[Any]] = []
        self._state_at = 0.0

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, record: dict[str, Any], tmp: str | None) -> None:
        if self.inline:
            try:
                if tmp is not None:
                    self._upload(record, tmp)
                create_record(self.out, record)
            except BaseException:
                discard(self.out, record)
                raise
            self.out.publish(record)  # a failure here leaves the part committed: the next start publishes it
            return
        self.slots.acquire()
        try:
            upload = self.pool.submit(self._upload, record, tmp)
        except BaseException:
            self.slots.release()
            if tmp is not None:
                os.unlink(tmp)
            raise
        self._track(self.order.submit(self._commit, record, upload))

    def _track(self, fut: Future[Any]) -> None:
        with self._mu:
            self.pending = [f for f in self.pending if not f.done()] + [fut]

    def _upload(self, record: dict[str, Any], tmp: str | None) -> None:
        if tmp is None:
            return
        try:
            if self.error is None:
                self.out.store.upload(tmp, record["staged"])
        finally:
            os.unlink(tmp)

    def _commit(self, record: dict[str, Any], upload: Future[Any]) -> None:
        try:
            upload.result()
            if self.error is not None:
                raise self.error
            create_record(self.out, record)
        except BaseException as e:
            self.error = self.error or e
            self.slots.release()
            discard(self.out, record)
            return
        self.slots.release()
        self._track(self.pool.submit(self._publish, record))

    def _publish(self, record: dict[str, Any]) -> None:
        try:
            self.out.publish(record, delete=False)
        except BaseException as e:  # committed: the next start (or finalize) publishes it
            self.error = self.error or e
            return
        if self.out.store.renames:
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

    def submit_state(self, rel: str, body: bytes) -> bool:
        """Queue an advisory state write behind the commits before it (a state file never counts rows whose record
        is not there yet), at most every ``STATE_SECONDS``; False when inline (write it now)."""
        if self.inline:
            return False
        now = time.monotonic()
        if now - self._state_at >= self.STATE_SECONDS:
            self._state_at = now
            self._track(self.order.submit(self._put_state, rel, body))
        return True

    def _put_state(self, rel: str, body: bytes) -> None:
        if self.error is None:
            try:
                self.out.store.put(rel, body, durable=False)
            except Exception:  # noqa: BLE001 - advisory; a store that fails here fails the next commit too
                pass

    def flush(self) -> None:
        """Every queued part committed and published (and its staged copy deleted), or the first failure raised."""
        if not self.inline:
            while True:
                with self._mu:
                    waiting = [f for f in self.pending if not f.done()]
                if not waiting:
                    break
                for f in waiting:
                    f.exception()
        with self._mu:
            batch, self.published = self.published, []
        if batch:
            self._delete(batch)
        self.check()


def commit_part(out: Outdir, committer: Committer, name: str, table: pa.Table, keys: np.ndarray | None = None,
                rows: int | None = None, token: str | None = None, spans: dict[str, list[Span]] | None = None) \
        -> dict[str, Any]:
    """Commit one part (``token``: the record's, when a journal must name it first, as compaction's does). On a disk
    it returns once the part is published; on a store once it is built and queued (``Committer``), so the pipeline
    fills the next part while this one travels. Returns the record it commits."""
    committer.check()
    out.forget_records()
    record, tmp = stage(out, name, table, keys, rows, token, spans)
    committer.submit(record, tmp)
    return record
