"""Survivors of a full collection are frozen out of the next ones, and reclaimed again (cycles
included) once the heap has doubled since the last complete walk."""

from __future__ import annotations

import asyncio
import gc
import weakref

from prometheus_client import CollectorRegistry

from controller import gc_tuning
from controller.gc_tuning import TenuredCollections
from motor.service.tasks import cancel_and_wait


class Cyclic:
    pass


def test_survivors_are_frozen_and_cycles_among_them_reclaimed_after_a_thaw(monkeypatch):
    monkeypatch.setattr(gc_tuning, "FLOOR", 0)
    tuning = TenuredCollections().install()
    registry = CollectorRegistry()
    tuning.export(registry)

    def pauses(walk: str) -> float:
        return registry.get_sample_value("motor_gc_pause_seconds_count", {"walk": walk}) or 0.0

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
        assert pauses("complete") == 0 and pauses("recent") == 3  # every collection's pause is observed...
        gc.collect()
        assert alive() is None and gc.get_freeze_count() > 0
        assert pauses("complete") == 1  # ...and the complete walk's apart
    finally:
        tuning.uninstall()
    assert gc.get_freeze_count() == 0 and tuning._after not in gc.callbacks


def test_collections_come_by_time_not_by_allocations_and_thresholds_come_back():
    before = gc.get_threshold()
    tuning = TenuredCollections().install()
    try:
        assert gc.get_threshold() == (gc_tuning.YOUNG_SAFETY, 0, 0)
    finally:
        tuning.uninstall()
    assert gc.get_threshold() == before


def frozen(thing: object) -> bool:
    return gc.is_tracked(thing) and not any(o is thing for o in gc.get_objects())


async def test_the_paced_collection_reclaims_new_cycles_and_freezes_the_survivors():
    """Every PACE seconds one collection walks what is not frozen: a cycle made since is reclaimed
    there, and what is still referenced is frozen out of the next collections."""
    tuning = TenuredCollections().install()
    pacing = asyncio.create_task(tuning.pace(interval=0.01))
    try:
        garbage, kept = Cyclic(), Cyclic()
        garbage.me, kept.me = garbage, kept
        gone, alive = weakref.ref(garbage), weakref.ref(kept)
        del garbage
        # Frozen: still tracked, but in no generation a collection walks. (Not the frozen count:
        # objects frozen earlier that die meanwhile, by reference counting, lower it.)
        for _ in range(200):  # well past a few paces (a hang would fail here)
            await asyncio.sleep(0.01)
            if gone() is None and frozen(kept):
                break
        assert gone() is None, "a cycle made since the last collection is reclaimed by the next"
        assert alive() is kept and frozen(kept), "what survived is frozen"
    finally:
        await cancel_and_wait(pacing, owner="test")
        tuning.uninstall()


def test_a_due_walk_waits_while_busy(monkeypatch):
    """A deployment change doubles the heap for a while: the walk waits for its end."""
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
        gc.collect()
        assert tuning.baseline == 300 and not tuning.walking and gc.get_freeze_count() > 0
    finally:
        tuning.uninstall()
