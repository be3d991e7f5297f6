"""The placement view of the fleet, kept between reconcile passes.

The READY nodes' free accelerators and ports (a `placement.Fleet`), updated from what changed
since it was last read: the slot table and the node table note the nodes whose slots or state
changed (`room_changed`), and `fleet()` re-reads only those. A pass costs O(changed nodes), not
a rebuild of 80,000 engines' worth of room; what placement takes from the Fleet is taken from it
directly, and re-read (the same) from the tables on the next call.
"""

from __future__ import annotations

from controller.model import reported
from controller.model.cluster import ClusterState
from controller.model.nodes import NODE_READY, NodeRuntime
from controller.rules.placement import Fleet, NodeCapacity, ports_per_engine
from motor.v1 import types_pb2 as T

# States in which a copy still holds its accelerators and ports on its node.
HOLDING_ENGINE_STATES = {T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING, T.ENGINE_STATE_STOPPING}


def held_by_other_copies(state: ClusterState, node: NodeRuntime) -> list[T.Engine]:
    """The copies a node still reports holding accelerators and ports that no slot placed there
    accounts for (an old deployment's engines draining and stopping, a fenced copy): placement
    does not offer what they hold until the node stops reporting them."""
    held = []
    for engine_id, state_, generation, *_ in node.engines.values():
        slot = state.slots.get(engine_id)
        if state_ in HOLDING_ENGINE_STATES and (
            slot is None or slot.node_id != node.node_id or slot.generation != generation
        ):
            held.append(reported.message(node.engines[engine_id]))
    return held


class FleetView:
    def __init__(self, state: ClusterState, kv_events: bool = False):
        self.state = state
        self.kv_events = kv_events  # every engine started gets a KV-events port (--kv-events)
        self._fleet = Fleet([])
        state.nodes.room_changed.update(state.nodes)  # the first read covers every node
        # Nodes whose room counted copies no slot accounts for -> when the node was last heard
        # from at that read: read again after its next report, which says whether they are gone.
        self._holding: dict[str, float] = {}

    def fleet(self) -> Fleet:
        st = self.state
        changed = st.nodes.room_changed | st.slots.room_changed
        changed.update(
            n for n, seen in self._holding.items() if st.nodes.get(n) is None or st.nodes.get(n).last_seen != seen
        )
        st.nodes.room_changed.clear()
        st.slots.room_changed.clear()
        for node_id in changed:
            node = st.nodes.get(node_id)
            if (
                node is None or node.state != NODE_READY or node.unusable
            ):  # unusable: set aside (EngineLifecycle.set_aside)
                self._fleet.drop(node_id)
                self._holding.pop(node_id, None)
            else:
                self._fleet.put(self._capacity(node))
        return self._fleet

    def _capacity(self, n: NodeRuntime) -> NodeCapacity:
        st = self.state
        cap = NodeCapacity(
            n.node_id,
            n.info.host or n.info.address.rpartition(":")[0],
            tuple(n.info.accelerator_ids),
            port_range=(n.info.port_range_start, n.info.port_range_end),
        )
        for s in st.slots.placed_on(n.node_id):
            cap.used_accelerators.update(s.accelerator_ids)
            inst = st.instances.get(s.instance_id)
            cap.ports_in_use += ports_per_engine(bool(inst and inst.single_container), self.kv_events)
        held = held_by_other_copies(st, n)
        for copy in held:
            cap.used_accelerators.update(copy.spec.accelerator_ids)
            cap.ports_in_use += ports_per_engine(copy.spec.single_container, copy.spec.kv_events)
        if held:
            self._holding[n.node_id] = n.last_seen
        else:
            self._holding.pop(n.node_id, None)
        return cap
