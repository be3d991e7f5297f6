"""Watching one engine's health: status polling, the probe stream, and the verdict on each heartbeat.

The monitor only observes and judges (HealthJudge): it keeps the record's health fields up to
date and reports every verdict and every probe-stream message to its listener, the node
manager, which alone decides what to do (mark the engine RUNNING, publish, or kill it). Like a
kubelet prober worker, which counts results against thresholds and publishes them, leaving the
restart to whoever reads them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from motor.clock import Clock
from motor.v1 import engine_pb2, types_pb2
from node_manager.config import NodeManagerConfig
from node_manager.engine import RUNNING, EngineRecord
from node_manager.engine_client import EngineClientFactory, NoAnswer
from node_manager.health import HealthJudge, Verdict

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]


class MonitorListener(Protocol):
    def on_verdict(self, record: EngineRecord, verdict: Verdict, changed: bool) -> None:
        """One heartbeat judged; `changed`: the engine's shown health changed with it."""

    def on_stream_message(self, record: EngineRecord, message: engine_pb2.WatchProbesResponse) -> None:
        """A message on the engine's probe stream (the record's probes already updated)."""


class EngineMonitor:
    """Two loops for one engine, until it stops being watched (no longer active, or being ended)."""

    def __init__(
        self,
        record: EngineRecord,
        config: NodeManagerConfig,
        clients: EngineClientFactory,
        clock: Clock,
        listener: MonitorListener,
        observe_latency: Callable[[float], None],
    ):
        self.record = record
        self.interval, self.timeout = config.heartbeat_interval, config.status_timeout
        self.judge = HealthJudge(config.abnormal_threshold, config.startup_grace)
        self.clients, self.clock, self.listener = clients, clock, listener
        self.observe_latency = observe_latency
        self.tasks: list[asyncio.Task] = []

    def start(self, spawn: Spawn) -> None:
        self.tasks = [spawn(self._poll_status()), spawn(self._follow_probes())]

    def stop(self) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.tasks = []

    @property
    def watching(self) -> bool:
        return self.record.active and not self.record.being_ended

    async def _poll_status(self) -> None:
        """Every heartbeat interval: GetStatus with a deadline, judged by HealthJudge."""
        record, clock = self.record, self.clock
        client = self.clients(record.spec)
        try:
            next_tick = clock.monotonic()
            while self.watching:
                status, error = None, ""
                began = clock.monotonic()
                try:
                    status = await client.get_status(self.timeout)
                    self.observe_latency(clock.monotonic() - began)
                except NoAnswer as exc:
                    error = str(exc)
                if not self.watching:
                    return
                # A failed call that began before the engine answered on its probe stream (it was
                # still binding its port) is older news than that answer: it is not judged.
                stale = status is None and record.stream_heard_at > began
                if not stale:
                    self._judge(status, error)
                    if not self.watching:
                        return
                next_tick += self.interval
                await clock.sleep(max(0.0, next_tick - clock.monotonic()))
                next_tick = max(next_tick, clock.monotonic() - self.interval)
        finally:
            await client.close()

    def _judge(self, status: types_pb2.EngineStatus | None, error: str) -> None:
        record, judge = self.record, self.judge
        # An answer on the probe stream counts as the engine having answered too.
        judge.ever_answered |= record.ever_answered or record.state == RUNNING
        verdict = judge.judge(status, error, self.clock.time() - record.started_at)
        if status is not None:
            record.observe_status(status)
        changed = (record.health, record.health_reason, record.consecutive_abnormal) != (
            verdict.health,
            verdict.reason,
            verdict.consecutive,
        )
        record.health, record.health_reason = verdict.health, verdict.reason
        record.consecutive_abnormal = verdict.consecutive
        record.ever_answered = judge.ever_answered
        if verdict.counted:
            logger.warning(
                "engine %s: abnormal heartbeat %d/%d: %s",
                record.engine_id,
                verdict.consecutive,
                judge.threshold,
                verdict.reason,
            )
        self.listener.on_verdict(record, verdict, changed)

    async def _follow_probes(self) -> None:
        """Keep last_probe / recent_probes from the engine's WatchProbes stream (reconnecting).

        The stream also sends every status change at once: a starting engine is RUNNING as soon
        as it reports NORMAL, without waiting for the next heartbeat. Counting abnormal
        heartbeats stays with the periodic GetStatus (a stream can stall silently)."""
        record = self.record
        client = self.clients(record.spec)
        try:
            while self.watching:
                try:
                    async for message in client.watch_probes():
                        if not self.watching:
                            return
                        record.ever_answered = True
                        record.stream_heard_at = self.clock.monotonic()
                        if message.HasField("probe"):
                            record.add_probe(message.probe)
                        self.listener.on_stream_message(record, message)
                except NoAnswer as exc:
                    logger.debug("engine %s: probe stream ended: %s", record.engine_id, exc)
                await self.clock.sleep(self.interval)
        finally:
            await client.close()
