"""What the front door routes to: the reports of each router's motor-router-sync (ReportFrontDoor).

The controller's endpoint feed says which engines may serve; only the router says which ones
clients reach. A sync that died leaves its router with the workers it last had (a rollout once
completed while the router still held the two stopped engines' URLs: every request 503), so
rollouts and spares count an engine available only when `routes_to(url)` says so:

- no front door ever reported (a cluster without a router, or a controller that has just
  started and not yet heard its sync): yes, the controller's feed alone decides, as before;
- a fresh report (younger than `STALE_AFTER_INTERVALS` of its own report interval): yes when
  the URL is among the router's workers and the router answers its sync;
- a stale report (the sync dead or cut off): no. What the router routes to is unknown, so
  nothing new counts as available through it: a rollout waits instead of withdrawing the
  instances the router may still be sending requests to. The other side of the same unknown is
  `may_route_to(url)`, yes through a stale front door: what stopping an instance would cost
  (a change deciding which instances to keep must not read "unknown" as "nobody reaches it").
  A front door silent for `forget_after` (10 minutes by default: a router retired for good) is
  forgotten, with an event, and the controller's feed decides again;
- several front doors: yes when any fresh one routes to the URL.

Each change of a front door's health is one event (EVENT_TYPE_FRONT_DOOR) and the series
`motor_front_door_*` (FrontDoorCollector, below) show its age, workers and restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller.model.events import EventBus
from motor.clock import SYSTEM_CLOCK, Clock
from motor.errors import InvalidArgument
from motor.service.scraped import ScrapedCollector
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)

# A report is stale once this many of its report intervals passed without the next one.
STALE_AFTER_INTERVALS = 3
FORGET_AFTER = 600.0  # seconds of silence after which a front door is forgotten
MAX_WORKERS = 100_000  # more worker URLs than any router holds: a report that is not one
EVENT = controller_pb2.EVENT_TYPE_FRONT_DOOR


@dataclass
class ReportedDoor:
    """One router as its sync last reported it."""

    router: str
    workers: frozenset[str]
    answering: bool
    interval: float
    sync_instance: str
    received_at: float  # the controller's monotonic clock
    stale: bool = False
    sync_restarts: int = 0
    router_restarts: int = 0  # as the current sync instance counted them
    router_restarts_seen: int = 0  # over every sync instance (the metric)
    seen_instances: set[str] = field(default_factory=set)

    def routes_to(self, url: str) -> bool:
        return not self.stale and self.answering and url in self.workers


class FrontDoors:
    def __init__(self, events: EventBus, clock: Clock = SYSTEM_CLOCK, forget_after: float = FORGET_AFTER):
        self.events, self.clock, self.forget_after = events, clock, forget_after
        self.doors: dict[str, ReportedDoor] = {}

    # What the syncs say ------------------------------------------------------------------------

    def report(
        self,
        router: str,
        worker_urls: Iterable[str],
        answering: bool,
        interval: float,
        sync_instance: str,
        router_restarts: int = 0,
    ) -> None:
        """One ReportFrontDoor: replaces the router's previous report; announces what changed."""
        if not router:
            raise InvalidArgument("router: required (the router's URL as its sync reaches it)")
        if not interval > 0:
            raise InvalidArgument(f"report_interval: must be above 0 seconds (got {interval:g})")
        workers = frozenset(worker_urls)
        if len(workers) > MAX_WORKERS:
            raise InvalidArgument(f"worker_urls: {len(workers)} URLs, more than {MAX_WORKERS}")
        now = self.clock.monotonic()
        door = self.doors.get(router)
        if door is None:
            door = self.doors[router] = ReportedDoor(router, workers, answering, interval, sync_instance, now)
            door.seen_instances.add(sync_instance)
            door.router_restarts = router_restarts
            self.events.emit(
                EVENT,
                f"front door {router}: motor-router-sync reports {self._holds(door)}; rollouts and spares "
                "count an engine available only when a front door routes to it",
            )
            return
        silent = now - door.received_at
        if door.stale:
            self.events.emit(EVENT, f"front door {router} reports again after {silent:.0f}s of silence")
        if sync_instance != door.sync_instance and sync_instance not in door.seen_instances:
            door.sync_restarts += 1
            door.seen_instances.add(sync_instance)
            self.events.emit(
                EVENT,
                f"front door {router}: motor-router-sync was restarted (start {door.sync_restarts + 1}); "
                f"it reports {self._holds_of(workers, answering)}",
            )
        counted = door.router_restarts if sync_instance == door.sync_instance else 0  # a new sync counts from 0
        if router_restarts > counted:
            door.router_restarts_seen += router_restarts - counted
            self.events.emit(
                EVENT,
                f"front door {router}: its router was restarted (it stopped answering its sync, or lost workers it "
                f"held); the sync gave it its whole list again: {self._holds_of(workers, answering)}",
            )
        if answering != door.answering:
            self.events.emit(
                EVENT,
                f"front door {router}: its router answers its sync again; {self._holds_of(workers, answering)}"
                if answering
                else f"front door {router}: its router does not answer its sync; no engine counts as available "
                "through it until it does",
            )
        door.workers, door.answering, door.interval = workers, answering, interval
        door.sync_instance, door.received_at, door.stale = sync_instance, now, False
        door.router_restarts = router_restarts

    def check(self) -> None:
        """Periodic: a front door whose reports stopped turns stale (one event), and is forgotten
        after `forget_after` of silence (one event)."""
        now = self.clock.monotonic()
        for router, door in list(self.doors.items()):
            silent = now - door.received_at
            if silent > self.forget_after:
                del self.doors[router]
                self.events.emit(
                    EVENT,
                    f"front door {router}: no report for {silent:.0f}s; forgotten (a router retired for good): "
                    + (
                        "the controller's endpoints alone decide what is available"
                        if not self.doors
                        else "the other front doors decide what is available"
                    ),
                )
            elif not door.stale and silent > STALE_AFTER_INTERVALS * door.interval:
                door.stale = True
                self.events.emit(
                    EVENT,
                    f"front door {router}: no report from motor-router-sync for {silent:.0f}s (dead or cut off; "
                    f"expected every {door.interval:g}s): what its router routes to is unknown, so no engine counts "
                    "as available through it until it reports again",
                )

    # What rollouts and spares ask ---------------------------------------------------------------

    def routes_to(self, url: str) -> bool:
        """Does the front door route to this engine URL? Yes when no front door ever reported; no
        through a stale one. What counts an engine available (a rollout's progress)."""
        if not self.doors:
            return True
        return any(door.routes_to(url) for door in self.doors.values())

    def may_route_to(self, url: str) -> bool:
        """Might the front door be sending requests to this engine URL? The other side of an
        unknown: yes through a stale front door or a router that does not answer its sync (it may
        still, or again, hold its last list). What stopping an instance would cost: a change must
        not take an unknown for 'nobody reaches it'."""
        if not self.doors:
            return True
        return any(door.stale or not door.answering or url in door.workers for door in self.doors.values())

    # Views --------------------------------------------------------------------------------------

    def ages(self) -> dict[str, float]:
        now = self.clock.monotonic()
        return {router: now - door.received_at for router, door in self.doors.items()}

    @staticmethod
    def _holds_of(workers: frozenset[str], answering: bool) -> str:
        return f"its router holds {len(workers)} worker(s)" if answering else "its router does not answer"

    def _holds(self, door: ReportedDoor) -> str:
        return self._holds_of(door.workers, door.answering)


class FrontDoorCollector(ScrapedCollector):
    """The `motor_front_door_*` series, read from `FrontDoors` at scrape time (one per router)."""

    def __init__(self, doors: FrontDoors):
        self.doors = doors

    def collect(self):
        up = GaugeMetricFamily(
            "motor_front_door_up",
            "1 while the router's motor-router-sync reports in time and the router answers it; 0: no engine "
            "counts as available through this front door (rollouts wait).",
            labels=["router"],
        )
        age = GaugeMetricFamily(
            "motor_front_door_report_age_seconds",
            "Seconds since the router's motor-router-sync last reported (ReportFrontDoor).",
            labels=["router"],
        )
        workers = GaugeMetricFamily(
            "motor_front_door_workers", "Engine URLs the router holds, as its sync last reported.", labels=["router"]
        )
        restarts = CounterMetricFamily(
            "motor_front_door_sync_restarts",
            "Restarts of the router's motor-router-sync seen by the controller (a new sync instance reporting).",
            labels=["router"],
        )
        router_restarts = CounterMetricFamily(
            "motor_front_door_router_restarts",
            "Restarts of the router its motor-router-sync found (the router stopped answering, or lost workers it "
            "held) and re-synced.",
            labels=["router"],
        )
        ages = self.doors.ages()
        for router, door in sorted(self.doors.doors.items()):
            up.add_metric([router], float(not door.stale and door.answering))
            age.add_metric([router], ages[router])
            workers.add_metric([router], len(door.workers))
            restarts.add_metric([router], door.sync_restarts)
            router_restarts.add_metric([router], door.router_restarts_seen)
        yield from (up, age, workers, restarts, router_restarts)
