"""The controller's behaviour, without gRPC: it orchestrates its parts and the servicer
(controller/api/servicer.py) only translates.

- state.py: the node, slot and instance tables (nodes.py, slots.py) and the rules shared by
  every part (instance transitions are stored and announced);
- lifecycle.py: an engine copy's path: a report read, a failure decided (restart or give up),
  restarts, launches, moves off lost nodes;
- scheduling.py: the reconcile pass and placement;
- liveness.py: SUSPECT / LOST / the silent-nodes alarm;
- actuator.py: StartEngine / StopEngine and fencing of stale copies;
- views.py: the protobuf views and the read side (`ClusterReads`, a base of `Controller`).
- deployments.py: ApplyDeployment / DeleteDeployment, persisted first, made in slices;
This file: the parts put together (node reports: controller/fleet/registration.py).

Everything runs on one asyncio loop; state changes happen between awaits, and a task that
awaited a node manager re-checks the generation it started with before acting on the answer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Iterable

from controller.capacity.autoscale_metrics import AutoscaleCollector
from controller.capacity.autoscaler import Autoscaler
from controller.capacity.scheduling import Scheduler
from controller.capacity.spares import Spares
from controller.config import ControllerConfig
from controller.deploy.availability import Availability
from controller.deploy.changes import DeploymentChanges
from controller.deploy.rollout import Rollouts
from controller.engines.actuator import Actuator
from controller.engines.adoption import Adoption
from controller.engines.generations import Generations
from controller.engines.lifecycle import EngineLifecycle
from controller.engines.node_client import NodeClient
from controller.fleet.beat_pacing import BeatPacing
from controller.fleet.claims import NodeClaims
from controller.fleet.conflicts import ConflictLog
from controller.fleet.heartbeat_budget import HeartbeatBudget
from controller.fleet.liveness import NodeMonitor
from controller.fleet.node_stores import NodeStoreAlarms
from controller.fleet.registration import NodeReports
from controller.fleet.series import FleetSeries
from controller.metrics import ControllerMetrics
from controller.model.cluster import ClusterState
from controller.model.deployments import Deployments
from controller.model.events import EventBus
from controller.model.instances import InstanceRecord
from controller.model.nodes import NODE_LOST, NODE_READY, NodeRuntime
from controller.model.slots import EngineSlot
from controller.reads import views
from controller.routing import endpoints
from controller.routing.adapters import AdapterSync
from controller.routing.door_reports import FrontDoorCollector, FrontDoors
from controller.rules.slicing import Steps, run_sliced
from controller.store.interface import Store
from controller.store.write_metrics import MeasuredStore, StoreMetrics
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract import heartbeats
from motor.service.tasks import TaskSet, cancel_and_wait, set_within
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
RegisterNodeResponse = C.RegisterNodeResponse


class Controller(views.ClusterReads):
    def __init__(
        self,
        config: ControllerConfig,
        store: Store,
        node_client: NodeClient,
        clock: Clock = SYSTEM_CLOCK,
        events: EventBus | None = None,
        acting: Callable[[], bool] = lambda: True,
    ):
        self.config = config
        # Every store (SQLite, etcd, a test's) is measured alike: write latency and failures.
        store_metrics = StoreMetrics()
        self.store = store = MeasuredStore(store, store_metrics)
        self.nodes_client = node_client
        self.clock = clock
        self.mono, self.wall = clock.monotonic, clock.time
        # Shared by the controllers one HA process runs in turn (docs/ha.md), so watchers stay.
        self.events = events or EventBus()
        # False while this controller may not act (an HA leader past its renewal deadline, until
        # it is stopped): the reconcile and node-check passes are skipped.
        self.acting = acting
        # Every deployment's spec, revision, indexes and rollout record, in one home.
        self.deployments = Deployments(store, self.events, clock)
        # The tables tell this controller of their changes (`engines_changed`, `instance_state_changed`).
        self.state = ClusterState(store, self.events, clock, self.deployments, listener=self)
        self.endpoints = endpoints.EndpointFeed(self.state)
        st = self.state
        self.metrics = ControllerMetrics(
            self.state.nodes.counts,
            lambda: collections.Counter(i.state for i in self.state.instances.values()),
            store_metrics.collectors,
            lambda: revision_counts(st),
        )
        self.started_at = clock.monotonic()
        self._wake = asyncio.Event()
        self._tasks = TaskSet("controller")
        self._loops: list[asyncio.Task] = []
        self._stopping = False
        self.actuator = Actuator(
            node_client,
            self.state.nodes,
            config.stop_deadline,
            self._spawn,
            self.events,
            clock,
            self.state.deployment_of_id,
            kv_events=config.kv_events,
        )
        self.generations = Generations(self.store, self.state.refused)
        # What each router's sync says its router routes to: "available" for rollouts and spares.
        self.front_doors = FrontDoors(self.events, clock)
        self.metrics.registry.register(FrontDoorCollector(self.front_doors))
        doors = self.front_doors
        availability = Availability(self.state, self.endpoints, doors.routes_to, doors.may_route_to)
        self.spares = Spares(self.state, self.actuator, availability)
        self.lifecycle = EngineLifecycle(self.state, self.actuator, self.generations, self.metrics, self)
        self.adoption = Adoption(self.state, self.lifecycle)
        self.changes = DeploymentChanges(
            self.state,
            self.deployments,
            config.max_engines_per_deployment,
            self.endpoints,
            self.actuator,
            self.adoption,
            self.wake,
            self._spawn,
            availability,
        )
        self.rollouts = Rollouts(self.state, self.deployments, self.changes, availability, self.actuator)
        self.scheduler = Scheduler(self.state, config, self.lifecycle, self.metrics, self, self.spares, self.rollouts)
        # Runs where the rollouts run: only a started (leading) controller's loops tick it.
        self.autoscaler = Autoscaler(
            self.state, self.deployments, self.changes, self.rollouts, self._spawn, self.spares
        )
        self.metrics.registry.register(AutoscaleCollector(self.autoscaler))
        # The interval node managers are told and the grace their silence is judged by.
        self.budget = HeartbeatBudget(
            config.heartbeat_interval, config.node_grace, config.max_heartbeats_per_second, self.state.nodes.live, clock
        )
        self.metrics.heartbeat_interval.set_function(lambda: self.budget.announced)
        self.metrics.node_grace.set_function(self.budget.held_grace)
        self.pacing = BeatPacing(self.state.nodes, clock, self.metrics.heartbeats_refused)
        conflicts = ConflictLog()  # of RegisterNode's claims, which the node monitor reads
        self.monitor = NodeMonitor(self.state, config, self.budget, node_client, self.lifecycle, self, conflicts)
        # The fleet aggregates, served beside metrics.registry's (/metrics).
        self.fleet_series = FleetSeries(self.state, lambda: self.monitor.alarm, clock=clock)
        self.claims = NodeClaims(self.state, config, self.monitor, self.metrics.registrations_refused, conflicts)
        self.node_stores = NodeStoreAlarms(self.events)
        self.adapters = AdapterSync(self.state, self._spawn, self.front_doors)
        self.reports = NodeReports(
            self.state,
            config,
            clock,
            self.claims,
            self.monitor,
            self.generations,
            self.adoption,
            self.actuator,
            self.lifecycle,
            self.node_stores,
            node_client,
            self._spawn,
            self.wake,
        )

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Reload the stored state (after a restart or kill -9)."""
        st = self.state
        stored = self.store.load()
        self.adoption.loaded(stored)
        self.deployments.loaded(stored)  # and their rollouts as the store leaves them
        now = self.mono()
        for record in stored.nodes:
            info = C.NodeInfo.FromString(record.info)
            # Every known node gets a fresh grace period to report to this process, and the time a
            # node manager may still be waiting between two tries (it backed off while this
            # process was away; NodeMonitor.suspect_if_silent): a restart alone suspects no node.
            state = NODE_LOST if record.state == NODE_LOST else NODE_READY
            reason = record.reason if state == NODE_LOST else "known from the store; waiting for it to report"
            st.nodes.put(NodeRuntime(info, record.generation, state, reason, last_seen=now))
        for instance_id, data in stored.instances.items():
            st.instances[instance_id] = InstanceRecord.from_dict(data)
        for data in stored.assignments.values():
            st.slots.add(EngineSlot.from_dict(data))
        st.attention.update(st.instances)
        if any(n.state != NODE_LOST for n in st.nodes.values()):
            # By default also the node managers' longest backoff, as their first reports may take.
            backoff = heartbeats.MAX_BACKOFF if self.config.startup_grace is None else 0.0
            self.lifecycle.startup_until = now + self.startup_grace() + backoff
        logger.info(
            "loaded state: %d deployment(s), %d nodes, %d instances, %d engine assignments",
            len(self.deployments.by_name),
            len(st.nodes),
            len(st.instances),
            len(st.slots),
        )

    async def start(self) -> None:
        self.load()
        self.deployments.upgrade()  # the leader only: a standby's view loads and never writes
        self._loops = [
            asyncio.create_task(self._monitor_loop(), name="node-monitor"),
            asyncio.create_task(self._reconcile_loop(), name="reconcile"),
            asyncio.create_task(
                self._repeat(lambda: asyncio.sleep(0.5), self.adapters.pass_once, "adapter pass"), name="adapters"
            ),
            asyncio.create_task(
                self._repeat(lambda: asyncio.sleep(0.5), self.front_doors.check, "front-door check"), name="front-doors"
            ),
            asyncio.create_task(
                self._repeat(lambda: asyncio.sleep(1.0), self.autoscaler.tick, "autoscaling pass"), name="autoscaler"
            ),
        ]

    async def stop(self) -> None:
        self._stopping = True
        self.lifecycle.cancel_timers()
        await cancel_and_wait(*self._loops, *self._tasks, owner="controller")
        await self.nodes_client.close()
        await self.adapters.close()

    # ------------------------------------------------------------------ what the tables tell (ClusterState's listener)

    def engines_changed(self, engine_ids: Iterable[str] | None) -> None:
        self.endpoints.changed(engine_ids)

    def instance_state_changed(self, inst: InstanceRecord, old: int) -> None:
        self.spares.state_changed(inst, old)  # the one trigger of a promotion

    def _spawn(self, coro, name: str) -> asyncio.Task:
        return self._tasks.spawn(coro, name)

    def wake(self) -> None:
        self._wake.set()

    async def _reconcile_loop(self) -> None:
        async def woken_or_timeout() -> None:
            await set_within(self._wake, 0.5)
            self._wake.clear()

        await self._repeat(woken_or_timeout, self.scheduler.reconcile_steps, "reconcile pass")

    def reconcile_once(self) -> None:
        self.scheduler.reconcile_once()

    async def _monitor_loop(self) -> None:
        period = min(0.5, self.config.heartbeat_interval / 2)
        loop = asyncio.get_running_loop()
        last = self.mono(), loop.time()

        async def tick() -> None:
            nonlocal last
            await asyncio.sleep(period)
            now = self.mono(), loop.time()
            # Away: the tick came late on the loop's own clock (the process did not run) and the
            # controller's clock, which node silence is judged by, moved on meanwhile too: the
            # lesser of the two overruns (a clock that moves only when told is not away while
            # the loop runs on time).
            self.monitor.controller_was_away(min(now[0] - last[0], now[1] - last[1]) - period)
            last = now

        await self._repeat(tick, self.check_nodes, "node check")

    async def _repeat(self, wait: Callable[[], Awaitable[None]], step: Callable[[], Steps | None], what: str) -> None:
        # The flag, not only cancel(): asyncio.wait_for (3.11) can swallow a cancellation that
        # races with the awaited event being set.
        while not self._stopping:
            await wait()
            if not self.acting():
                continue
            try:
                slices = step()
                if slices is not None:  # a long step, in slices (controller/rules/slicing.py)
                    await run_sliced(slices)
            except Exception:
                logger.exception("%s failed", what)

    def check_nodes(self) -> None:
        self.monitor.check()
        self.claims.end_quiet()

    # ------------------------------------------------------------------ deployment (controller/deploy/changes.py)

    @property
    def deployment(self) -> C.Deployment | None:
        return self.deployments.deployment

    @property
    def revision(self) -> int:
        return self.deployments.revision

    def apply_deployment(self, deployment: C.Deployment) -> tuple[C.Deployment, int]:
        """At once, holding the loop: start-up and tests. The API calls `apply` (in slices)."""
        return self.changes.apply_now(deployment)

    def delete_deployment(self, name: str = "") -> None:
        self.changes.delete_now(name)

    async def apply(self, deployment: C.Deployment) -> tuple[C.Deployment, int]:
        return await self.changes.apply(deployment, adjust=self.autoscaler.keep_counts)

    def dry_run_apply(self, deployment: C.Deployment) -> tuple[C.Deployment, int]:
        return self.changes.dry_run(self.autoscaler.keep_counts(deployment))  # what `apply` would make

    async def delete(self, name: str = "") -> None:
        await self.changes.delete(name)

    async def apply_on_new_store(self, deployment: C.Deployment) -> tuple[C.Deployment, int] | None:
        return await self.changes.apply_on_new_store(deployment)

    async def engines_heard(self) -> None:
        """Returns once every known node has reported to this process, or two heartbeat intervals
        after the start. Until then (after a restart, or a standby taking over) it knows no
        engine's health: an endpoint snapshot would list none, and a router following it would
        lose every worker. Not longer: a node still silent then (dead, or backing off) would hold
        back every change the routers should hear; its engines join once it reports."""
        deadline = self.started_at + 2 * self.budget.interval()
        while not self.lifecycle.startup_done() and self.mono() < deadline:
            await asyncio.sleep(0.05)

    def startup_grace(self) -> float:
        """--startup-grace; by default the node grace the budget states for the nodes known now
        (the configured node grace on a new store, which knows none)."""
        return self.budget.grace() if self.config.startup_grace is None else self.config.startup_grace

    def spawn(self, coro, name: str) -> asyncio.Task:
        """A task of this controller's: cancelled when it stops (an HA leader stepping down too)."""
        return self._spawn(coro, name)

    def get_deployment(self, name: str = "") -> tuple[C.Deployment, int]:
        """The named deployment; without a name, the only one (controller/deploy/changes.py: `named`)."""
        return self.deployments.by_name[self.deployments.named(name)]

    # ------------------------------------------------------------------ node reports (controller/fleet/registration.py)

    async def register_node(
        self, info: C.NodeInfo, engines: Iterable[T.Engine], highest_generation: int = 0
    ) -> RegisterNodeResponse:
        return await self.reports.register_node(info, engines, highest_generation)

    def heartbeat(
        self,
        node_id: str,
        generation: int,
        engines: Iterable[T.Engine],
        delta: bool = False,
        removed: Iterable[str] = (),
        store_failing: str = "",
    ) -> None:
        self.reports.heartbeat(node_id, generation, engines, delta, removed, store_failing)

    def report_engine_event(self, node_id: str, generation: int, engine: T.Engine, reason: str) -> None:
        self.reports.report_engine_event(node_id, generation, engine, reason)


def revision_counts(st: ClusterState) -> dict[tuple[str, int], int]:
    """Instances per (deployment, revision), counted per group first: one lookup per group, not
    per instance (a scrape at 10,000 instances)."""
    by_group = collections.Counter((i.group, i.revision) for i in st.instances.values())
    counts: collections.Counter = collections.Counter()
    for (group, revision), n in by_group.items():
        counts[st.deployments.owner(group), revision] += n
    return counts
