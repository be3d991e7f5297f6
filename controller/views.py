"""What the controller shows: nodes, instances and endpoints rendered as protobuf messages
(ListNodes, ListInstances, WatchEvents' snapshot; endpoints: endpoints.py). Reads the state, changes nothing.
"""

from __future__ import annotations

from motor import node_process
from motor.names import enum_short_name
from motor.pbtime import timestamp as _stamp
from motor.v1 import controller_pb2, types_pb2

from controller.claims import Conflict
from controller.instances import RESTARTING, InstanceRecord
from controller.nodes import NodeRuntime
from controller.paging import Field
from controller.state import ClusterState

C, T = controller_pb2, types_pb2

# The filter fields of ListNodes, ListInstances and ListEndpoints (controller/paging.py).
NODE_FIELDS = {
    "node_id": Field(lambda n: n.node_id),
    "state": Field(lambda n: enum_short_name(C.NodeState, n.state), enum=True),
    "host": Field(lambda n: n.info.host),
}
INSTANCE_FIELDS = {
    "instance_id": Field(lambda i: i.instance_id),
    "group": Field(lambda i: i.group),
    "state": Field(lambda i: enum_short_name(C.InstanceState, i.state), enum=True),
    "role": Field(lambda i: enum_short_name(T.Role, i.role), enum=True),
}
ENDPOINT_FIELDS = {
    "engine_id": Field(lambda e: e.engine_id),
    "instance_id": Field(lambda e: e.instance_id),
    "role": Field(lambda e: enum_short_name(T.Role, e.role), enum=True),
}


def node_proto(state: ClusterState, node: NodeRuntime) -> C.Node:
    used = state.slots.used_accelerators(node.node_id)
    proto = C.Node(
        info=node.info, state=node.state, state_reason=node.reason, generation=node.generation,
        free_accelerator_ids=[a for a in node.info.accelerator_ids if a not in used],
        engines=[node.engines[k] for k in sorted(node.engines)],
    )
    if node.last_heartbeat_wall:
        proto.last_heartbeat.CopyFrom(_stamp(node.last_heartbeat_wall))
    return proto


def instance_proto(state: ClusterState, inst: InstanceRecord) -> C.Instance:
    slots = state.slots_of(inst.instance_id)
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


def conflict_alarms(conflicts: list[Conflict]) -> list[str]:
    """One ListNodes alarm per node id conflict under way, with its count."""
    return [
        f"node id {c.node_id} claimed by two live node managers: {c.refused} registration(s) from "
        f"{c.newcomer_address} ({node_process.describe(c.newcomer)}) refused since {node_process.utc(c.since_wall)}"
        for c in conflicts
    ]
