"""What the controller knows, shared by its parts: the node, slot and instance tables, the
instances that need attention, and the few rules every part follows when it changes them (an
instance changes state through `transition`, stored and announced; slots and nodes are saved).
Which deployment, restart policy and engine config an instance has, it asks the deployments'
home (controller/model/deployments.py); what it changes, it tells its listener (the endpoint
feed and the spares), both given when it is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

from controller.model.deployments import Deployments
from controller.model.events import EventBus
from controller.model.instances import (
    DEGRADED,
    FAILED,
    PENDING,
    READY,
    RESTARTING,
    STARTING,
    InstanceRecord,
    Policy,
    state_name,
    transition,
)
from controller.model.nodes import NODE_READY, NodeRuntime, NodeTable
from controller.model.slots import EngineSlot, SlotTable
from controller.store.interface import Store, StoredNode, StoreUnavailable
from motor.clock import Clock
from motor.contract.names import enum_short_name
from motor.service.retry import backoff_delay, worth_reporting
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2


class StateListener(Protocol):
    """What hears of the tables' changes (the Controller, for its endpoint feed and its spares)."""

    def engines_changed(self, engine_ids: Iterable[str] | None) -> None:
        """Something that decides whether these engines (None: any engine) can serve may have changed."""

    def instance_state_changed(self, inst: InstanceRecord, old: int) -> None:
        """An instance changed state (`old`: its state before)."""


class NoListener:
    """Tables nobody listens to (a unit test's, a benchmark's)."""

    def engines_changed(self, engine_ids: Iterable[str] | None) -> None:
        pass

    def instance_state_changed(self, inst: InstanceRecord, old: int) -> None:
        pass


class ClusterState:
    def __init__(
        self,
        store: Store,
        events: EventBus,
        clock: Clock,
        deployments: Deployments | None = None,
        listener: StateListener | None = None,
    ):
        self.store, self.events, self.clock = store, events, clock
        # Every deployment's spec and indexes; the tables only read it.
        self.deployments = deployments or Deployments(store, events, clock)
        self.listener = listener or NoListener()
        # The two readings every rule takes, by their short names.
        self.mono, self.wall = clock.monotonic, clock.time
        self.nodes = NodeTable()
        self.slots = SlotTable()
        self.instances: dict[str, InstanceRecord] = {}
        # Instances with something left to do (place, launch, restart); the rest cost nothing.
        self.attention: set[str] = set()
        # Engine id -> the adapters loaded into its current copy (controller/routing/adapters.py).
        self.engine_adapters: dict = {}
        # Write-behind of what already happened (a failure, a restart, a node's report): the
        # rows changed since the last successful write, by table. A write the store refuses
        # (a full disk) leaves them here; `flush` tries again with backoff until it lands.
        self.unsaved: dict[str, set[str]] = {"instances": set(), "slots": set(), "nodes": set()}
        # Instances a deployment change removes or replaces, written to the store and not yet
        # removed (or, replaced, installed again) in memory (controller/deploy/changes.py): their
        # rows are the change's until memory has caught up.
        self.leaving: set[str] = set()
        # A new store: engines the nodes run that it does not know are kept, not fenced, until a
        # deployment is applied (controller/engines/adoption.py).
        self.keeping_unknown = False
        self._batch_depth = 0
        self._flush_scheduled = False
        self.store_failures = 0  # refused writes in the current spell (0: the store works)
        self.store_retry_at = 0.0  # monotonic

    def engines_changed(self, engine_ids: Iterable[str] | None = None) -> None:
        """After anything that may change which engines can serve (the endpoint feed hears it),
        with the ids of the engines it may concern (None: any engine)."""
        self.listener.engines_changed(engine_ids)

    # ------------------------------------------------------------------ an instance's deployment

    def deployment_of(self, inst: InstanceRecord) -> str:
        return self.deployments.owner(inst.group) or inst.deployment

    def deployment_of_id(self, instance_id: str) -> str:
        """The deployment of an instance id, also of one just removed ("<group>-<index>")."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            return self.deployment_of(inst)
        return self.deployments.owner(instance_id.rpartition("-")[0])

    def instances_of(self, name: str) -> list[str]:
        """The ids of the deployment's instances, sorted."""
        of = self.deployment_of
        return sorted(i for i, inst in self.instances.items() if of(inst) == name)

    def policy_of(self, inst: InstanceRecord) -> Policy:
        """The restart policy of the instance's deployment (its own crash-loop budget)."""
        return self.deployments.policy(self.deployment_of(inst))

    def config_of(self, inst: InstanceRecord) -> str:
        """The engine_config of the revision the instance runs (its record's), not the latest apply's."""
        return inst.config or self.deployments.config(self.deployment_of(inst))

    def placement_order(self, instance_id: str) -> tuple[bool, float, str]:
        """Serving instances before warm spares, then first come, first served across deployments:
        the instance PENDING the longest is placed first (then by id); placement only uses free
        accelerators, never those of a placed instance."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return (False, 0.0, instance_id)
        return (inst.spare, inst.state_changed_at if inst.state == PENDING else 0.0, instance_id)

    def event(self, type_: int, message: str, **about: str) -> None:
        """An event (`about`: its node_id, instance_id, engine_id, deployment, as `EventBus.emit`
        takes them), and to the endpoint watchers the engines it may have changed. An event about an
        instance or engine names its deployment, so WatchEvents can follow one deployment."""
        node_id, instance_id, engine_id = (about.get(name, "") for name in ("node_id", "instance_id", "engine_id"))
        if not about.get("deployment") and (instance_id or engine_id):
            about["deployment"] = self.deployment_of_id(instance_id or engine_id.partition("/")[0])
        self.events.emit(type_, message, **about)
        if not (node_id or instance_id or engine_id):
            self.engines_changed(None)  # a deployment change, an alarm: anything may have changed
            return
        if engine_id:  # about one engine (started, failed, fenced): only its endpoint may change
            self.engines_changed([engine_id])
            return
        concerned: set[str] = set()
        if instance_id:
            concerned.update(s.engine_id for s in self.slots_of(instance_id))
        if node_id:
            concerned.update(s.engine_id for s in self.slots.placed_on(node_id))
        self.engines_changed(concerned)

    def save_instance(self, inst: InstanceRecord) -> None:
        self._changed("instances", inst.instance_id)

    def save_slot(self, slot: EngineSlot) -> None:
        self._changed("slots", slot.engine_id)

    def save_node(self, node: NodeRuntime) -> None:
        self._changed("nodes", node.node_id)

    def _changed(self, table: str, key: str) -> None:
        self.unsaved[table].add(key)
        if self._batch_depth == 0:
            self._flush_soon()

    def _flush_soon(self) -> None:
        """Flush once this turn of the loop is over: the rows changed in one turn (a burst of
        StartEngine answers, a heartbeat's reports) go out as one transaction, not one each."""
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test driving the tables): now
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Changes written together, in one store transaction, when the block ends."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
        if self._batch_depth == 0:
            self.flush()

    def flush(self, retry: bool = False) -> bool:
        """Write every unsaved row as memory has it now (a row gone from memory is deleted).
        Memory is never rolled back: it describes what happened. A refused write is counted,
        announced once per spell, and tried again from the reconcile loop with backoff (1 s, 2 s
        ... 30 s); True when nothing is left unsaved. While the store is busy with a big write the
        rows wait for the next flush (the reconcile pass flushes every 0.5 s)."""
        if not any(self.unsaved.values()):
            return True
        if self.store.busy:
            return False  # a big write runs in a thread (controller/deploy/changes.py): after it, not blocked behind it
        if self.store_failures and not retry and self.mono() < self.store_retry_at:
            return False
        unsaved = {table: set(keys) for table, keys in self.unsaved.items()}
        try:
            with self.store.transaction():
                self._write(unsaved)
        except StoreUnavailable as exc:
            self.refused(exc)
            return False
        for table, keys in unsaved.items():
            self.unsaved[table] -= keys
        self.store_ok()
        return True

    def refused(self, exc: StoreUnavailable) -> None:
        """A write the store refused: counted (metric), one ALARM event per spell, retried later."""
        self.store_failures += 1
        self.store_retry_at = self.mono() + backoff_delay(self.store_failures, 1.0, 30.0)
        if worth_reporting(self.store_failures):
            logger.warning("store write refused (%d in a row): %s", self.store_failures, exc)
        if self.store_failures == 1:
            self.event(
                C.EVENT_TYPE_ALARM,
                f"the controller's store is failing: {exc}; changes that happened are kept "
                "in memory and written again with backoff, API changes are refused (UNAVAILABLE)",
            )

    def store_ok(self) -> None:
        if self.store_failures:
            self.event(
                C.EVENT_TYPE_ALARM,
                f"the controller's store accepts writes again after {self.store_failures} "
                "refused write(s); what happened meanwhile is saved",
            )
            self.store_failures = 0

    def _write(self, unsaved: dict[str, set[str]]) -> None:
        tables = {
            "instances": (self.instances.get, self.store.save_instance, self.store.delete_instance),
            "slots": (self.slots.get, self.store.save_assignment, self.store.delete_assignment),
        }
        for table, (find, save, delete) in tables.items():
            for key in sorted(unsaved[table]):
                if (key if table == "instances" else key.rpartition("/rank")[0]) in self.leaving:
                    continue  # the deployment change wrote (or deleted) this row; memory catches up
                row = find(key)
                if row is None:
                    delete(key)  # gone from memory: gone from the store
                else:
                    save(key, row.to_dict())
        for node_id in sorted(unsaved["nodes"]):
            node = self.nodes.get(node_id)
            if node is not None:
                self.store.save_node(
                    StoredNode(node.node_id, node.info.SerializeToString(), node.generation, node.state, node.reason)
                )

    def transition(self, inst: InstanceRecord, new_state: int, reason: str) -> None:
        """Instance state change: the state machine, then persistence and an event."""
        old = inst.state
        if transition(inst, new_state, reason, self.wall()):
            self.save_instance(inst)
            self.event(
                C.EVENT_TYPE_INSTANCE_STATE_CHANGED,
                f"instance {inst.instance_id} {state_name(old)} -> {state_name(new_state)}: {reason}",
                instance_id=inst.instance_id,
                deployment=self.deployment_of(inst),
            )
            self.listener.instance_state_changed(inst, old)

    def slots_of(self, instance_id: str) -> list[EngineSlot]:
        inst = self.instances.get(instance_id)
        return self.slots.of_instance(instance_id, inst.data_parallel_size if inst else None)

    def unplace(self, slot: EngineSlot, moved: bool = True) -> None:
        self.slots.unplace(slot, moved)
        self.attention.add(slot.instance_id)
        self.engines_changed([slot.engine_id])

    def evaluate_node(self, node_id: str) -> None:
        """Re-derive the state of every instance with a rank on the node (its state changed)."""
        for s in self.slots.on_node(node_id):
            inst = self.instances.get(s.instance_id)
            if inst is not None:
                self.evaluate(inst)

    def evaluate(self, inst: InstanceRecord) -> None:
        """Derive STARTING / READY / DEGRADED from what the nodes report."""
        if inst.state in (FAILED, RESTARTING, PENDING):
            return
        slots = self.slots_of(inst.instance_id)
        if any(not s.node_id for s in slots):
            return
        waiting: list[str] = []
        unreported = False
        for s in slots:
            node = self.nodes.get(s.node_id)
            if node is None or node.state != NODE_READY:
                state = enum_short_name(C.NodeState, node.state) if node else "unknown"
                waiting.append(f"{s.engine_id} on {s.node_id}: node {state}")
            elif s.state == T.ENGINE_STATE_UNSPECIFIED and inst.state in (READY, DEGRADED):
                # Not reported to this controller yet (it restarted, or took over as leader): its
                # stored state stands until the rank's node reports it.
                unreported = True
            elif s.state != T.ENGINE_STATE_RUNNING or s.health != T.HEALTH_STATUS_NORMAL:
                what = f"{enum_short_name(T.EngineState, s.state)}/{enum_short_name(T.HealthStatus, s.health)}"
                waiting.append(
                    f"{s.engine_id} on {s.node_id}: {what}" + (f" ({s.health_reason})" if s.health_reason else "")
                )
        if not waiting:
            if not unreported:
                self.transition(inst, READY, f"all {len(slots)} rank(s) NORMAL")
            return
        detail = waiting[0] + (f" (+{len(waiting) - 1} more)" if len(waiting) > 1 else "")
        if inst.state == STARTING:
            # A new reason for the same state is kept in memory only (no event, no write).
            inst.reason = f"waiting for {detail}"
        else:
            self.transition(inst, DEGRADED, detail)
