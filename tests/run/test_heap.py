"""``heap.setup_frozen``: set-up objects out of the collector's scans during a run, and given back after it."""

from __future__ import annotations

import gc
import weakref

from dspine_batch.run.heap import setup_frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_frozen_inside_given_back_after():
    before = Node()
    ref = weakref.ref(before)
    with setup_frozen():
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert ref() is not None  # frozen: a cycle alive at entry is not collected during the run
        fresh = weakref.ref(Node())  # garbage made during the run is collected as usual
        gc.collect()
        assert fresh() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # after the run it is collectable again: a process running many jobs leaks nothing


def test_given_back_when_the_run_raises():
    try:
        with setup_frozen():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert gc.get_freeze_count() == 0
