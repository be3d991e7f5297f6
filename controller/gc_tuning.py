"""Garbage collection for a process that holds a large, long-lived state on one event loop (the
controller at fleet scale).

CPython's full collection walks every tracked object at once, with the loop stopped: at 1,000
nodes x 8 engines on a loaded 2-core machine the controller measured 1.2-1.9 s full collections
every 8-20 s, and every heartbeat in flight waited that long. And CPython starts its young
collections by allocation count: at 10,000 nodes (2,000 heartbeats a second, each stream's
pending read living until its next beat, 5 s later) that was 250 collections a second, 23% of
a core, with pauses of 60-180 ms for young collections and 100-470 ms for full ones, because
what lives 5 s was walked again by every generation it passed through.

`TenuredCollections` collects by time instead: every PACE seconds one collection of everything not
frozen, after which what survived is frozen (`gc.freeze`), so each object is walked once, in the
first collection after it was made (short-lived garbage, cycles included, is reclaimed there), and
later collections walk only what was made since. What a collection walks at 10,000 nodes is mostly
the heartbeat streams' pending reads made since the last one (about 20 objects each, 2,000 a
second), so its pause grows with PACE: 0.25 s gave pauses of 5-10 ms (p50) and a loop held up to
25-50 ms; 0.1 s gives at most 2.5 ms (p50) and a loop held up to 2.5-25 ms, with no more CPU in all
(each object is walked once either way; bench/controller_scale.py). The price of a short pace: a
short-lived object is more often alive at a collection, so frozen, and a reference cycle among such
objects (an aborted call's traceback holding its context) then waits for the next complete walk;
the doubling rule below bounds what they hold. Allocations still start a collection past
YOUNG_SAFETY (a burst between two paced ones). Reference counting still frees frozen objects; only
reference cycles among them that turn into garbage later would stay, so once the heap has doubled
since the last complete walk, the frozen objects are thawed and the next collection walks (and
reclaims) everything. Steady state: no complete walk; while the state grows: one per doubling. That
walk is the one pause left that grows with the fleet: about half a microsecond per object on this
loaded machine, 0.3-0.6 s for the 600,000-800,000 objects of a 10,000 x dp 4 deployment, measured
before the per-engine state was made compact (about a third of the objects since:
docs/controller-decisions.md, memory per engine).

- A deployment change holds the old and the new instances at once for seconds: while `busy()`
  says one is under way, a due walk waits for the first collection after it (it walks the
  steady heap, not twice it).
- The heap is measured in allocated memory blocks (`sys.getallocatedblocks`: a pass over the
  allocator's pools, well under a millisecond), not frozen objects: `gc.get_freeze_count` walks
  every frozen object, 0.1 s at a million of them.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

FLOOR = 500_000  # allocated blocks (about 200,000 objects): no complete walk before twice this
PACE = 0.1  # seconds between two collections: short pauses (see above)
YOUNG_SAFETY = 20_000  # allocations (net of frees) that start a collection before the next paced one
PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PAUSE_HELP = (
    "How long one garbage collection held the process (every thread of it), by what it walked: 'recent' "
    "(what was made since the last collection) or 'complete' (everything: once each time the heap has "
    "doubled). Part of motor_event_loop_blocked_seconds."
)


class TenuredCollections:
    def __init__(self, heap: Callable[[], int] = sys.getallocatedblocks) -> None:
        self.heap = heap
        self.busy: Callable[[], bool] = lambda: False  # a transient peak of the heap (see above)
        self.baseline = 0  # the heap after the last complete walk
        self.walking = False  # the next full collection walks everything (thawed)
        self._thresholds = gc.get_threshold()
        self.pauses: Histogram | None = None
        self._began = 0.0

    def export(self, registry: CollectorRegistry | None) -> None:
        """Observe every collection's pause in `motor_gc_pause_seconds` of `registry`."""
        self.pauses = Histogram(
            "motor_gc_pause_seconds", PAUSE_HELP, ["walk"], buckets=PAUSE_BUCKETS, registry=registry
        )

    def install(self) -> TenuredCollections:
        """At start-up: what is there now (modules, classes) is walked once, here, and frozen, so
        the first full collection while serving walks only what came since (30-50 ms otherwise)."""
        gc.collect()
        gc.freeze()
        self.baseline = self.heap()
        # Between two paced collections allocations start one only in a burst (a big apply): a
        # young one per YOUNG_SAFETY, every third a full one whose survivors are frozen, so each
        # walk stays at a few ten thousand objects.
        gc.set_threshold(YOUNG_SAFETY, 0, 0)
        gc.callbacks.append(self._after)
        return self

    async def pace(self, interval: float = PACE) -> None:
        """Run on the loop for as long as the process serves: a collection every `interval`."""
        while True:
            await asyncio.sleep(interval)
            gc.collect()

    def uninstall(self) -> None:
        if self._after in gc.callbacks:
            gc.callbacks.remove(self._after)
        gc.set_threshold(*self._thresholds)
        gc.unfreeze()

    def _after(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self.pauses is not None:
            self.pauses.labels("complete" if self.walking and info["generation"] == 2 else "recent").observe(
                time.perf_counter() - self._began
            )
        if info["generation"] != 2:
            return
        gc.freeze()  # survivors of a full collection: out of the next ones
        heap = self.heap()
        if self.walking:
            self.walking, self.baseline = False, heap
        elif heap > 2 * max(self.baseline, FLOOR) and not self.busy():
            gc.unfreeze()  # the next full collection walks everything, reclaiming cycles among them
            self.walking = True
