"""Survivors of a full collection are frozen out of the next ones, and reclaimed again (cycles
included) once the frozen objects have doubled since the last complete walk."""

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
        gc.collect()  # nothing frozen yet counts as doubled: thawed, the next one walks everything
        assert tuning.walking and gc.get_freeze_count() == 0
        gc.collect()
        assert not tuning.walking and tuning.baseline == gc.get_freeze_count() > 0

        garbage = Cyclic()
        garbage.me = garbage
        alive = weakref.ref(garbage)
        gc.collect()  # it survives (still referenced): frozen with the rest
        del garbage
        gc.collect()
        assert alive() is not None  # a cycle among frozen objects is not walked...

        tuning.baseline = 1  # ...until the frozen objects have doubled since the last complete walk
        gc.collect()
        assert tuning.walking and gc.get_freeze_count() == 0
        gc.collect()
        assert alive() is None and gc.get_freeze_count() > 0
    finally:
        tuning.uninstall()
    assert gc.get_freeze_count() == 0 and tuning._after not in gc.callbacks
