"""Shard ownership on an object store: a lease object instead of ``flock``.

``_dspine/lease-<shard>.json`` holds who owns the shard and until when. It is taken with a create-only write
(or, when the one there has expired, a compare-and-swap on its ETag, so two workers taking over the same dead
lease cannot both win), renewed by compare-and-swap from a background thread every third of its lifetime, and
deleted on release. A worker that finds a live lease exits in one line naming the holder; a worker killed -9
stops renewing, and once its lease expires the next start takes the shard over. Expiry uses each worker's
clock: keep the clocks within a small fraction of the lifetime (NTP does).

A lease alone cannot stop a worker that paused past its expiry from committing once more; the commit records'
create-only writes do (see ``dspine_batch.pipeline.remote``): a shard's parts are numbered, and of two writers
racing for one number exactly one wins.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from dspine_batch.errors import FatalError, LockedError
from dspine_batch.storage.objects import ObjectStore

DEFAULT_SECONDS = 60.0


def lease_seconds() -> float:
    """The lease lifetime: ``DSPINE_BATCH_LEASE_SECONDS`` (tests make it short), default 60 s."""
    try:
        return max(1.0, float(os.environ.get("DSPINE_BATCH_LEASE_SECONDS", DEFAULT_SECONDS)))
    except ValueError:
        return DEFAULT_SECONDS


def lease_name(tag: str) -> str:
    return f"_dspine/lease-{tag}.json"


def read_lease(store: ObjectStore, tag: str) -> dict[str, Any] | None:
    """The lease's content (``holder``, ``expires_at``, ...), None when there is none or it is unreadable."""
    data = store.get(lease_name(tag))
    try:
        out = json.loads(data) if data else None
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def live(lease: dict[str, Any] | None, now: float | None = None) -> bool:
    return bool(lease) and float(lease.get("expires_at", 0)) > (time.time() if now is None else now)


class Lease:
    """Owns one shard of an object-store OUTDIR while held; ``check()`` before every commit."""

    def __init__(self, store: ObjectStore, tag: str, seconds: float | None = None,
                 before_release: Callable[[], None] | None = None):
        self.store, self.tag, self.rel = store, tag, lease_name(tag)
        self.seconds = lease_seconds() if seconds is None else seconds
        self.token = uuid.uuid4().hex
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self.etag: str | None = None
        self.lost: str | None = None  # why, once this worker no longer owns the shard
        self.took_over: dict[str, Any] | None = None  # the expired lease this one replaced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        self._renewed = time.monotonic()  # last time the store confirmed the lease
        self.before_release = before_release  # e.g. let queued commits land while the shard is still ours

    def _body(self) -> bytes:
        now = time.time()
        return json.dumps({"holder": self.holder, "token": self.token, "shard": self.tag, "renewed_at": now,
                           "expires_at": now + self.seconds, "seconds": self.seconds}).encode()

    def acquire(self) -> Lease:
        for _ in range(20):
            got = self.store.get_with_etag(self.rel)
            if got is None:
                self.etag = self.store.create_etag(self.rel, self._body())
                if self.etag is not None:
                    break
                continue  # someone created it meanwhile: read theirs
            data, etag = got
            try:
                cur = json.loads(data)
            except ValueError:
                cur = {}
            if cur.get("token") == self.token:  # our own write whose answer was lost
                self.etag = etag
                break
            if live(cur):
                ago = time.time() - float(cur.get("renewed_at", 0))
                raise LockedError(
                    f"{self.store.display}: shard {self.tag} is held by {cur.get('holder', 'another worker')} "
                    f"(lease {self.store.url_of(self.rel)} renewed {ago:.0f}s ago; it expires "
                    f"{float(cur.get('seconds', self.seconds)):.0f}s after its holder stops renewing it); "
                    "wait for it or stop it first")
            self.etag = self.store.replace(self.rel, self._body(), etag)
            if self.etag is not None:
                self.took_over = cur
                break
        else:
            raise LockedError(f"{self.store.url_of(self.rel)}: the lease keeps changing; is another worker starting?")
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.tag}", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried at the next tick
                if time.monotonic() - self._renewed > self.seconds * 0.9:
                    self.lost = f"could not renew the lease for {self.seconds:.0f}s ({str(e)[:120]})"
            if self.lost:
                return

    def renew(self) -> None:
        with self._mu:
            if self.etag is None or self.lost:
                return
            etag = self.store.replace(self.rel, self._body(), self.etag)
            if etag is None:
                cur = read_lease(self.store, self.tag) or {}
                if cur.get("token") == self.token:  # our renewal landed, its answer did not
                    got = self.store.get_with_etag(self.rel)
                    etag = got[1] if got else None
                if etag is None:
                    self.lost = f"the shard was taken over by {cur.get('holder', 'another worker')}"
                    return
            self.etag = etag
            self._renewed = time.monotonic()

    def check(self) -> None:
        """Raise when this worker no longer owns the shard (its lease was taken over after expiring)."""
        if not self.lost and time.monotonic() - self._renewed > self.seconds * 0.9:
            self.lost = f"not renewed for {time.monotonic() - self._renewed:.0f}s (the store did not answer)"
        if self.lost:
            raise FatalError(f"{self.store.display}: shard {self.tag}: lease lost ({self.lost}); this worker stops "
                             "without committing more; its uncommitted rows are generated by the new holder")

    def release(self) -> None:
        if self.before_release is not None and self.etag is not None:
            self.before_release()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._mu:
            if self.etag is not None and not self.lost:
                cur = read_lease(self.store, self.tag) or {}
                if cur.get("token") == self.token:
                    self.store.delete(self.rel)
            self.etag = None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
