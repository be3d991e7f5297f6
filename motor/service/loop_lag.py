"""Event-loop lag, measured the same way in every service: a timer is due every `interval`
seconds and the histogram records how late the loop ran it. Blocking code on the loop (a slow
store write, a big protobuf, a synchronous call) shows up here before it shows up as missed
heartbeats.

On a loaded host the lag also counts the time the host gave the CPU to other processes. The
second histogram takes that out: the lag less the time the loop's thread waited, runnable, for a
CPU over the timer's interval (Linux's /proc/thread-self/schedstat; where it cannot be read, the
whole lag), `motor_event_loop_blocked_seconds`. Code that holds the loop (computing, or waiting
on a lock, a disk, a sleep) is in both; a host that took the CPU away shows as lag only.

    lag = EventLoopLag(registry)
    task = lag.start()         # on the running loop
    ...
    await lag.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Histogram

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LAG_HELP = (
    "How late the event loop ran a timer due every 0.25 s. Every RPC, heartbeat and probe of this "
    "process waits that long: a p99 above 0.1 s means blocking code on the loop or an overloaded "
    "host (check CPU and the service's log)."
)


BLOCKED_HELP = (
    "motor_event_loop_lag_seconds less the time the loop's thread waited for a CPU meanwhile: code that "
    "held the loop (a computation, a lock, a disk write). Lag high and this low: the host is overloaded, "
    "not the service."
)
SCHEDSTAT = "/proc/thread-self/schedstat"


def cpu_wait() -> float | None:
    """Seconds the calling thread has waited, runnable, for a CPU (None where unknown)."""
    try:
        with open(SCHEDSTAT, "rb") as handle:
            return int(handle.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


async def timer_lags(interval: float) -> AsyncIterator[tuple[float, float]]:
    """Forever, every `interval` seconds: (how late the loop ran a timer due then, of that the
    time the loop held it: the lag less the thread's wait for a CPU meanwhile, where known)."""
    loop = asyncio.get_running_loop()
    while True:
        due, waited = loop.time() + interval, cpu_wait()
        await asyncio.sleep(interval)
        lag = max(0.0, loop.time() - due)
        now_waited = cpu_wait()
        held = lag if waited is None or now_waited is None else max(0.0, lag - (now_waited - waited))
        yield lag, held


def lag_histogram(registry: CollectorRegistry | None) -> Histogram:
    return Histogram("motor_event_loop_lag_seconds", LAG_HELP, buckets=LAG_BUCKETS, registry=registry)


class EventLoopLag:
    def __init__(self, registry: CollectorRegistry | None, interval: float = 0.25):
        self.histogram = lag_histogram(registry)
        self.blocked = Histogram(
            "motor_event_loop_blocked_seconds", BLOCKED_HELP, buckets=LAG_BUCKETS, registry=registry
        )
        self.interval = interval
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="event-loop-lag")
        return self._task

    async def _run(self) -> None:
        async for lag, held in timer_lags(self.interval):
            self.histogram.observe(lag)
            self.blocked.observe(held)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
