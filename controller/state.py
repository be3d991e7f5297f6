"""What the controller knows, shared by its parts: the node, slot and instance tables, the
instances that need attention, and the few rules every part follows when it changes them (an
instance changes state through `transition`, stored and announced; slots and nodes are saved).
"""

from __future__ import annotations

from typing import Callable

from motor.names import enum_short_name
from motor.v1 import controller_pb2, types_pb2

from controller.events import EventBus
from controller.instances import DEGRADED, FAILED, PENDING, READY, RESTARTING, STARTING, InstanceRecord, Policy, state_name, transition
from controller.nodes import NODE_READY, NodeRuntime, NodeTable
from controller.slots import EngineSlot, SlotTable
from controller.store import Store, StoredNode

C, T = controller_pb2, types_pb2


class ClusterState:
    def __init__(self, store: Store, events: EventBus, monotonic: Callable[[], float], wall: Callable[[], float]):
        self.store, self.events = store, events
        self.mono, self.wall = monotonic, wall
        self.nodes = NodeTable()
        self.slots = SlotTable()
        self.instances: dict[str, InstanceRecord] = {}
        # Instances with something left to do (place, launch, restart); the rest cost nothing.
        self.attention: set[str] = set()
        # From the deployment: the restart policy and the engine config every StartEngine carries.
        self.policy = Policy()
        self.config_json = "{}"
        # Called after anything that may change which engines can serve (the endpoint feed).
        self.on_change: Callable[[], None] = lambda: None

    def event(self, type_: int, message: str, node_id: str = "", instance_id: str = "", engine_id: str = "") -> None:
        self.events.emit(type_, message, node_id=node_id, instance_id=instance_id, engine_id=engine_id)
        self.on_change()

    def save_instance(self, inst: InstanceRecord) -> None:
        self.store.save_instance(inst.instance_id, inst.to_dict())

    def save_slot(self, slot: EngineSlot) -> None:
        self.store.save_assignment(slot.engine_id, slot.to_dict())

    def save_node(self, node: NodeRuntime) -> None:
        self.store.save_node(StoredNode(node.node_id, node.info.SerializeToString(), node.generation, node.state, node.reason))

    def transition(self, inst: InstanceRecord, new_state: int, reason: str) -> None:
        """Instance state change: the state machine, then persistence and an event."""
        old = inst.state
        if transition(inst, new_state, reason, self.wall()):
            self.save_instance(inst)
            self.event(
                C.EVENT_TYPE_INSTANCE_STATE_CHANGED,
                f"instance {inst.instance_id} {state_name(old)} -> {state_name(new_state)}: {reason}",
                instance_id=inst.instance_id,
            )

    def slots_of(self, instance_id: str) -> list[EngineSlot]:
        inst = self.instances.get(instance_id)
        return self.slots.of_instance(instance_id, inst.data_parallel_size if inst else None)

    def unplace(self, slot: EngineSlot, moved: bool = True) -> None:
        self.slots.unplace(slot, moved)
        self.attention.add(slot.instance_id)
        self.on_change()

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
        for s in slots:
            node = self.nodes.get(s.node_id)
            if node is None or node.state != NODE_READY:
                state = enum_short_name(C.NodeState, node.state) if node else "unknown"
                waiting.append(f"{s.engine_id} on {s.node_id}: node {state}")
            elif s.state != T.ENGINE_STATE_RUNNING or s.health != T.HEALTH_STATUS_NORMAL:
                what = f"{enum_short_name(T.EngineState, s.state)}/{enum_short_name(T.HealthStatus, s.health)}"
                waiting.append(f"{s.engine_id} on {s.node_id}: {what}" + (f" ({s.health_reason})" if s.health_reason else ""))
        if not waiting:
            self.transition(inst, READY, f"all {len(slots)} rank(s) NORMAL")
            return
        detail = waiting[0] + (f" (+{len(waiting) - 1} more)" if len(waiting) > 1 else "")
        if inst.state == STARTING:
            # A new reason for the same state is kept in memory only (no event, no write).
            inst.reason = f"waiting for {detail}"
        else:
            self.transition(inst, DEGRADED, detail)
