"""Heartbeats far faster than a node was told are pushed back (docs/controller-decisions.md, "Heartbeat
rate budget").

The budget sets the interval each node is told so that the whole fleet stays within
--max-heartbeats-per-second; it relies on node managers keeping to it. One that does not (a bug,
a hostile or confused client) would spend the controller's CPU for the whole fleet. Each node
gets a token bucket: BURST beats back to back (a retry after a lost answer, a reconnect, a
failover), then SLACK times the rate it was told, sustained. Beyond, a beat is refused with
RESOURCE_EXHAUSTED before anything is read (the node manager backs off, as after any refused
beat), counted in motor_controller_heartbeats_refused_total{node_id} and logged once per node.
A node told nothing yet (known from the store, or registered outside the gRPC service) is not held.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from controller.model.nodes import NodeTable
from motor.clock import Clock
from motor.contract.names import excerpt
from motor.errors import ResourceExhausted

logger = logging.getLogger(__name__)

BURST = 5.0  # beats a node may send back to back
SLACK = 4.0  # sustained: this many times the rate it was told


class BeatPacing:
    def __init__(self, nodes: NodeTable, clock: Clock, refused: Counter):
        self.nodes, self.mono, self.refused = nodes, clock.monotonic, refused

    def admit(self, node_id: str) -> None:
        """Raise ResourceExhausted when `node_id` beats far faster than its told interval: O(1)."""
        node = self.nodes.get(node_id)
        if node is None or node.told_interval <= 0:
            return  # unknown: Heartbeat says so; told nothing yet: nothing to hold it to
        now, told = self.mono(), node.told_interval
        refill = (now - node.beats_checked) * SLACK / told if node.beats_checked else BURST
        node.beat_tokens, node.beats_checked = min(BURST, node.beat_tokens + refill), now
        if node.beat_tokens >= 1:
            node.beat_tokens -= 1
            return
        self.refused.labels(node_id=node_id).inc()
        wait = (1 - node.beat_tokens) * told / SLACK
        if not node.pace_logged:
            node.pace_logged = True
            logger.warning(
                "node %s heartbeats far faster than the %gs interval it was told (over %g beats back to "
                "back or %g times that rate): refusing the excess with RESOURCE_EXHAUSTED "
                "(motor_controller_heartbeats_refused_total)",
                excerpt(node_id),
                told,
                BURST,
                SLACK,
            )
        raise ResourceExhausted(
            f"node_id: node {excerpt(node_id)} heartbeats far faster than the {told:g}s interval "
            f"it was told: this heartbeat was not read; retry after {wait:.2f}s, then beat every "
            f"{told:g}s"
        )
