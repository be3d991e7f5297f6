"""Long work on the controller's loop, done in slices that yield.

A long step (applying a 10,000-instance deployment, a reconcile pass placing 80,000 engines) is
written once, as a generator that does its work and calls `yield from budget.checkpoint()` between
items: it yields when the slice has run SLICE_SECONDS, or has spawned SPAWNS_PER_SLICE tasks (each
task's first step runs in the loop's next turn, so they count as work of that turn).
`run_sliced` lets the loop run everything else (heartbeats, other RPCs, timers) between two
slices; `run_at_once` runs it through (start-up, unit tests); both return what the generator
returns. Across a yield anything may change: the work reads the tables again after one
(checkpoint() says whether it yielded).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Generator, Iterable
from typing import TypeVar

# Work done between two yields: well under the 50 ms an API call may hold the loop. Several
# slicers (a deployment change, the reconcile pass, the endpoint feed) and a collection of new
# objects (controller/gc_tuning.py) can land in one loop iteration: at 10 ms slices and 200 spawns
# (their first steps run in the next turn) a 10,000 x dp 4 apply held the loop 50-100 ms in about
# one observation in 15; at 5 ms and 100, none over 50 ms in 9 phases, no slower overall.
SLICE_SECONDS = 0.005
SPAWNS_PER_SLICE = 100

R = TypeVar("R")
Item = TypeVar("Item")
Steps = Generator[None, None, R]


class Budget:
    def __init__(
        self,
        seconds: float = SLICE_SECONDS,
        spawns: int = SPAWNS_PER_SLICE,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.seconds, self.max_spawns, self.clock = seconds, spawns, clock
        self.began = clock()
        self.spawns = 0

    def spawned(self, count: int = 1) -> None:
        self.spawns += count

    def spent(self) -> bool:
        return self.spawns >= self.max_spawns or self.clock() - self.began >= self.seconds

    def restart(self) -> None:
        self.began, self.spawns = self.clock(), 0

    def checkpoint(self) -> Steps[bool]:
        """Yields when the slice is spent; returns whether it did."""
        if not self.spent():
            return False
        yield
        self.restart()  # the next slice starts when the work resumes
        return True


def in_slices(
    items: Iterable[Item],
    work: Callable[[Item], None],
    budget: Budget,
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Steps[None]:
    """`work(item)` for every item, yielding between slices; each slice runs inside `around()`
    (e.g. one store transaction for the slice's writes), which ends before the yield."""
    remaining = iter(items)
    while True:
        with around():
            for item in remaining:
                work(item)
                if budget.spent():
                    break
            else:
                return
        yield
        budget.restart()


def run_at_once(steps: Steps[R]) -> R:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def run_sliced(steps: Steps[R]) -> R:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)
