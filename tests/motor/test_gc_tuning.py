"""Survivors of a full collection are frozen out of the next ones, and reclaimed again (cycles
included) once the heap has doubled since the last complete walk."""

from __future__ import annotations

import gc
import weakref

from motor import gc_tuning
from motor.gc_tuning import TenuredCollections


class Cyclic:
    pass


def test_survivors_are_frozen_and_cycles_among_them_reclaimed_after_a_thaw(monkeypatch):
    monkeypatch.setattr(gc_tuning, "FLOOR", 0)
    tuning = TenuredCollections().install()
    try:
        # Installed: what was there is frozen, and the heap then is the baseline.
        assert gc.get_freeze_count() > 0 and tuning.baseline > 0 and not tuning.walking

        garbage = Cyclic()
        garbage.me = garbage
        alive = weakref.ref(garbage)
        gc.collect()  # it survives (still referenced): frozen with the rest
        del garbage
        gc.collect()
        assert alive() is not None  # a cycle among frozen objects is not walked...

        tuning.baseline = 1  # ...until the heap has doubled since the last complete walk
        gc.collect()
        assert tuning.walking and gc.get_freeze_count() == 0
        gc.collect()
        assert alive() is None and gc.get_freeze_count() > 0
    finally:
        tuning.uninstall()
    assert gc.get_freeze_count() == 0 and tuning._after not in gc.callbacks


def test_full_collections_run_more_often_and_thresholds_come_back():
    before = gc.get_threshold()
    tuning = TenuredCollections().install()
    try:
        assert gc.get_threshold() == (before[0], before[1], gc_tuning.FULL_EVERY)
    finally:
        tuning.uninstall()
    assert gc.get_threshold() == before


def test_a_due_walk_waits_while_busy_and_the_next_full_collection_is_reset_after_it(monkeypatch):
    """A deployment change doubles the heap for a while: the walk waits for its end. After the
    walk, a collection of what is new is scheduled on the loop (CPython would otherwise hold the
    next full one back until a quarter of the heap is new)."""
    monkeypatch.setattr(gc_tuning, "FLOOR", 0)
    heap = [100]
    tuning = TenuredCollections(heap=lambda: heap[0]).install()
    try:
        gc.collect()
        gc.collect()  # walked once: baseline 100
        assert not tuning.walking and tuning.baseline == 100
        heap[0] = 300  # doubled...
        tuning.busy = lambda: True
        gc.collect()
        assert not tuning.walking and gc.get_freeze_count() > 0  # ...but a change is under way
        tuning.busy = lambda: False
        gc.collect()
        assert tuning.walking and gc.get_freeze_count() == 0

        scheduled = []

        class Loop:  # the running loop the collection happens on
            def call_soon(self, callback, *args):
                scheduled.append((callback, args))

        monkeypatch.setattr(gc_tuning.asyncio, "get_running_loop", Loop)
        gc.collect()
        assert scheduled == [(gc.collect, (2,))] and tuning.baseline == 300 and not tuning.walking
    finally:
        tuning.uninstall()
