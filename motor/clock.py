"""The one clock seam every service reads time through (as Kubernetes passes a `clock.Clock`).

The controller, the node manager and the engine server take a `Clock` and never call
`time.time`, `time.monotonic` or `asyncio.sleep` for the rules they decide by; tests pass a fake
one (a clock that moves only when told) to drive timeouts, backoffs and grace periods in
milliseconds. Production code never asks which clock it was given.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch (start and change times shown to users)."""

    def monotonic(self) -> float:
        """Seconds for intervals and deadlines."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: `time.time`, `time.monotonic`, `asyncio.sleep`."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
