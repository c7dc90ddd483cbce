"""Bounded in-flight scheduling: window size, whole rows, error-row bypass, stop flag."""

from __future__ import annotations

from dataclasses import dataclass

from dspine_batch.engines.base import Request, Result, SamplingParams
from dspine_batch.engines.scripted import ScriptedEngine
from dspine_batch.requests.mapping import WorkItem
from dspine_batch.run.scheduler import MAX_BYPASS, schedule


@dataclass
class Flag:
    requested: bool = False
    in_engine: bool = False


def _item(i, samples=2, error=None):
    if error:
        return WorkItem(f"r{i}", [], None, error)
    reqs = [Request(f"r{i}", s, [1, 2, i], SamplingParams(temperature=1.0, seed=s)) for s in range(samples)]
    return WorkItem(f"r{i}", reqs, None)


class CountingEngine(ScriptedEngine):
    """Records the largest number of requests pulled but not yet answered."""

    def run(self, requests, max_in_flight):
        self.pulled = getattr(self, "pulled", 0)
        self.answered = getattr(self, "answered", 0)
        self.peak = getattr(self, "peak", 0)

        def counted():
            for r in requests:
                self.pulled += 1
                self.peak = max(self.peak, self.pulled - self.answered)
                yield r

        for res in super().run(counted(), max_in_flight):
            self.answered += 1
            yield res


def test_window_is_bounded_and_rows_are_whole():
    eng = CountingEngine(latency=0.001)
    out = list(schedule((_item(i, samples=3) for i in range(50)), eng, 5, Flag()))
    assert eng.peak <= 5
    assert sorted(item.row_id for item, _ in out) == sorted(f"r{i}" for i in range(50))
    for item, results in out:
        assert [r.sample_index for r in results] == [0, 1, 2]
        assert all(isinstance(r, Result) and r.row_id == item.row_id for r in results)


def test_error_rows_bypass_the_engine_without_piling_up():
    items = [_item(i, error="bad") for i in range(MAX_BYPASS * 2 + 3)] + [_item(99999)]
    eng = CountingEngine()
    out = list(schedule(iter(items), eng, 4, Flag()))
    assert len(out) == len(items)
    assert sum(1 for _, r in out if r is None) == MAX_BYPASS * 2 + 3
    assert eng.pulled == 2


def test_stop_flag_stops_admission_but_finishes_in_flight():
    flag = Flag()
    eng = CountingEngine(latency=0.002)
    out = []
    for item, _ in schedule((_item(i) for i in range(100)), eng, 4, flag):
        out.append(item)
        flag.requested = True
    assert 1 <= len(out) <= 3  # only what was in flight when the flag went up
    assert eng.pulled == eng.answered
