"""A node manager whose engine records cannot be written (a full disk: issue 12, defect 2) says
why in every heartbeat (`HeartbeatRequest.store_failing`). The operator sees one ALARM event
per spell whose count grows with each heartbeat that says so (EventBus.repeat: not one event
per beat), and one event when it ends; the node manager's own metric
(motor_node_manager_store_write_failures_total) counts the refused writes."""

from __future__ import annotations

from motor.v1 import controller_pb2

from controller.events import EventBus

# The longest part of a node's reason quoted in the event.
REASON_CHARS = 300


class NodeStoreAlarms:
    def __init__(self, events: EventBus):
        self.events = events
        self.failing: set[str] = set()  # nodes in a spell

    def report(self, node_id: str, store_failing: str) -> None:
        """What one heartbeat of `node_id` said (its text already checked printable)."""
        if not store_failing and node_id not in self.failing:
            return  # every beat of a healthy node: nothing to do
        key = ("node store", node_id)
        if store_failing:
            self.failing.add(node_id)
            self.events.repeat(
                key, controller_pb2.EVENT_TYPE_ALARM,
                f"node {node_id}: {store_failing[:REASON_CHARS]}; its engines' exits are kept in memory and reported, "
                "StartEngine there is refused (UNAVAILABLE) until the disk takes writes again: free space on it",
                node_id=node_id,
            )
            return
        self.failing.discard(node_id)
        beats = self.events.settle(key)
        self.events.emit(controller_pb2.EVENT_TYPE_ALARM,
                         f"node {node_id}: engine records are written again (the failure lasted {beats} heartbeat(s))",
                         node_id=node_id)
