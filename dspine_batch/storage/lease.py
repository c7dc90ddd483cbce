"""Shard ownership on an object store: a lease object instead of ``flock``, that never traps a rerun.

``_dspine/lease-<shard>.json`` holds who owns the shard and until when. It is taken with a create-only write (or,
over a dead holder's lease, a compare-and-swap on its ETag, so two workers taking over the same lease cannot both
win), renewed by compare-and-swap from a background thread every quarter of its lifetime, and deleted on release.

A worker that finds another's lease:
  - takes it over at once when its holder is provably dead (``holder_gone``): the lease records the holder's host,
    boot id, pid namespace, pid and the pid's start time, so a worker on the same machine (same hostname *and*
    boot id *and* pid namespace: containers may share a hostname) sees that the pid is gone, has exited, or is
    another process now. That is what a rerun right after a kill -9 meets: it resumes at once;
  - takes it over once it has expired;
  - otherwise watches it, after one line saying whose lease it is, since when, and how long at most it waits:
    if the holder renews it meanwhile it is alive, and this start ends with ``LockedError`` (exit 75: a requeue
    may come back) naming it; if not, it expires and is taken over.

Validity is timed from the moment a renewal is *stamped*, not from its answer: the body says ``expires_at =
stamp + lifetime``, and others take over past that on their clocks, whenever the write landed and however long its
retries took. So ``check()`` passes only until ``stamp + VALID x lifetime`` (a quarter of the lifetime left for
clock skew and requests in flight), a renewal's retries stop a quarter-lifetime after its stamp, and a commit under
the lease sends nothing after the lease's validity (``deadline``). Expiry uses each worker's clock: keep clocks
within a small fraction of the lifetime (NTP does).

A lease alone cannot stop a worker that paused past its expiry from committing once more; the commit records'
create-only writes do (see ``dspine_batch.outdir``): a shard's parts are numbered, and of two writers
racing for one number exactly one wins.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from dspine_batch.errors import FatalError, LockedError
from dspine_batch.storage.fs import retry_deadline
from dspine_batch.storage.objects import ObjectStore
from dspine_batch.storage.urls import redact

DEFAULT_SECONDS = 60.0
VALID = 0.75  # of a lifetime from its stamp, the holder trusts its lease; the rest covers skew and requests in flight
RENEW = 0.25  # of a lifetime between renewals (and the longest a renewal's retries go on)
RACES = 20  # compare-and-swap races lost in a row before a start gives up (exit 75)


def lease_seconds() -> float:
    """The lease lifetime: ``DSPINE_BATCH_LEASE_SECONDS`` (tests make it short), default 60 s."""
    try:
        return max(1.0, float(os.environ.get("DSPINE_BATCH_LEASE_SECONDS", DEFAULT_SECONDS)))
    except ValueError:
        return DEFAULT_SECONDS


def lease_name(tag: str) -> str:
    return f"_dspine/lease-{tag}.json"


def _parse(data: bytes | None) -> dict[str, Any] | None:
    try:
        out = json.loads(data) if data else None
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def read_lease(store: ObjectStore, tag: str) -> dict[str, Any] | None:
    """The lease's content (``holder``, ``expires_at``, ...), None when there is none or it is unreadable."""
    return _parse(store.get(lease_name(tag)))


def live(lease: dict[str, Any] | None, now: float | None = None) -> bool:
    """Not expired on this machine's clock (its holder may still be provably dead: ``holder_gone``)."""
    return bool(lease) and float(lease.get("expires_at", 0)) > (time.time() if now is None else now)


# -- who holds it: enough to prove, on the same machine, that the holder is dead -----------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid`` from ``/proc/<pid>/stat``; None when no such
    process (or no ``/proc``)."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:
        fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and parentheses
        return fields[0], int(fields[19])  # field 3 (state) and field 22 (starttime)
    except (IndexError, ValueError):
        return None


def process_identity() -> dict[str, Any]:
    """This process as a lease records it: host, boot id, pid namespace, pid, and the pid's start time (a pid alone
    is reused; a pid with its start time and boot id is not). Fields this system cannot tell are None."""
    pid = os.getpid()
    try:
        pid_ns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    stat = _proc_stat(pid)
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns,
            "pid": pid, "pid_start": stat[1] if stat else None}


def holder_gone(lease: dict[str, Any], me: dict[str, Any] | None = None) -> str | None:
    """Why the lease's holder is certainly dead, or None when that cannot be proved: another host, another boot,
    another pid namespace (a container sharing the hostname), a lease without these fields, or a process that is
    still there (running, sleeping, or stopped: a stopped one may continue, so only its lease's expiry frees it)."""
    me = process_identity() if me is None else me
    for k in ("host", "boot_id", "pid_ns"):
        if not me.get(k) or lease.get(k) != me[k]:
            return None
    pid, start = lease.get("pid"), lease.get("pid_start")
    if not isinstance(pid, int) or not isinstance(start, int) or pid <= 0:
        return None
    stat = _proc_stat(pid)
    if stat is None:
        return "its process is gone"
    state, started = stat
    if started != start:
        return f"its pid {pid} is another process now"
    if state in ("Z", "X"):
        return "its process has exited"
    return None


def _log(msg: str) -> None:
    print(f"dspine-batch: {redact(msg)}", file=sys.stderr, flush=True)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Lease:
    """Owns one shard of an object-store OUTDIR while held; ``check()`` before every commit. ``log`` gets the one
    line a start prints while it waits out a silent holder, and the line of a takeover."""

    def __init__(self, store: ObjectStore, tag: str, seconds: float | None = None,
                 before_release: Callable[[], None] | None = None, log: Callable[[str], None] = _log):
        self.store, self.tag, self.rel = store, tag, lease_name(tag)
        self.seconds = lease_seconds() if seconds is None else seconds
        self.token = uuid.uuid4().hex
        self.me = process_identity()
        self.holder = f"pid {self.me['pid']} on {self.me['host']}"
        self.etag: str | None = None
        self.lost: str | None = None  # why, once this worker no longer owns the shard
        self.took_over: dict[str, Any] | None = None  # the lease this one replaced (``why``: how its holder ended)
        self.log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        self._valid_until = 0.0  # time.monotonic() until which nobody else may take the lease over
        self._failure = ""  # the last renewal's error, for the lost line
        self.before_release = before_release  # e.g. let queued commits land while the shard is still ours

    # -- the body and its validity --------------------------------------------------------------------------------
    def _body(self) -> bytes:
        now = time.time()
        return json.dumps({"holder": self.holder, "token": self.token, "shard": self.tag, "renewed_at": now,
                           "expires_at": now + self.seconds, "seconds": self.seconds, **self.me}).encode()

    def _confirmed(self, body: dict[str, Any]) -> None:
        """The store holds ``body`` (ours): valid until ``VALID`` of a lifetime after its stamp, on this machine's
        monotonic clock (the stamp is converted once, a moment after it was taken)."""
        stamp = float(body.get("renewed_at", 0))
        at = time.monotonic() - (time.time() - stamp) + self.seconds * VALID
        self._valid_until = max(self._valid_until, at)

    @property
    def deadline(self) -> float:
        """The ``time.monotonic()`` after which this worker must send no write as the shard's owner."""
        return self._valid_until

    # -- taking it --------------------------------------------------------------------------------------------------
    def acquire(self) -> Lease:
        watched: dict[str, Any] | None = None
        races = 0
        while races < RACES:
            got = self.store.get_with_etag(self.rel)
            if got is None:
                body = self._body()
                etag = self.store.create_etag(self.rel, body)
                if etag is not None:
                    self.etag = etag
                    self._confirmed(json.loads(body))
                    break
                races += 1  # someone created it meanwhile (or our create's answer was lost): read it
                continue
            data, etag = got
            cur = _parse(data) or {}
            if cur.get("token") == self.token:  # our own write whose answer was lost
                self.etag = etag
                self._confirmed(cur)
                break
            why = holder_gone(cur, self.me)
            if why is None and not live(cur):
                why = f"it expired {time.time() - float(cur.get('expires_at', 0)):.0f}s ago"
            if why is not None:
                body = self._body()
                new = self.store.replace(self.rel, body, etag)
                if new is not None:
                    self.etag, self.took_over = new, {**cur, "why": why}
                    self._confirmed(json.loads(body))
                    self.log(f"shard {self.tag}: took over the lease of {cur.get('holder', 'a dead worker')} ({why})")
                    break
                races += 1  # changed meanwhile (or our takeover's answer was lost): read it again
                continue
            if watched is None:
                watched = cur
                renewed = float(cur.get("renewed_at", 0))
                wait = max(0.0, float(cur.get("expires_at", 0)) - time.time())
                self.log(f"shard {self.tag}: leased to {cur.get('holder', 'another worker')} (renewed at "
                         f"{_clock(renewed)}, {time.time() - renewed:.0f}s ago); waiting up to {wait:.0f}s: if it is "
                         "renewed meanwhile its holder is alive and this start ends (exit 75), if not it is taken over")
            elif (cur.get("token"), cur.get("renewed_at")) != (watched.get("token"), watched.get("renewed_at")):
                raise LockedError(
                    f"{self.store.display}: shard {self.tag} is held by {cur.get('holder', 'another worker')}, which "
                    f"is alive (it renewed its lease {self.store.url_of(self.rel)} while this worker watched); this "
                    "start ends: run it again (or let the scheduler requeue it) once that worker has stopped")
            time.sleep(max(0.05, min(1.0, self.seconds / 20)))
        else:
            raise LockedError(f"{self.store.url_of(self.rel)}: the lease keeps changing hands; is another worker "
                              "starting? Run again once it has")
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.tag}", daemon=True)
        self._thread.start()
        return self

    # -- keeping it -------------------------------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        pause = self.seconds * RENEW
        while not self._stop.wait(pause):
            try:
                self.renew()
                pause = self.seconds * RENEW
            except Exception as e:  # noqa: BLE001 - a failed renewal is tried again soon, with a fresh stamp
                self._failure = str(e)[:120]
                pause = min(1.0, self.seconds / 20)
            if not self.lost and time.monotonic() >= self._valid_until:
                self.lost = self._unconfirmed()
            if self.lost:
                return

    def _unconfirmed(self) -> str:
        why = f": {self._failure}" if self._failure else ""
        return (f"the store did not confirm a renewal within {self.seconds * VALID:.0f}s{why}; others may take it "
                "over from now")

    def renew(self) -> None:
        """Stamp and swap; the swap's retries end a quarter-lifetime after its stamp (a later one would carry a
        stale stamp: the next renewal sends a fresh one instead). A lost answer is read back by token."""
        with self._mu:
            if self.etag is None or self.lost:
                return
            body = self._body()
            with retry_deadline(time.monotonic() + self.seconds * RENEW):
                etag = self.store.replace(self.rel, body, self.etag)
                if etag is not None:
                    self.etag = etag
                    self._confirmed(json.loads(body))
                    return
                got = self.store.get_with_etag(self.rel)  # 412: changed, or our swap landed and its answer was lost
            cur = _parse(got[0]) if got else None
            if cur is None or cur.get("token") != self.token:
                self.lost = f"the shard was taken over by {(cur or {}).get('holder', 'another worker')}"
                return
            assert got is not None
            self.etag = got[1]
            self._confirmed(cur)  # the body the store holds: ours, of this renewal or an earlier unanswered one

    def check(self) -> None:
        """Raise when this worker may no longer own the shard: its lease was taken over, or the store has not
        confirmed it for so long that another worker may take it over (``VALID`` of a lifetime since the stamp of
        the last confirmed renewal)."""
        if not self.lost and time.monotonic() >= self._valid_until:
            self.lost = self._unconfirmed()
        if self.lost:
            raise FatalError(f"{self.store.display}: shard {self.tag}: lease lost ({self.lost}); this worker stops "
                             "without committing more; its uncommitted rows are generated by the new holder")

    # -- giving it back ---------------------------------------------------------------------------------------------
    def release(self) -> None:
        if self.before_release is not None and self.etag is not None:
            self.before_release()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._mu:
            # only while still valid: past that another worker may hold it, and deleting it would free theirs
            if self.etag is not None and not self.lost and time.monotonic() < self._valid_until:
                with retry_deadline(self._valid_until):
                    cur = read_lease(self.store, self.tag) or {}
                    if cur.get("token") == self.token:
                        self.store.delete(self.rel)
            self.etag = None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
