"""A clock whose time moves only when every task waits on it: tests run minutes of timers in ms."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class VirtualClock:
    """`sleep` parks the caller until `run_until` moves the time to its deadline; nothing else
    moves the time, so concurrent waits overlap as they would on the real clock."""

    def __init__(self, now: float = 1000.0):
        self.now = now
        self._sleepers: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(0.0, seconds), next(self._order), future))
        await future

    async def _settle(self) -> None:
        for _ in range(20):  # let every runnable task reach its next wait
            await asyncio.sleep(0)

    async def run_until(self, done, limit: float) -> float:
        """Advance, sleeper by sleeper, until `done()` or `limit` seconds passed; the time taken."""
        start = self.now
        await self._settle()
        while not done() and self.now - start < limit:
            if not self._sleepers:
                raise AssertionError("nothing waits on the clock and the condition does not hold")
            deadline, _, future = heapq.heappop(self._sleepers)
            self.now = max(self.now, deadline)
            if not future.done():
                future.set_result(None)
            await self._settle()
        return self.now - start
