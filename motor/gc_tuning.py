"""Garbage collection for a process that holds a large, long-lived state on one event loop (the
controller at fleet scale).

CPython's full collection walks every tracked object at once, with the loop stopped: at 1,000
nodes x 8 engines on a loaded 2-core machine the controller measured 1.2-1.9 s full collections
every 8-20 s, and every heartbeat in flight waited that long. `TenuredCollections` freezes
(`gc.freeze`) what survived a full collection, so that the next ones walk only the objects
promoted since, and runs them every FULL_EVERY generation-1 collections instead of CPython's 10,
so that each walks a few ten thousand objects (20-30 ms here during a 10,000 x dp 4 deployment
change; 20-60 ms, and more after a complete walk, at CPython's 10). Reference counting still
frees frozen objects; only reference cycles among them that turn into garbage later would stay,
so once the heap has doubled since the last complete walk, the frozen objects are thawed and the
next full collection walks (and reclaims) everything again. Steady state: no complete walk; while
the state grows: one per doubling. That walk is the one pause left that grows with the fleet:
about half a microsecond per object on this loaded machine, 0.3-0.6 s for the 600,000-800,000
objects of a 10,000 x dp 4 deployment (docs/controller.md).

- A deployment change holds the old and the new instances at once for seconds: while `busy()`
  says one is under way, a due walk waits for the next full collection after it (it walks the
  steady heap, not twice it).
- After a complete walk CPython holds the next full collection back until a quarter of the whole
  heap is new (0.1-0.2 s to walk): an explicit collection of the few objects made since, in the
  loop's next turn, resets that count.
- The heap is measured in allocated memory blocks (`sys.getallocatedblocks`: a pass over the
  allocator's pools, well under a millisecond), not frozen objects: `gc.get_freeze_count` walks
  every frozen object, 0.1 s at a million of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from typing import Any, Callable

FLOOR = 500_000  # allocated blocks (about 200,000 objects): no complete walk before twice this
FULL_EVERY = 2  # generation-1 collections between two full ones (CPython: 10)


class TenuredCollections:
    def __init__(self, heap: Callable[[], int] = sys.getallocatedblocks) -> None:
        self.heap = heap
        self.busy: Callable[[], bool] = lambda: False  # a transient peak of the heap (see above)
        self.baseline = 0  # the heap after the last complete walk
        self.walking = False  # the next full collection walks everything (thawed)
        self._thresholds = gc.get_threshold()

    def install(self) -> "TenuredCollections":
        """At start-up: what is there now (modules, classes) is walked once, here, and frozen, so
        the first full collection while serving walks only what came since (30-50 ms otherwise)."""
        young, middle, _ = self._thresholds
        gc.collect()
        gc.freeze()
        self.baseline = self.heap()
        gc.set_threshold(young, middle, FULL_EVERY)
        gc.callbacks.append(self._after)
        return self

    def uninstall(self) -> None:
        if self._after in gc.callbacks:
            gc.callbacks.remove(self._after)
        gc.set_threshold(*self._thresholds)
        gc.unfreeze()

    def _after(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info["generation"] != 2:
            return
        gc.freeze()  # survivors of a full collection: out of the next ones
        heap = self.heap()
        if self.walking:
            self.walking, self.baseline = False, heap
            # The next full collection would wait for a quarter of the heap to be new (see above).
            with contextlib.suppress(RuntimeError):  # no loop running: nothing to hold back
                asyncio.get_running_loop().call_soon(gc.collect, 2)
        elif heap > 2 * max(self.baseline, FLOOR) and not self.busy():
            gc.unfreeze()  # the next full collection walks everything, reclaiming cycles among them
            self.walking = True
