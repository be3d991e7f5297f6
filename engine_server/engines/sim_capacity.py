"""The simulated engine's capacity, as vLLM's scheduler has one: at most `max_num_seqs` requests
run at once (each holds a seat in the batch, and its share of the KV cache); the rest wait in
arrival order. Every request counts, probes included, as vLLM counts every request it schedules.

Its figures are in /metrics under vLLM's names and labels (model_name, engine: the data-parallel
rank), so dashboards and autoscaling signals read a simulated engine like a real one:
vllm:num_requests_running, vllm:num_requests_waiting and vllm:kv_cache_usage_perc (a fraction,
1 = full, as vLLM reports it: here the share of seats taken).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client import Gauge

RUNNING = Gauge(
    "vllm:num_requests_running",
    "Number of requests in model execution batches.",
    ["model_name", "engine"],
    multiprocess_mode="livesum",
)
WAITING = Gauge(
    "vllm:num_requests_waiting",
    "Number of requests waiting to be processed.",
    ["model_name", "engine"],
    multiprocess_mode="livesum",
)
KV_CACHE_USAGE = Gauge(
    "vllm:kv_cache_usage_perc",
    "KV-cache usage. 1 means 100 percent usage.",
    ["model_name", "engine"],
    multiprocess_mode="livemax",
)


class SimCapacity:
    def __init__(self, max_num_seqs: int, model: str, engine: str):
        self.max_num_seqs = max_num_seqs
        self.running = self.waiting = 0
        self._seats = asyncio.Semaphore(max_num_seqs)
        self._series = [g.labels(model, engine) for g in (RUNNING, WAITING, KV_CACHE_USAGE)]
        self._show()

    @contextlib.asynccontextmanager
    async def seat(self) -> AsyncIterator[None]:
        """Wait for a seat in the batch (counted waiting meanwhile), hold it while the body runs."""
        self.waiting += 1
        self._show()
        try:
            await self._seats.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self._show()
        try:
            yield
        finally:
            self.running -= 1
            self._seats.release()
            self._show()

    def _show(self) -> None:
        running, waiting, kv = self._series
        running.set(self.running)
        waiting.set(self.waiting)
        kv.set(self.running / self.max_num_seqs)
