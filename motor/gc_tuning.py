"""Garbage collection for a process that holds a large, long-lived state on one event loop (the
controller at fleet scale).

CPython's full collection walks every tracked object at once, with the loop stopped: at 1,000
nodes x 8 engines on a loaded 2-core machine the controller measured 1.2-1.9 s full collections
every 8-20 s, and every heartbeat in flight waited that long. `TenuredCollections` freezes
(`gc.freeze`) what survived a full collection, so that the next ones walk only the objects
promoted since. Young collections keep CPython's thresholds: many short pauses hurt a heartbeat's
p99 less than fewer long ones. Reference counting still frees frozen objects; only reference cycles
among them that turn into garbage later would stay, so once the frozen objects have doubled since
the last complete walk, they are thawed and the next full collection walks (and reclaims)
everything again. Steady state: no complete walk; while the state grows: one per doubling.
"""

from __future__ import annotations

import gc
from typing import Any

FLOOR = 200_000  # below this many frozen objects a complete walk is cheap: no need to count


class TenuredCollections:
    def __init__(self) -> None:
        self.baseline = 0  # frozen objects after the last complete walk
        self.walking = False  # the next full collection walks everything (thawed)

    def install(self) -> "TenuredCollections":
        gc.callbacks.append(self._after)
        return self

    def uninstall(self) -> None:
        if self._after in gc.callbacks:
            gc.callbacks.remove(self._after)
        gc.unfreeze()

    def _after(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info["generation"] != 2:
            return
        gc.freeze()  # survivors of a full collection: out of the next ones
        frozen = gc.get_freeze_count()
        if self.walking:
            self.walking, self.baseline = False, frozen
        elif frozen > 2 * max(self.baseline, FLOOR):
            gc.unfreeze()  # the next full collection walks everything, reclaiming cycles among them
            self.walking = True
