"""The placement view of the fleet, kept between reconcile passes.

The READY nodes' free accelerators and ports (a `placement.Fleet`), updated from what changed
since it was last read: the slot table and the node table note the nodes whose slots or state
changed (`room_changed`), and `fleet()` re-reads only those. A pass costs O(changed nodes), not
a rebuild of 80,000 engines' worth of room; what placement takes from the Fleet is taken from it
directly, and re-read (the same) from the tables on the next call.
"""

from __future__ import annotations

from controller.nodes import NODE_READY, NodeRuntime
from controller.placement import Fleet, NodeCapacity, ports_per_engine
from controller.state import ClusterState


class FleetView:
    def __init__(self, state: ClusterState):
        self.state = state
        self._fleet = Fleet([])
        state.nodes.room_changed.update(state.nodes)  # the first read covers every node

    def fleet(self) -> Fleet:
        st = self.state
        changed = st.nodes.room_changed | st.slots.room_changed
        st.nodes.room_changed.clear()
        st.slots.room_changed.clear()
        for node_id in changed:
            node = st.nodes.get(node_id)
            if node is None or node.state != NODE_READY or node.unusable:  # unusable: set aside (Scheduler.set_aside)
                self._fleet.drop(node_id)
            else:
                self._fleet.put(self._capacity(node))
        return self._fleet

    def _capacity(self, n: NodeRuntime) -> NodeCapacity:
        st = self.state
        cap = NodeCapacity(n.node_id, n.info.host or n.info.address.rpartition(":")[0], list(n.info.accelerator_ids),
                           port_range=(n.info.port_range_start, n.info.port_range_end))
        for s in st.slots.placed_on(n.node_id):
            cap.used_accelerators.update(s.accelerator_ids)
            inst = st.instances.get(s.instance_id)
            cap.ports_in_use += ports_per_engine(bool(inst and inst.single_container))
        return cap
