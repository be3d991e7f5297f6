"""A node manager whose engine records cannot be written (a full disk) says
why in every heartbeat (`HeartbeatRequest.store_failing`). The operator sees one ALARM event
per spell whose count grows with each heartbeat that says so (EventBus.repeat: not one event
per beat), and one event when it ends: after SETTLE_BEATS heartbeats in a row that say nothing,
so a disk at the brink (full, freed, full again at every beat) stays one event with a count
instead of two events per flap pushing everything else out of the history. The node manager's
own metric (motor_node_manager_store_write_failures_total) counts the refused writes."""

from __future__ import annotations

from controller.model.events import EventBus
from motor.v1 import controller_pb2

# The longest part of a node's reason quoted in the event.
REASON_CHARS = 300
# Heartbeats in a row without store_failing that end a spell.
SETTLE_BEATS = 5


class NodeStoreAlarms:
    def __init__(self, events: EventBus):
        self.events = events
        self.failing: dict[str, int] = {}  # nodes in a spell -> heartbeats in a row since that said nothing

    def report(self, node_id: str, store_failing: str) -> None:
        """What one heartbeat of `node_id` said (its text already checked printable)."""
        quiet = self.failing.get(node_id)
        if not store_failing and quiet is None:
            return  # every beat of a healthy node: nothing to do
        key = ("node store", node_id)
        if store_failing:
            self.failing[node_id] = 0
            self.events.repeat(
                key,
                controller_pb2.EVENT_TYPE_ALARM,
                f"node {node_id}: {store_failing[:REASON_CHARS]}; its engines' exits are kept in memory and reported, "
                "StartEngine there is refused (UNAVAILABLE) until the disk takes writes again: free space on it",
                node_id=node_id,
            )
            return
        if quiet + 1 < SETTLE_BEATS:
            self.failing[node_id] = quiet + 1
            return
        del self.failing[node_id]
        beats = self.events.settle(key)
        self.events.emit(
            controller_pb2.EVENT_TYPE_ALARM,
            f"node {node_id}: engine records are written again ({SETTLE_BEATS} heartbeats in a row said "
            f"nothing; the failure was said in {beats} heartbeat(s))",
            node_id=node_id,
        )
