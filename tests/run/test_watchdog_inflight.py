"""``InFlight``: the scheduler's record of requests in the engine, and which of them ``--request-timeout`` ends.

``expire`` runs once per scheduler turn, so it reads only the head of ``admitted`` (kept in admission order); these
tests pin the order invariant that makes reading the head alone correct, a re-admitted request included."""

from __future__ import annotations

from types import SimpleNamespace

from dspine_batch.run.watchdog import InFlight


def _req(row: str, sample: int = 0) -> SimpleNamespace:
    return SimpleNamespace(row_id=row, sample_index=sample)


def _admit_at(inflight: InFlight, req: SimpleNamespace, t: float, monkeypatch) -> None:
    monkeypatch.setattr("dspine_batch.run.watchdog.time.monotonic", lambda: t)
    inflight.admit(req)
    inflight.pending.setdefault(req.row_id, [SimpleNamespace(row_id=req.row_id), [None], 1])


def test_expire_ends_only_the_late_rows(monkeypatch):
    f = InFlight(timeout=10.0)
    for i, t in enumerate([0.0, 1.0, 5.0, 20.0]):
        _admit_at(f, _req(f"r{i}"), t, monkeypatch)
    ended = f.expire(now=12.5)
    assert sorted(item.row_id for item, _ in ended) == ["r0", "r1"]
    assert [r.error is not None for _, rs in ended for r in rs] == [True, True]
    assert list(f.admitted) == [("r2", 0), ("r3", 0)]
    assert f.expire(now=12.5) == []  # nothing late left
    assert [i.row_id for i, _ in f.expire(now=15.5)] == ["r2"]


def test_readmitted_request_moves_to_the_end(monkeypatch):
    """A request admitted again (a retried sample) must not keep its old place: else a fresh request at the head
    would hide a late one behind it, or an old time would sit behind newer ones."""
    f = InFlight(timeout=10.0)
    _admit_at(f, _req("a"), 0.0, monkeypatch)
    _admit_at(f, _req("b"), 3.0, monkeypatch)
    _admit_at(f, _req("a"), 8.0, monkeypatch)  # again, later
    assert list(f.admitted) == [("b", 0), ("a", 0)]
    assert [i.row_id for i, _ in f.expire(now=14.0)] == ["b"]  # b (3.0) is late; a (8.0) is not
    assert list(f.admitted) == [("a", 0)]


def test_finished_requests_leave_and_no_timeout_means_none_expire(monkeypatch):
    f = InFlight(timeout=10.0)
    _admit_at(f, _req("a"), 0.0, monkeypatch)
    _admit_at(f, _req("b"), 1.0, monkeypatch)
    f.finish(SimpleNamespace(row_id="a", sample_index=0))
    assert [i.row_id for i, _ in f.expire(now=30.0)] == ["b"]
    off = InFlight(timeout=None)
    _admit_at(off, _req("a"), 0.0, monkeypatch)
    assert off.expire(now=1e9) == []
