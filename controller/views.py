"""What the controller shows: nodes, instances and endpoints rendered as protobuf messages
(ListNodes, ListInstances, WatchEvents' snapshot; endpoints: endpoints.py). Reads the state, changes nothing.
"""

from __future__ import annotations

from motor import node_process
from motor.pbtime import timestamp as _stamp
from motor.v1 import controller_pb2, types_pb2

from controller.claims import Conflict
from controller.instances import RESTARTING, InstanceRecord
from controller.nodes import NodeRuntime
from controller.state import ClusterState

C, T = controller_pb2, types_pb2


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
