"""The controller's behaviour, without gRPC: deployment, placement, failure handling, node
liveness and fencing, persistence. The servicer (controller/servicer.py) only translates.

Everything runs on one asyncio loop; state changes happen between awaits, and a task that
awaited a node manager re-checks the generation it started with before acting on the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from motor import names
from motor.errors import FailedPrecondition, InvalidArgument, NotFound
from motor.names import enum_short_name
from motor.v1 import controller_pb2, types_pb2

from controller.config import ControllerConfig
from controller.events import EventBus
from controller.instances import (
    DEGRADED, FAILED, PENDING, READY, RESTARTING, STARTING,
    InstanceRecord, Policy, on_failure, state_name, transition,
)
from controller.metrics import ControllerMetrics
from controller.node_client import NodeCallError, NodeClient
from controller.placement import Fleet, NodeCapacity, Unplaceable, place_instance, ports_per_engine
from controller.store import Store, StoredNode
from controller.validation import InstanceSpec, expand, validate_deployment

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
NODE_READY, NODE_SUSPECT, NODE_LOST = C.NODE_STATE_READY, C.NODE_STATE_SUSPECT, C.NODE_STATE_LOST
LIVE_ENGINE_STATES = {T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING}
# Engine states that mean the current copy is gone and must be replaced.
DEAD_ENGINE_STATES = {T.ENGINE_STATE_FAILED, T.ENGINE_STATE_STOPPED}


def _stamp(wall: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(wall * 1e9))
    return stamp


def _integral(value: Any) -> Any:
    """google.protobuf.Struct stores every number as a double: give engines back their ints
    (engine servers validate `max_failure_count: 3`, not 3.0)."""
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass
class NodeRuntime:
    info: C.NodeInfo
    generation: int
    state: int
    reason: str
    last_seen: float  # monotonic
    last_heartbeat_wall: float = 0.0
    engines: dict[str, T.Engine] = field(default_factory=dict)
    rechecking: bool = False
    recheck_failed_at: float | None = None
    recheck_error: str = ""
    reported_since_start: bool = False

    @property
    def node_id(self) -> str:
        return self.info.node_id


# Slot fields that are persisted; the others are observations rebuilt from node reports.
_SLOT_PERSISTED = (
    "engine_id", "instance_id", "dp_rank", "node_id", "host", "requested_ports", "port", "mgmt_port",
    "kv_port", "dp_rpc_port", "accelerator_ids", "generation", "restarts", "last_failure_reason",
)


@dataclass
class EngineSlot:
    """One rank of an instance: where it is assigned and what its node last said about it."""

    engine_id: str
    instance_id: str
    dp_rank: int
    node_id: str = ""
    host: str = ""
    requested_ports: list[int] = field(default_factory=list)  # what placement asked for (0: node picks)
    port: int = 0
    mgmt_port: int = 0
    kv_port: int = 0
    dp_rpc_port: int = 0
    accelerator_ids: list[int] = field(default_factory=list)
    generation: int = 0
    restarts: int = 0
    last_failure_reason: str = ""
    # In memory only.
    launched: bool = False  # StartEngine acknowledged, or the node reported this generation
    busy: bool = False  # a start/stop for this slot is in flight
    retry_at: float = 0.0  # monotonic time before which a failed launch is not retried
    moved: bool = False  # unplaced because its node was lost: placing it again is a reschedule
    state: int = T.ENGINE_STATE_UNSPECIFIED
    health: int = T.HEALTH_STATUS_UNSPECIFIED
    health_reason: str = ""
    handled_failure_generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SLOT_PERSISTED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineSlot":
        return cls(**{k: v for k, v in data.items() if k in _SLOT_PERSISTED})

    def unplace(self) -> None:
        self.node_id, self.host, self.requested_ports, self.accelerator_ids = "", "", [], []
        self.port = self.mgmt_port = self.kv_port = self.dp_rpc_port = 0
        self.launched = False
        self.state, self.health, self.health_reason = T.ENGINE_STATE_UNSPECIFIED, T.HEALTH_STATUS_UNSPECIFIED, ""


class TokenBucket:
    """Reschedule rate limit: `rate` per second, bursts up to `rate`."""

    def __init__(self, rate: float, clock: Callable[[], float]):
        self.rate, self.clock = rate, clock
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self.updated = clock()

    def available(self, count: int) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        # A move bigger than the burst goes through once the bucket is full.
        return count <= self.tokens or self.tokens >= self.capacity

    def take(self, count: int) -> None:
        self.tokens -= count


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        store: Store,
        node_client: NodeClient,
        metrics: ControllerMetrics | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.config = config
        self.store = store
        self.nodes_client = node_client
        self.mono, self.wall = monotonic, wall
        self.events = EventBus()
        self.metrics = metrics or ControllerMetrics(self)
        self.deployment: C.Deployment | None = None
        self.revision = 0
        self.policy = Policy()
        self.config_json = "{}"
        self.nodes: dict[str, NodeRuntime] = {}
        self.instances: dict[str, InstanceRecord] = {}
        self.slots: dict[str, EngineSlot] = {}
        self.alarm: str = ""
        self.reschedule_bucket = TokenBucket(config.reschedule_rate, monotonic)
        self.started_at = monotonic()
        self.startup_until = self.started_at
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._fencing: dict[tuple[str, str, int], float] = {}
        self._restart_timers: dict[str, asyncio.TimerHandle] = {}
        self._stopping = False
        # node id -> engine ids assigned there (placement, fencing and views without full scans).
        self._by_node: dict[str, set[str]] = {}
        # Instances with something left to do (place, launch, restart); the rest cost nothing.
        self._attention: set[str] = set()
        # node id -> state, kept by _node_state(): the silent share is O(1) per change.
        self._node_states: dict[str, int] = {}
        self._state_counts: dict[int, int] = {NODE_READY: 0, NODE_SUSPECT: 0, NODE_LOST: 0}

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Reload the stored state (after a restart or kill -9)."""
        stored = self.store.load()
        if stored.deployment is not None:
            deployment = C.Deployment.FromString(stored.deployment)
            self._set_deployment(deployment, stored.revision)
        now = self.mono()
        for record in stored.nodes:
            info = C.NodeInfo.FromString(record.info)
            # Every known node gets a fresh grace period to report to this process.
            state = NODE_LOST if record.state == NODE_LOST else NODE_READY
            reason = record.reason if state == NODE_LOST else "known from the store; waiting for it to report"
            self.nodes[record.node_id] = NodeRuntime(info, record.generation, state, reason, last_seen=now)
            self._node_state(self.nodes[record.node_id], state, reason)
        for instance_id, data in stored.instances.items():
            self.instances[instance_id] = InstanceRecord.from_dict(data)
        for engine_id, data in stored.assignments.items():
            slot = self.slots[engine_id] = EngineSlot.from_dict(data)
            if slot.node_id:
                self._by_node.setdefault(slot.node_id, set()).add(engine_id)
        self._attention.update(self.instances)
        if any(n.state != NODE_LOST for n in self.nodes.values()):
            self.startup_until = now + self.config.effective_startup_grace
        logger.info(
            "loaded state: deployment revision %d, %d nodes, %d instances, %d engine assignments",
            self.revision, len(self.nodes), len(self.instances), len(self.slots),
        )

    async def start(self) -> None:
        self.load()
        self._loops = [
            asyncio.create_task(self._monitor_loop(), name="node-monitor"),
            asyncio.create_task(self._reconcile_loop(), name="reconcile"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in [*self._loops, *self._tasks]:
            task.cancel()
        for handle in self._restart_timers.values():
            handle.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
        await self.nodes_client.close()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.error("background task %s failed", name, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def wake(self) -> None:
        self._wake.set()

    def _event(self, type_: int, message: str, node_id: str = "", instance_id: str = "", engine_id: str = "") -> None:
        self.events.emit(type_, message, node_id=node_id, instance_id=instance_id, engine_id=engine_id)

    # ------------------------------------------------------------------ persistence helpers

    def _save_instance(self, inst: InstanceRecord) -> None:
        self.store.save_instance(inst.instance_id, inst.to_dict())

    def _save_slot(self, slot: EngineSlot) -> None:
        self.store.save_assignment(slot.engine_id, slot.to_dict())

    def _save_node(self, node: NodeRuntime) -> None:
        self.store.save_node(StoredNode(node.node_id, node.info.SerializeToString(), node.generation, node.state, node.reason))

    def _transition(self, inst: InstanceRecord, new_state: int, reason: str) -> None:
        """Instance state change: the state machine, then persistence and an event."""
        old = inst.state
        if transition(inst, new_state, reason, self.wall()):
            self._save_instance(inst)
            self._event(
                C.EVENT_TYPE_INSTANCE_STATE_CHANGED,
                f"instance {inst.instance_id} {state_name(old)} -> {state_name(new_state)}: {reason}",
                instance_id=inst.instance_id,
            )

    # ------------------------------------------------------------------ deployment

    def _set_deployment(self, deployment: C.Deployment | None, revision: int) -> None:
        self.deployment, self.revision = deployment, revision
        if deployment is not None:
            self.policy = Policy.from_proto(deployment.restart_policy)
            self.config_json = json.dumps(_integral(json_format.MessageToDict(deployment.engine_config)), sort_keys=True)

    def apply_deployment(self, deployment: C.Deployment) -> tuple[C.Deployment, int]:
        validated = validate_deployment(deployment)
        desired = expand(validated)
        unchanged = self.deployment is not None and (
            validated.SerializeToString(deterministic=True) == self.deployment.SerializeToString(deterministic=True)
        )
        with self.store.transaction():
            if unchanged:
                # Same spec: nothing changes, except that FAILED instances get a new chance.
                for inst in self.instances.values():
                    if inst.state == FAILED:
                        self._retry_failed(inst)
                return self.deployment, self.revision
            revision = self.revision + 1
            self.store.save_deployment(validated.SerializeToString(deterministic=True), revision)
            self._set_deployment(validated, revision)
            for instance_id in sorted(set(self.instances) - set(desired)):
                self._remove_instance(instance_id, "no longer in the deployment")
            for instance_id, spec in sorted(desired.items()):
                inst = self.instances.get(instance_id)
                if inst is not None and inst.spec_hash != spec.spec_hash:
                    self._remove_instance(instance_id, "its spec changed; it is started again")
                    inst = None
                if inst is None:
                    self._create_instance(spec)
                else:
                    inst.paired_instance_id = spec.paired_instance_id
                    if inst.state == FAILED:
                        self._retry_failed(inst)
                    self._save_instance(inst)
        self._event(
            C.EVENT_TYPE_DEPLOYMENT_CHANGED,
            f"deployment {validated.name!r} applied (revision {revision}, {len(desired)} instances)",
        )
        self.wake()
        return validated, revision

    def _retry_failed(self, inst: InstanceRecord) -> None:
        self._attention.add(inst.instance_id)
        inst.failure_times, inst.consecutive_failures = [], 0
        inst.restart_ranks = list(range(inst.data_parallel_size))
        inst.next_restart_at = self.wall()
        self._transition(inst, RESTARTING, "deployment applied again: retrying the FAILED instance")

    def _create_instance(self, spec: InstanceSpec) -> None:
        inst = InstanceRecord(
            instance_id=spec.instance_id, group=spec.group, role=spec.role,
            data_parallel_size=spec.data_parallel_size, accelerators_per_engine=spec.accelerators_per_engine,
            single_container=spec.single_container, paired_instance_id=spec.paired_instance_id,
            spec_hash=spec.spec_hash, state_changed_at=self.wall(),
        )
        self.instances[inst.instance_id] = inst
        self._attention.add(inst.instance_id)
        self._save_instance(inst)
        for rank in range(spec.data_parallel_size):
            slot = EngineSlot(names.engine_id(spec.instance_id, rank), spec.instance_id, rank)
            self.slots[slot.engine_id] = slot
            self._save_slot(slot)

    def _remove_instance(self, instance_id: str, why: str) -> None:
        self.instances.pop(instance_id, None)
        self.store.delete_instance(instance_id)
        self._attention.discard(instance_id)
        for slot in self._slots_of(instance_id):
            del self.slots[slot.engine_id]
            self._by_node.get(slot.node_id, set()).discard(slot.engine_id)
            self.store.delete_assignment(slot.engine_id)
            if slot.node_id:
                self._stop_copy(slot.node_id, slot.engine_id, slot.generation, f"instance {instance_id} {why}")

    def get_deployment(self) -> tuple[C.Deployment, int]:
        if self.deployment is None:
            raise NotFound("no deployment has been applied; apply one with `motorctl apply -f FILE`")
        return self.deployment, self.revision

    def delete_deployment(self) -> None:
        if self.deployment is None:
            return
        name = self.deployment.name
        with self.store.transaction():
            for instance_id in sorted(self.instances):
                self._remove_instance(instance_id, "deleted with the deployment")
            self.store.save_deployment(None, self.revision)
            self._set_deployment(None, self.revision)
        self._event(C.EVENT_TYPE_DEPLOYMENT_CHANGED, f"deployment {name!r} deleted; stopping its engines")

    # ------------------------------------------------------------------ nodes: register, heartbeat, events

    def register_node(self, info: C.NodeInfo, engines: Iterable[T.Engine]) -> tuple[int, list[C.EngineAssignment]]:
        if not info.node_id:
            raise InvalidArgument("node.node_id: required (a unique name of the node, e.g. 'node-a')")
        names.check_instance_id(info.node_id, "node.node_id")
        if not info.address:
            raise InvalidArgument("node.address: required (host:port of the node manager's gRPC server)")
        if info.port_range_start or info.port_range_end:
            if not 0 < info.port_range_start <= info.port_range_end <= 65535:
                raise InvalidArgument(
                    f"node.port_range_start/port_range_end: {info.port_range_start}-{info.port_range_end} is not a range within 1-65535"
                )
        previous = self.nodes.get(info.node_id)
        with self.store.transaction():
            generation = self.store.next_generation()
            node = NodeRuntime(info, generation, NODE_READY, f"registered (generation {generation})", last_seen=self.mono())
            self._node_state(node, NODE_READY, node.reason)
            node.last_heartbeat_wall = self.wall()
            node.reported_since_start = True
            self.nodes[info.node_id] = node
            self._save_node(node)
        reported = {e.engine_id: e for e in engines}
        for slot in self._slots_on(info.node_id):
            copy = reported.get(slot.engine_id)
            if copy is None or copy.spec.generation != slot.generation:
                slot.launched = False  # the node does not run it (any more): start it again
                self._attention.add(slot.instance_id)
        if previous is not None and previous.state == NODE_LOST:
            kind, how = C.EVENT_TYPE_NODE_RECOVERED, "registered again after being lost"
        elif previous is not None:
            kind, how = C.EVENT_TYPE_NODE_REGISTERED, "re-registered"
        else:
            kind, how = C.EVENT_TYPE_NODE_REGISTERED, "registered"
        self._event(
            kind,
            f"node {info.node_id} {how} (generation {generation}, {len(info.accelerator_ids)} accelerators, "
            f"{len(reported)} engines reported, address {info.address})",
            node_id=info.node_id,
        )
        for engine in reported.values():
            self._observe(node, engine, "")
        node.engines = reported
        assignments = [C.EngineAssignment(engine_id=s.engine_id, generation=s.generation) for s in self._slots_on(info.node_id)]
        self._refresh_alarm()
        self.wake()
        return generation, assignments

    def _check_member(self, node_id: str, generation: int) -> NodeRuntime:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered; call RegisterNode first")
        if generation != node.generation:
            raise FailedPrecondition(
                f"node {node_id!r}: generation {generation} is stale (current {node.generation}"
                f"{', node declared lost' if node.state == NODE_LOST else ''}); register again"
            )
        return node

    def heartbeat(self, node_id: str, generation: int, engines: Iterable[T.Engine]) -> None:
        """The hot path: a dictionary update per engine; work only for what changed."""
        node = self._check_member(node_id, generation)
        node.last_seen = self.mono()
        node.last_heartbeat_wall = self.wall()
        node.reported_since_start = True
        if node.state == NODE_SUSPECT:
            self._node_back(node, "heartbeats arrived again")
        reported: dict[str, T.Engine] = {}
        for engine in engines:
            reported[engine.engine_id] = engine
            self._observe(node, engine, "")
        node.engines = reported

    def report_engine_event(self, node_id: str, generation: int, engine: T.Engine, reason: str) -> None:
        node = self._check_member(node_id, generation)
        if not engine.engine_id:
            raise InvalidArgument("engine.engine_id: required ('<instance_id>/rank<dp_rank>')")
        names.parse_engine_id(engine.engine_id)
        node.engines[engine.engine_id] = engine
        self._observe(node, engine, reason)

    def _observe(self, node: NodeRuntime, engine: T.Engine, reason: str) -> None:
        slot = self.slots.get(engine.engine_id)
        generation = engine.spec.generation
        if slot is None or slot.node_id != node.node_id or generation != slot.generation:
            if slot is not None and slot.node_id == node.node_id and generation == 0:
                return  # a copy not launched by a controller (cannot be stale-fenced safely)
            if engine.state in LIVE_ENGINE_STATES:
                if slot is None:
                    why = "it is not part of the deployment"
                elif slot.node_id != node.node_id:
                    why = f"it is assigned to {slot.node_id or 'no node'} now (generation {slot.generation})"
                else:
                    why = f"the current generation is {slot.generation}"
                self._stop_copy(node.node_id, engine.engine_id, generation, f"stale copy (generation {generation}): {why}", fence=True)
            return
        slot.launched = True
        if engine.spec.port != slot.port and engine.spec.port:  # ports the node manager allocated
            slot.port, slot.mgmt_port = engine.spec.port, engine.spec.mgmt_port
            slot.kv_port, slot.dp_rpc_port = engine.spec.kv_port, engine.spec.dp_rpc_port
            self._save_slot(slot)
        if slot.state == engine.state and slot.health == engine.health and slot.health_reason == engine.health_reason:
            return
        slot.state, slot.health, slot.health_reason = engine.state, engine.health, engine.health_reason
        if engine.state in DEAD_ENGINE_STATES and slot.handled_failure_generation != generation:
            self._engine_failed(slot, node.node_id, reason or engine.state_reason or self._exit_words(engine))
            return
        inst = self.instances.get(slot.instance_id)
        if inst is not None:
            self._evaluate(inst)

    @staticmethod
    def _exit_words(engine: T.Engine) -> str:
        if engine.state == T.ENGINE_STATE_STOPPED:
            return "stopped outside the controller"
        if engine.HasField("exit_signal"):
            return f"exited (signal {engine.exit_signal})"
        if engine.HasField("exit_code"):
            return f"exited with code {engine.exit_code}"
        return "failed"

    # ------------------------------------------------------------------ instance health and failures

    def _slots_of(self, instance_id: str) -> list[EngineSlot]:
        inst = self.instances.get(instance_id)
        count = inst.data_parallel_size if inst else 0
        found = [self.slots.get(names.engine_id(instance_id, r)) for r in range(count)]
        if inst is None:  # removed already: find leftovers the slow way
            return [s for s in self.slots.values() if s.instance_id == instance_id]
        return [s for s in found if s is not None]

    def _slots_on(self, node_id: str) -> list[EngineSlot]:
        return [self.slots[e] for e in sorted(self._by_node.get(node_id, ()))]

    def _unplace(self, slot: EngineSlot, moved: bool = True) -> None:
        self._by_node.get(slot.node_id, set()).discard(slot.engine_id)
        slot.unplace()
        slot.moved = moved
        self._attention.add(slot.instance_id)

    def _evaluate(self, inst: InstanceRecord) -> None:
        """Derive STARTING / READY / DEGRADED from what the nodes report."""
        if inst.state in (FAILED, RESTARTING, PENDING):
            return
        slots = self._slots_of(inst.instance_id)
        if any(not s.node_id for s in slots):
            return
        waiting: list[str] = []
        for s in slots:
            node = self.nodes.get(s.node_id)
            if node is None or node.state != NODE_READY:
                state = enum_short_name(C.NodeState, node.state) if node else "unknown"
                waiting.append(f"{s.engine_id} on {s.node_id}: node {state}")
            elif s.state != T.ENGINE_STATE_RUNNING or s.health != T.HEALTH_STATUS_NORMAL:
                what = f"{enum_short_name(T.EngineState, s.state)}/{enum_short_name(T.HealthStatus, s.health)}"
                waiting.append(f"{s.engine_id} on {s.node_id}: {what}" + (f" ({s.health_reason})" if s.health_reason else ""))
        if not waiting:
            self._transition(inst, READY, f"all {len(slots)} rank(s) NORMAL")
            return
        detail = waiting[0] + (f" (+{len(waiting) - 1} more)" if len(waiting) > 1 else "")
        if inst.state == STARTING:
            # A new reason for the same state is kept in memory only (no event, no write).
            inst.reason = f"waiting for {detail}"
        else:
            self._transition(inst, DEGRADED, detail)

    def _engine_failed(self, slot: EngineSlot, node_id: str, reason: str) -> None:
        slot.handled_failure_generation = slot.generation
        slot.last_failure_reason = reason
        what = f"engine {slot.engine_id} on {node_id} {reason}"
        self._event(C.EVENT_TYPE_ENGINE_FAILED, what, node_id=node_id, instance_id=slot.instance_id, engine_id=slot.engine_id)
        inst = self.instances.get(slot.instance_id)
        if inst is None:
            return
        if inst.state == FAILED:
            self._save_slot(slot)
            return
        now = self.wall()
        decision = on_failure(inst, self.policy, now)
        with self.store.transaction():
            self._save_slot(slot)
            if decision.give_up:
                inst.restart_ranks, inst.next_restart_at = [], None
                self._transition(
                    inst, FAILED,
                    f"crash-loop budget spent: {decision.failures_in_window} failures within "
                    f"{self.policy.failure_window:g}s; last: {what}; left alone until the deployment is applied again",
                )
                self._save_instance(inst)
                return
            ranks = range(inst.data_parallel_size) if self.policy.group_scope else [slot.dp_rank]
            inst.restart_ranks = sorted(set(inst.restart_ranks) | set(ranks))
            inst.next_restart_at = now + decision.delay
            when = "now" if decision.delay == 0 else f"in {decision.delay:g}s"
            scope = "its data-parallel group" if self.policy.group_scope else "the rank"
            self._transition(
                inst, RESTARTING,
                f"{what}; restarting {scope} {when} (failure {decision.failures_in_window} of "
                f"{self.policy.max_failures} allowed within {self.policy.failure_window:g}s)",
            )
            self._save_instance(inst)
        self.metrics.reschedules.labels(reason="engine_failed").inc()
        self._attention.add(inst.instance_id)
        self._schedule_restart(inst, decision.delay)

    def _schedule_restart(self, inst: InstanceRecord, delay: float) -> None:
        timer = self._restart_timers.pop(inst.instance_id, None)
        if timer:
            timer.cancel()
        if delay <= 0 and self._startup_done():
            self._spawn(self._restart(inst.instance_id), f"restart {inst.instance_id}")
        else:
            loop = asyncio.get_running_loop()
            self._restart_timers[inst.instance_id] = loop.call_later(max(delay, 0.0), self.wake)

    async def _restart(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state != RESTARTING:
            return
        slots = [s for s in self._slots_of(instance_id) if s.dp_rank in set(inst.restart_ranks)]
        if any(s.busy for s in slots):
            return  # a start/stop is still in flight; the reconcile loop comes back
        old: dict[str, tuple[str, int]] = {}
        with self.store.transaction():
            for s in slots:
                node = self.nodes.get(s.node_id)
                if s.node_id and (node is None or node.state != NODE_READY):
                    self._unplace(s)  # its node is not usable: place the rank afresh
                if s.node_id:
                    old[s.engine_id] = (s.node_id, s.generation)
                s.generation = self.store.next_generation()
                s.launched, s.restarts, s.handled_failure_generation = False, s.restarts + 1, 0
                # Ports the node manager picked are picked again (the old ones may be taken now).
                s.port = s.mgmt_port = s.kv_port = s.dp_rpc_port = 0
                s.state, s.health, s.health_reason = T.ENGINE_STATE_UNSPECIFIED, T.HEALTH_STATUS_UNSPECIFIED, ""
                self._save_slot(s)
            inst.restarts += 1
            ranks = ",".join(str(s.dp_rank) for s in slots)
            inst.restart_ranks, inst.next_restart_at = [], None
            if any(not s.node_id for s in self._slots_of(instance_id)):
                self._transition(inst, PENDING, f"restart {inst.restarts}: rank(s) {ranks} need a new place")
            else:
                self._transition(inst, STARTING, f"restart {inst.restarts}: starting rank(s) {ranks} again")
            self._save_instance(inst)
        await asyncio.gather(*(self._replace_copy(s, old.get(s.engine_id)) for s in slots if s.node_id))
        self.wake()

    async def _replace_copy(self, slot: EngineSlot, old: tuple[str, int] | None) -> None:
        """Stop an older copy still running (group restarts), then launch the new generation."""
        if old is not None:
            node_id, generation = old
            node = self.nodes.get(node_id)
            copy = node.engines.get(slot.engine_id) if node else None
            if node is not None and copy is not None and copy.state in LIVE_ENGINE_STATES:
                slot.busy = True
                try:
                    await self.nodes_client.stop_engine(node.info, slot.engine_id, generation, self.config.stop_deadline)
                except NodeCallError as exc:
                    logger.warning("could not stop %s (generation %d) on %s: %s", slot.engine_id, generation, node_id, exc)
                finally:
                    slot.busy = False
        if self.slots.get(slot.engine_id) is slot:
            await self._launch(slot)

    # ------------------------------------------------------------------ launching and stopping

    def _engine_spec(self, slot: EngineSlot, inst: InstanceRecord) -> T.EngineSpec:
        ports = list(slot.requested_ports) + [0] * (4 - len(slot.requested_ports))
        rank0 = self.slots.get(names.engine_id(inst.instance_id, 0))
        return T.EngineSpec(
            instance_id=inst.instance_id, dp_rank=slot.dp_rank, role=inst.role, host=slot.host,
            port=ports[0], mgmt_port=ports[1], kv_port=ports[2], dp_rpc_port=ports[3],
            master_dp_ip=rank0.host if rank0 else slot.host, config_json=self.config_json,
            single_container=inst.single_container, accelerator_ids=slot.accelerator_ids,
            generation=slot.generation,
        )

    async def _launch(self, slot: EngineSlot) -> None:
        inst = self.instances.get(slot.instance_id)
        node = self.nodes.get(slot.node_id)
        if inst is None or node is None or slot.busy:
            return
        spec = self._engine_spec(slot, inst)
        slot.busy = True
        try:
            try:
                engine = await self.nodes_client.start_engine(node.info, spec)
            except NodeCallError as exc:
                if exc.code != "ALREADY_EXISTS":
                    raise
                # An older copy still runs there: stop it (fenced by generation), then retry once.
                await self.nodes_client.stop_engine(node.info, slot.engine_id, spec.generation - 1, self.config.stop_deadline)
                engine = await self.nodes_client.start_engine(node.info, spec)
        except NodeCallError as exc:
            slot.busy = False
            if self.slots.get(slot.engine_id) is not slot or slot.generation != spec.generation:
                return
            if exc.unreachable:
                # The node's liveness is the node monitor's call; try again a little later.
                slot.retry_at = self.mono() + max(1.0, self.config.heartbeat_interval)
                self._attention.add(slot.instance_id)
                logger.warning("StartEngine %s on %s: %s; retrying later", slot.engine_id, node.node_id, exc)
                return
            self._engine_failed(slot, node.node_id, f"could not be started: StartEngine {exc}")
            return
        slot.busy = False
        if self.slots.get(slot.engine_id) is not slot or slot.generation != spec.generation:
            return
        slot.launched = True
        self._event(
            C.EVENT_TYPE_ENGINE_STARTED,
            f"engine {slot.engine_id} started on {node.node_id} (generation {spec.generation}, "
            f"port {engine.spec.port or spec.port}, pid {engine.pid})",
            node_id=node.node_id, instance_id=slot.instance_id, engine_id=slot.engine_id,
        )
        node.engines.setdefault(engine.engine_id or slot.engine_id, engine)
        self._observe(node, engine, "")

    def _stop_copy(self, node_id: str, engine_id: str, generation: int, why: str, fence: bool = False) -> None:
        """Stop one copy of an engine in the background (idempotent on the node side)."""
        key = (node_id, engine_id, generation)
        now = self.mono()
        if now - self._fencing.get(key, -1e9) < 10.0:
            return  # asked recently; the node manager is on it
        self._fencing[key] = now
        if fence:
            self._event(
                C.EVENT_TYPE_ENGINE_FENCED, f"engine {engine_id} on {node_id} stopped: {why}",
                node_id=node_id, engine_id=engine_id, instance_id=engine_id.split("/")[0],
            )
        self._spawn(self._stop(node_id, engine_id, generation, why), f"stop {engine_id}@{node_id}")

    async def _stop(self, node_id: str, engine_id: str, generation: int, why: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        try:
            await self.nodes_client.stop_engine(node.info, engine_id, generation, self.config.stop_deadline)
            logger.info("stopped %s (generation %d) on %s: %s", engine_id, generation, node_id, why)
        except NodeCallError as exc:
            # Fencing on the next heartbeat or registration tries again.
            logger.warning("could not stop %s on %s (%s): %s", engine_id, node_id, why, exc)
            self._fencing.pop((node_id, engine_id, generation), None)

    # ------------------------------------------------------------------ reconcile

    def _startup_done(self) -> bool:
        if self.mono() >= self.startup_until:
            return True
        return all(n.reported_since_start for n in self.nodes.values() if n.state != NODE_LOST)

    async def _reconcile_loop(self) -> None:
        # The flag, not only cancel(): asyncio.wait_for (3.11) can swallow a cancellation that
        # races with the awaited event being set.
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                self.reconcile_once()
            except Exception:
                logger.exception("reconcile pass failed")

    def reconcile_once(self) -> None:
        if not self._startup_done():
            return
        now_wall, now = self.wall(), self.mono()
        fleet: Fleet | None = None
        for instance_id in sorted(self._attention):
            inst = self.instances.get(instance_id)
            if inst is None or inst.state == FAILED:
                self._attention.discard(instance_id)
                continue
            slots = self._slots_of(instance_id)
            if inst.state == RESTARTING:
                if inst.next_restart_at is not None and inst.next_restart_at <= now_wall:
                    self._spawn(self._restart(instance_id), f"restart {instance_id}")
                continue
            if any(s.busy for s in slots):
                continue
            unplaced = [s for s in slots if not s.node_id]
            if unplaced:
                if fleet is None:
                    fleet = self._fleet()
                self._place(inst, unplaced, fleet)
                continue
            waiting = False
            for s in slots:
                if s.launched:
                    continue
                waiting = True
                node = self.nodes.get(s.node_id)
                if node is not None and node.state == NODE_READY and s.retry_at <= now:
                    self._spawn(self._launch(s), f"launch {s.engine_id}")
            if not waiting:
                self._attention.discard(instance_id)

    def _fleet(self) -> Fleet:
        capacity = {
            n.node_id: NodeCapacity(
                n.node_id, n.info.host or n.info.address.rpartition(":")[0], list(n.info.accelerator_ids),
                port_range=(n.info.port_range_start, n.info.port_range_end),
            )
            for n in self.nodes.values() if n.state == NODE_READY
        }
        for node_id, cap in capacity.items():
            for engine_id in self._by_node.get(node_id, ()):
                s = self.slots[engine_id]
                cap.used_accelerators.update(s.accelerator_ids)
                inst = self.instances.get(s.instance_id)
                cap.ports_in_use += ports_per_engine(bool(inst and inst.single_container))
        return Fleet(list(capacity.values()))

    def _place(self, inst: InstanceRecord, unplaced: list[EngineSlot], fleet: Fleet) -> None:
        rank0_moves = any(s.dp_rank == 0 for s in unplaced)
        placed_ranks = [s for s in self._slots_of(inst.instance_id) if s.node_id]
        if rank0_moves and placed_ranks:
            # Rank 0's host is every rank's --master-dp-ip: move the group with it.
            self._spawn(self._move(inst.instance_id, [s.dp_rank for s in placed_ranks], "rank 0 moves"), f"move {inst.instance_id}")
            return
        moved = sum(1 for s in unplaced if s.moved)
        if moved and not self.reschedule_bucket.available(moved):
            self._transition(inst, PENDING, f"waiting for the reschedule rate limit ({self.config.reschedule_rate:g} engines/s)")
            return
        try:
            placements = place_instance(
                [s.dp_rank for s in unplaced], inst.accelerators_per_engine, inst.single_container, fleet
            )
        except Unplaceable as exc:
            self._transition(inst, PENDING, f"cannot be placed: {exc}")
            return
        self.reschedule_bucket.take(moved)
        by_rank = {p.dp_rank: p for p in placements}
        with self.store.transaction():
            for s in unplaced:
                p = by_rank[s.dp_rank]
                s.node_id, s.host, s.accelerator_ids = p.node_id, p.host, list(p.accelerator_ids)
                self._by_node.setdefault(p.node_id, set()).add(s.engine_id)
                s.requested_ports = [0] * p.port_count  # the node manager allocates them
                s.port = s.mgmt_port = s.kv_port = s.dp_rpc_port = 0
                s.generation = self.store.next_generation()
                s.launched, s.handled_failure_generation = False, 0
                if s.moved:
                    self.metrics.reschedules.labels(reason="node_lost").inc()
                s.moved = False
                self._save_slot(s)
            where = ", ".join(f"rank {p.dp_rank} on {p.node_id}" for p in placements)
            self._transition(inst, STARTING, f"placed: {where}")
        self.wake()

    async def _move(self, instance_id: str, ranks: list[int], why: str) -> None:
        """Take ranks off their nodes (stopping copies that still run) so they are placed again."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        slots = [s for s in self._slots_of(instance_id) if s.dp_rank in set(ranks) and s.node_id]
        for s in slots:
            s.busy = True
        try:
            stops = []
            for s in slots:
                node = self.nodes.get(s.node_id)
                if node is not None and node.state == NODE_READY:
                    stops.append(self.nodes_client.stop_engine(node.info, s.engine_id, s.generation, self.config.stop_deadline))
            results = await asyncio.gather(*stops, return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    logger.warning("stopping a copy of %s while moving it: %s", instance_id, result)
        finally:
            for s in slots:
                s.busy = False
        if self.instances.get(instance_id) is not inst:
            return
        with self.store.transaction():
            for s in slots:
                self._unplace(s)
                self._save_slot(s)
            if inst.state != FAILED:
                self._transition(inst, PENDING, f"{why}: waiting for placement")
        self.wake()

    # ------------------------------------------------------------------ node liveness

    async def _monitor_loop(self) -> None:
        period = min(0.5, self.config.heartbeat_interval / 2)
        while not self._stopping:
            await asyncio.sleep(period)
            try:
                self.check_nodes()
            except Exception:
                logger.exception("node check failed")

    def check_nodes(self) -> None:
        now = self.mono()
        grace = self.config.node_grace
        for node in self.nodes.values():
            if node.state == NODE_READY and now - node.last_seen > grace:
                self._node_state(node, NODE_SUSPECT, f"no heartbeat for {now - node.last_seen:.1f}s (grace {grace:g}s); re-checking it directly")
                node.recheck_failed_at = None
                self._event(C.EVENT_TYPE_NODE_SUSPECT, f"node {node.node_id} suspect: {node.reason}", node_id=node.node_id)
                for s in self._slots_on(node.node_id):
                    inst = self.instances.get(s.instance_id)
                    if inst is not None:
                        self._evaluate(inst)
        self._refresh_alarm()
        for node in list(self.nodes.values()):
            if node.state != NODE_SUSPECT or node.rechecking:
                continue
            if node.recheck_failed_at is not None and now - node.recheck_failed_at < max(grace, 1.0):
                if not self.alarm:
                    self._declare_lost(node)
                else:
                    node.reason = (
                        f"silent and the direct re-check failed ({node.recheck_error}); not declared lost while "
                        "the silent-nodes alarm is on"
                    )
            else:
                node.rechecking = True
                self._spawn(self._recheck(node), f"recheck {node.node_id}")

    def _node_state(self, node: NodeRuntime, state: int, reason: str) -> None:
        """Every node state change goes through here (keeps the per-state counts)."""
        previous = self._node_states.get(node.node_id)
        if previous is not None:
            self._state_counts[previous] -= 1
        self._node_states[node.node_id] = state
        self._state_counts[state] += 1
        node.state, node.reason = state, reason

    def _refresh_alarm(self) -> None:
        silent = self._state_counts[NODE_SUSPECT]
        active = len(self._node_states) - self._state_counts[NODE_LOST]
        share = silent / active if active else 0.0
        if share > self.config.silent_share_alarm:
            message = (
                f"{silent} of {active} nodes silent at once (more than {self.config.silent_share_alarm:.0%}): "
                "suspecting the controller's own network; not rescheduling them"
            )
            if not self.alarm:
                self._event(C.EVENT_TYPE_ALARM, f"alarm raised: {message}")
            self.alarm = message
        elif self.alarm:
            self.alarm = ""
            self._event(C.EVENT_TYPE_ALARM, f"alarm cleared: {silent} of {active} nodes silent")

    async def _recheck(self, node: NodeRuntime) -> None:
        generation = node.generation
        try:
            engines = await self.nodes_client.list_engines(node.info, self.config.recheck_timeout)
        except NodeCallError as exc:
            if node.generation == generation and node.state == NODE_SUSPECT:
                node.recheck_failed_at = self.mono()
                node.recheck_error = str(exc)
            return
        finally:
            node.rechecking = False
        if node.generation == generation and node.state == NODE_SUSPECT:
            node.last_seen = self.mono()
            self._node_back(node, "heartbeats were late but the direct re-check answered")
            for engine in engines:
                node.engines[engine.engine_id] = engine
                self._observe(node, engine, "")

    def _node_back(self, node: NodeRuntime, how: str) -> None:
        self._node_state(node, NODE_READY, how)
        node.recheck_failed_at = None
        self._event(C.EVENT_TYPE_NODE_RECOVERED, f"node {node.node_id} ready again: {how}", node_id=node.node_id)
        self._refresh_alarm()
        for s in self._slots_on(node.node_id):
            inst = self.instances.get(s.instance_id)
            if inst is not None:
                self._evaluate(inst)
        self.wake()

    def _declare_lost(self, node: NodeRuntime) -> None:
        silence = self.mono() - node.last_seen
        with self.store.transaction():
            # A new generation: the node's heartbeats are refused until it registers again.
            node.generation = self.store.next_generation()
            self._node_state(node, NODE_LOST, f"no heartbeat for {silence:.1f}s and the direct re-check failed ({node.recheck_error})")
            self._save_node(node)
        on_node = self._slots_on(node.node_id)
        self._event(
            C.EVENT_TYPE_NODE_LOST,
            f"node {node.node_id} lost: {node.reason}; moving its {len(on_node)} engine(s)",
            node_id=node.node_id,
        )
        by_instance: dict[str, list[int]] = {}
        with self.store.transaction():
            for s in on_node:
                self._unplace(s)
                self._save_slot(s)
                by_instance.setdefault(s.instance_id, []).append(s.dp_rank)
            for instance_id, ranks in sorted(by_instance.items()):
                inst = self.instances.get(instance_id)
                if inst is None or inst.state == FAILED:
                    continue
                if inst.state == RESTARTING:
                    inst.restart_ranks, inst.next_restart_at = [], None
                self._transition(inst, PENDING, f"rank(s) {','.join(map(str, ranks))} were on lost node {node.node_id}")
                others = [s.dp_rank for s in self._slots_of(instance_id) if s.node_id]
                if others and (self.policy.group_scope or 0 in ranks):
                    self._spawn(self._move(instance_id, others, f"node {node.node_id} lost"), f"move {instance_id}")
        self.wake()

    # ------------------------------------------------------------------ views

    def node_proto(self, node: NodeRuntime) -> C.Node:
        used = {a for e in self._by_node.get(node.node_id, ()) for a in self.slots[e].accelerator_ids}
        proto = C.Node(
            info=node.info, state=node.state, state_reason=node.reason, generation=node.generation,
            free_accelerator_ids=[a for a in node.info.accelerator_ids if a not in used],
            engines=[node.engines[k] for k in sorted(node.engines)],
        )
        if node.last_heartbeat_wall:
            proto.last_heartbeat.CopyFrom(_stamp(node.last_heartbeat_wall))
        return proto

    def list_nodes(self) -> tuple[list[C.Node], list[str]]:
        return [self.node_proto(self.nodes[k]) for k in sorted(self.nodes)], [self.alarm] if self.alarm else []

    def instance_proto(self, inst: InstanceRecord) -> C.Instance:
        slots = self._slots_of(inst.instance_id)
        rank0 = next((s for s in slots if s.dp_rank == 0), None)
        proto = C.Instance(
            instance_id=inst.instance_id, group=inst.group, role=inst.role, state=inst.state,
            state_reason=inst.reason, master_dp_ip=rank0.host if rank0 else "",
            paired_instance_id=inst.paired_instance_id, restarts=inst.restarts,
            engines=[
                C.InstanceEngine(
                    engine_id=s.engine_id, dp_rank=s.dp_rank, node_id=s.node_id, host=s.host, port=s.port,
                    mgmt_port=s.mgmt_port, accelerator_ids=s.accelerator_ids, state=s.state, health=s.health,
                    restarts=s.restarts, last_failure_reason=s.last_failure_reason, generation=s.generation,
                )
                for s in slots
            ],
        )
        if inst.state == RESTARTING and inst.next_restart_at:
            proto.next_restart_time.CopyFrom(_stamp(inst.next_restart_at))
        return proto

    def list_instances(self) -> list[C.Instance]:
        return [self.instance_proto(self.instances[k]) for k in sorted(self.instances)]

    def list_endpoints(self, role: int = T.ROLE_UNSPECIFIED) -> list[C.Endpoint]:
        out = []
        for engine_id in sorted(self.slots):
            s = self.slots[engine_id]
            inst = self.instances.get(s.instance_id)
            node = self.nodes.get(s.node_id)
            if inst is None or node is None or node.state != NODE_READY or not s.port:
                continue
            if s.state != T.ENGINE_STATE_RUNNING or s.health != T.HEALTH_STATUS_NORMAL:
                continue
            if role != T.ROLE_UNSPECIFIED and inst.role != role:
                continue
            out.append(C.Endpoint(instance_id=s.instance_id, engine_id=s.engine_id, role=inst.role, url=f"http://{s.host}:{s.port}"))
        return out

    def snapshot(self) -> C.ClusterSnapshot:
        nodes, _ = self.list_nodes()
        return C.ClusterSnapshot(nodes=nodes, instances=self.list_instances(), recent_events=list(self.events.recent))
