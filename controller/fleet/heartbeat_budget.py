"""The heartbeat rate budget: the interval the controller announces to node managers and the
grace it judges their silence by.

One controller answers a bounded number of heartbeats a second (gRPC Python costs about 0.3 ms
of CPU per message, docs/controller-decisions.md#heartbeat-rate-budget). As HashiCorp Nomad does with its
servers' `max_heartbeats_per_second` (the TTL it hands each client is max(min_heartbeat_ttl,
nodes / max_heartbeats_per_second)), the controller announces

    interval = max(--heartbeat-interval, live nodes / --max-heartbeats-per-second)

(rounded up to a tenth of a second, so that it changes in steps, not at every registration) in
every RegisterNode and heartbeat answer, and scales the node grace with it:

    grace = --node-grace x interval / --heartbeat-interval

so a node is still declared lost within grace + 2 intervals + the re-check timeout, the grace
and interval being the ones it was told. Live nodes are the nodes not LOST (an O(1) count).

A node hears a shorter interval only at its next answer, up to one old interval later: when the
announced interval drops (nodes were lost or left), silence is still judged by the longer one
for two of its intervals, so no node is suspected for beating at the pace it was told. Every
interval announced is held so, one told while a longer one was held too (the fleet shrinking
in waves: 10 s, then 5.5 s to some nodes, then 1 s): `_holds` keeps, longest first, each
announced interval that no longer one announced later outlasts, with the end of its hold.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from google.protobuf.duration_pb2 import Duration

from motor.clock import Clock
from motor.contract import pbtime


class HeartbeatBudget:
    def __init__(
        self,
        base_interval: float,
        base_grace: float,
        max_per_second: float,
        live_nodes: Callable[[], int],
        clock: Clock,
    ):
        self.base_interval, self.base_grace, self.max_per_second = base_interval, base_grace, max_per_second
        self.live_nodes, self.mono = live_nodes, clock.monotonic
        # (interval, end of its hold), intervals decreasing; the first one not over is held.
        self._holds: collections.deque[tuple[float, float]] = collections.deque()
        self._held = base_interval  # the longest interval announced lately (read by /metrics, from its own thread)
        self.announced = base_interval  # the latest announced (read by /metrics too)
        self._messages: tuple[float, float, Duration, Duration] | None = None

    def interval(self) -> float:
        """The interval to announce now (and remember as announced)."""
        interval = self.base_interval
        if self.max_per_second > 0:
            needed = math.ceil(self.live_nodes() / self.max_per_second * 10 - 1e-9) / 10
            interval = max(interval, needed)
        now, holds = self.mono(), self._holds
        while holds and holds[-1][0] <= interval:
            holds.pop()  # no longer, and its hold ends before this one's
        holds.append((interval, now + 2 * interval))
        while holds[0][1] <= now:
            holds.popleft()  # over (the one just added is not)
        self._held = holds[0][0]
        self.announced = interval
        return interval

    def liveness_interval(self) -> float:
        """The interval silence is judged by: the longest announced within its last two intervals."""
        self.interval()
        return self._held

    def grace(self) -> float:
        """Silence after which a node turns SUSPECT."""
        self.interval()
        return self.held_grace()

    def held_grace(self) -> float:
        """The grace as of the latest announcement (nothing recomputed: /metrics reads it)."""
        return self.base_grace * self._held / self.base_interval

    def announcement(self) -> tuple[Duration, Duration]:
        """(interval, grace) as Durations for an answer; built again only when they change."""
        interval = self.interval()
        grace = self.held_grace()
        cached = self._messages
        if cached is None or cached[0] != interval or cached[1] != grace:
            cached = self._messages = (interval, grace, pbtime.duration(interval), pbtime.duration(grace))
        return cached[2], cached[3]
