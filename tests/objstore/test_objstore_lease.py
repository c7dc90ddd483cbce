"""Leases that never trap a rerun (issue 50), against a real S3 server on 127.0.0.1 (moto) and the fault proxy.

A holder that stops renewing (SIGSTOP) is waited out after one line, taken over, and when it continues its commit
record's create-only write loses to the new holder's; a renewal whose answer comes late cannot make ``check()``
pass after a takeover (validity is timed from the renewal's stamp); a store that ignores ``If-None-Match`` or
``If-Match`` is refused as an OUTDIR. The kill -9 / live-holder cases run in ``test_objstore_crash`` (s3) and
``test_objstore_azure`` (az)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from faultproxy import FaultProxy
from helpers import prompts, run_cli, spawn, write_jsonl
from test_objstore_crash import GEN, _assert_clean, _exactly_once, _wait

from dspine_batch.errors import FatalError
from dspine_batch.storage import fs
from dspine_batch.storage.lease import Lease
from dspine_batch.storage.objects import ObjectStore

TAG = "00000-of-00001"


def _is_record_create(chunk: bytes) -> bool:
    low = chunk.lower()
    return chunk.startswith(b"PUT ") and b"/_dspine/keys/commit-" in chunk and b"\r\nif-none-match:" in low


def test_a_holder_that_stops_renewing_is_waited_out_and_cannot_commit_when_it_continues(tmp_path, s3, s3env,
                                                                                          s3_endpoint, bucket, capsys):
    """Worker A is stopped (SIGSTOP) while its third commit record's create is on the way; a second start meets its
    lease, says whose it is and how long it waits, waits it out (A's process is alive, so nothing proves it dead),
    takes the shard over and finishes. A continued (SIGCONT) sends the create it held: it loses (B committed that
    part number), A stops in one line, and every surviving record is B's (checked against the published bytes)."""
    rows = 60
    src = write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    args = ["generate", str(src), *GEN]
    assert run_cli([*args, "-o", str(tmp_path / "ref")]) == 0
    prefix, out = f"{bucket}/out", f"s3://{bucket}/out"
    seen, stopped, release = [0], threading.Event(), threading.Event()
    worker: dict[str, int] = {}
    held: list[bytes] = []

    def hook(chunk: bytes) -> object:
        if _is_record_create(chunk):
            seen[0] += 1
            if seen[0] == 3:
                os.kill(worker["pid"], signal.SIGSTOP)  # A pauses with this request on its way
                held.append(chunk.split(b" ", 2)[1])
                stopped.set()
                return ("hold", release)
        return False

    proxy = FaultProxy(s3_endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    a = spawn([*args, "-o", out], AWS_ENDPOINT_URL=proxy.url, DSPINE_BATCH_LEASE_SECONDS="3")
    worker["pid"] = a.pid
    try:
        _wait(lambda: stopped.is_set() or a.poll() is not None, "A was stopped at its third commit")
        assert stopped.is_set(), a.communicate()[1].decode()
        capsys.readouterr()
        assert run_cli([*args, "-o", out], {"DSPINE_BATCH_LEASE_SECONDS": "3"}) == 0  # B, straight to the store
        err = capsys.readouterr().err
        assert f"leased to pid {a.pid} on" in err and "waiting up to" in err, err
        assert f"took over the lease of pid {a.pid} on" in err and "(it expired" in err, err
    finally:
        release.set()
        os.kill(a.pid, signal.SIGCONT)
        _, a_err = a.communicate(timeout=120)
        proxy.close()
    assert a.returncode == 1, a_err.decode()
    assert "another worker committed this part first" in a_err.decode(), a_err.decode()
    record = held[0].decode().split("?")[0].rsplit("/", 1)[-1]  # the part number A's held create was for
    assert s3.exists(f"{prefix}/_dspine/keys/{record}")  # B committed that number, and its record survived:
    _exactly_once(s3, prefix, tmp_path / "ref", rows)
    _assert_clean(s3, prefix)
    assert run_cli(["finalize", out]) == 0  # each record's crc32 against the published bytes: B's, all of them
    assert s3.exists(f"{prefix}/_SUCCESS")


def test_a_late_renewal_answer_cannot_make_check_pass_after_a_takeover(s3env, s3_endpoint, bucket):
    """The renewal reaches the store at once but its answer is held past the lease's expiry, and another worker
    takes the lease over meanwhile. When the answer arrives, ``check()`` must fail: the body the store took says
    ``expires_at = stamp + lifetime``, and the taker went by that, not by when the holder heard back."""
    released = threading.Event()
    renewals = [0]

    def hook(chunk: bytes) -> object:
        if chunk.startswith(b"PUT ") and b"/_dspine/lease-" in chunk and b"\r\nif-match:" in chunk.lower():
            renewals[0] += 1
            if renewals[0] == 1:
                return ("hold-answer", released)
        return False

    proxy = FaultProxy(s3_endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, on_request=hook)
    try:
        fs.set_options({"endpoint_url": proxy.url})
        via_proxy = ObjectStore(f"s3://{bucket}/out")
        fs.set_options({})
        direct = ObjectStore(f"s3://{bucket}/out")
        a = Lease(via_proxy, TAG, seconds=2.0).acquire()
        etag = a.etag
        _wait(lambda: renewals[0] >= 1, "A's first renewal was sent")
        _wait(lambda: direct.head(f"_dspine/lease-{TAG}.json")["etag"] != etag, "A's renewal reached the store")
        _wait(lambda: json.loads(direct.get(f"_dspine/lease-{TAG}.json"))["expires_at"] < time.time(),
              "the renewed lease expired (its answer still held)")
        b = Lease(direct, TAG, seconds=60.0).acquire()
        assert b.took_over and b.took_over["token"] == a.token
        released.set()
        _wait(lambda: a.etag != etag, "A heard its renewal's answer")
        with pytest.raises(FatalError, match="lease lost"):
            a.check()
        a.release()  # past its validity: it must not delete the lease, which is B's now
        assert json.loads(direct.get(f"_dspine/lease-{TAG}.json"))["token"] == b.token
        b.release()
    finally:
        released.set()
        proxy.close()
        fs.set_options({})


@pytest.mark.parametrize("header", ["If-None-Match", "If-Match"])
def test_a_store_that_ignores_conditional_writes_is_refused(tmp_path, s3, s3env, s3_endpoint, bucket, capsys,
                                                            header):
    """A real HTTP proxy in front of the S3 server drops one conditional header from every request: to the client
    the store then accepts a second create-only write (or a swap on a stale ETag). The start refuses it as an
    OUTDIR in one line saying why, before any row is generated or committed."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    proxy = FaultProxy(s3_endpoint, p503=0, pdrop=0, pdelay=0, pcut=0, strip=(header,))
    try:
        capsys.readouterr()
        rc = run_cli(["generate", str(src), "-o", f"s3://{bucket}/out"], {"AWS_ENDPOINT_URL": proxy.url})
        err = capsys.readouterr().err.strip()
    finally:
        proxy.close()
    assert rc == 2, err
    assert proxy.counts["stripped"] > 0
    assert len(err.splitlines()) == 1 and "cannot be an output directory" in err and header in err, err
    assert not s3.glob(f"{bucket}/out/_dspine/keys/*") and not s3.glob(f"{bucket}/out/*.parquet")
    assert not s3.glob(f"{bucket}/out/_dspine/probe-*")  # the probe cleaned up after itself


def test_holder_gone_proves_death_on_this_machine_only(tmp_path):
    """A lease names its holder's host, boot id, pid namespace, pid and the pid's start time: a dead pid, a zombie
    or a reused pid on this machine is proved dead; a live (even a stopped) process, or any field that differs,
    proves nothing."""
    from dspine_batch.storage.lease import holder_gone, process_identity  # (the other tests need Lease only)

    me = process_identity()
    assert all(me[k] is not None for k in ("host", "boot_id", "pid_ns", "pid", "pid_start"))
    assert holder_gone(me, me) is None  # alive
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stat = open(f"/proc/{p.pid}/stat").read()
    child = {**me, "pid": p.pid, "pid_start": int(stat.rsplit(")", 1)[1].split()[19])}
    os.kill(p.pid, signal.SIGSTOP)
    assert holder_gone(child, me) is None  # stopped: it may continue
    os.kill(p.pid, signal.SIGKILL)
    _wait(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", "a zombie")
    assert holder_gone(child, me) == "its process has exited"  # killed, not yet reaped
    p.communicate()
    assert holder_gone(child, me) == "its process is gone"
    assert holder_gone({**me, "pid_start": me["pid_start"] + 1}, me) == f"its pid {me['pid']} is another process now"
    for k, other in (("host", "elsewhere"), ("boot_id", "another-boot"), ("pid_ns", "pid:[1]")):
        assert holder_gone({**child, k: other}, me) is None  # another machine, boot or container: no proof
    assert holder_gone({"holder": "pid 1 on x", "expires_at": 0}, me) is None  # a lease from before these fields
