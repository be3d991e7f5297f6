"""What the controller shows: nodes, instances and endpoints rendered as protobuf messages
(ListNodes, ListInstances, WatchEvents' snapshot; endpoints: endpoints.py). Reads the state, changes nothing.
"""

from __future__ import annotations

import collections

from controller.fleet.conflicts import Conflict
from controller.model import events, reported
from controller.model.cluster import ClusterState
from controller.model.instances import PENDING, READY, RESTARTING, InstanceRecord
from controller.model.nodes import NodeRuntime
from controller.model.slots import EngineSlot
from controller.reads import paging
from controller.reads.paging import Field
from controller.routing import endpoints
from motor.contract import names, node_process
from motor.contract.names import enum_short_name
from motor.contract.pbtime import timestamp as _stamp
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2, types_pb2

C, T = controller_pb2, types_pb2

# The filter fields of ListNodes, ListInstances and ListEndpoints (controller/reads/paging.py).
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
    "deployment": Field(lambda e: e.deployment),
}


def node_proto(state: ClusterState, node: NodeRuntime) -> C.Node:
    used = state.slots.used_accelerators(node.node_id)
    proto = C.Node(
        info=node.info,
        state=node.state,
        state_reason=node.reason,
        generation=node.generation,
        free_accelerator_ids=[a for a in node.info.accelerator_ids if a not in used],
        engines=[reported.message(node.engines[k]) for k in sorted(node.engines)],
    )
    if node.last_heartbeat_wall:
        proto.last_heartbeat.CopyFrom(_stamp(node.last_heartbeat_wall))
    return proto


def instance_proto(state: ClusterState, inst: InstanceRecord) -> C.Instance:
    slots = state.slots_of(inst.instance_id)
    rank0 = next((s for s in slots if s.dp_rank == 0), None)
    proto = C.Instance(
        instance_id=inst.instance_id,
        group=inst.group,
        role=inst.role,
        state=inst.state,
        state_reason=inst.reason,
        master_dp_ip=rank0.host if rank0 else "",
        paired_instance_id=inst.paired_instance_id,
        restarts=inst.restarts,
        deployment=state.deployment_of(inst),
        revision=inst.revision,
        spare=inst.spare,
        engines=[
            C.InstanceEngine(
                engine_id=s.engine_id,
                dp_rank=s.dp_rank,
                node_id=s.node_id,
                host=s.host,
                port=s.port,
                mgmt_port=s.mgmt_port,
                accelerator_ids=s.accelerator_ids,
                state=s.state,
                health=s.health,
                restarts=s.restarts,
                last_failure_reason=s.last_failure_reason,
                generation=s.generation,
                pid=reported_pid(state, s),
            )
            for s in slots
        ],
    )
    if inst.state == RESTARTING and inst.next_restart_at:
        proto.next_restart_time.CopyFrom(_stamp(inst.next_restart_at))
    return proto


def reported_pid(state: ClusterState, slot: EngineSlot) -> int:
    """The pid the slot's node last reported for this generation's copy of the engine (0: none):
    what `kill` needs, without searching the host for a command line."""
    node = state.nodes.get(slot.node_id) if slot.node_id else None
    kept = node.engines.get(slot.engine_id) if node is not None else None
    if kept is None or kept[reported.GENERATION] != slot.generation:
        return 0
    return reported.message(kept).pid


def conflict_alarms(conflicts: list[Conflict]) -> list[str]:
    """One ListNodes alarm per node id conflict under way, with its count."""
    return [
        f"node id {c.node_id} claimed by two live node managers: {c.refused} registration(s) from "
        f"{c.newcomer_address} ({node_process.describe(c.newcomer)}) refused since {node_process.utc(c.since_wall)}"
        for c in conflicts
    ]


class ClusterReads:
    """The read side of the controller (ListNodes, ListInstances, ListEndpoints, the snapshot):
    a base class of `Controller`, which provides `state`, `monitor`, `claims` and `events`.
    Reads only: nothing here changes the state."""

    state: ClusterState

    # The tables, read by the servicer's views and by tests.
    @property
    def nodes(self):
        return self.state.nodes

    @property
    def slots(self):
        return self.state.slots

    @property
    def instances(self) -> dict[str, InstanceRecord]:
        return self.state.instances

    @property
    def alarm(self) -> str:
        return self.monitor.alarm

    def page_nodes(self, request: C.ListNodesRequest) -> C.ListNodesResponse:
        page, token = paging.page(request, self.nodes, NODE_FIELDS)
        return C.ListNodesResponse(
            nodes=[node_proto(self.state, n) for n in page],
            next_page_token=token,
            alarms=([self.alarm] if self.alarm else []) + conflict_alarms(self.claims.conflicts.open()),
        )

    def page_instances(self, request: C.ListInstancesRequest) -> C.ListInstancesResponse:
        fields = {**INSTANCE_FIELDS, "deployment": Field(self.state.deployment_of)}  # known by the instance's group
        page, token = paging.page(request, self.instances, fields)
        return C.ListInstancesResponse(instances=[instance_proto(self.state, i) for i in page], next_page_token=token)

    def list_deployments(self) -> C.ListDeploymentsResponse:
        """Every deployment (by name) with its revision, how many of its serving instances are
        READY or PENDING, its warm spares (READY ones apart) and its rollout."""
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for inst in self.instances.values():
            counts[self.state.deployment_of(inst)][(inst.spare, inst.state)] += 1
        summaries = []
        for name, (deployment, revision) in sorted(self.deployments.by_name.items()):
            mine = counts[name]
            rollout, (rollout_state, rollout_reason) = self.rollouts.counts(name), self.rollouts.status(name)
            summaries.append(
                C.DeploymentSummary(
                    deployment=deployment,
                    revision=revision,
                    instances=sum(n for (spare, _), n in mine.items() if not spare),
                    ready_instances=mine[False, READY],
                    pending_instances=mine[False, PENDING],
                    rollout_state=rollout_state,
                    rollout_reason=rollout_reason,
                    updated_instances=rollout.updated,
                    available_instances=rollout.available,
                    updated_available_instances=rollout.updated_available,
                    old_instances=rollout.old,
                    spare_instances=sum(n for (spare, _), n in mine.items() if spare),
                    ready_spare_instances=mine[True, READY],
                    scale=self.autoscaler.status(name, deployment),
                )
            )
        return C.ListDeploymentsResponse(deployments=summaries)

    def page_endpoints(self, request: C.ListEndpointsRequest) -> C.ListEndpointsResponse:
        found = {e.engine_id: e for e in self.list_endpoints(request.role, request.model)}
        page, token = paging.page(request, found, ENDPOINT_FIELDS)
        return C.ListEndpointsResponse(endpoints=page, next_page_token=token)

    def list_nodes(self) -> tuple[list[C.Node], list[str]]:
        reply = self.page_nodes(C.ListNodesRequest())
        return list(reply.nodes), list(reply.alarms)

    def list_instances(self) -> list[C.Instance]:
        return list(self.page_instances(C.ListInstancesRequest()).instances)

    def list_endpoints(self, role: int = T.ROLE_UNSPECIFIED, model: str = "") -> list[C.Endpoint]:
        if role != T.ROLE_UNSPECIFIED and role not in names.ROLE_NAMES:
            raise InvalidArgument(
                f"role {role} is not a role: use ROLE_PREFILL, ROLE_DECODE, ROLE_UNION or leave it unset for all"
            )
        return endpoints.endpoints(self.state, role, model)

    def snapshot(self, deployment: str = "") -> C.ClusterSnapshot:
        """Every node; the instances and recent events of `deployment` ("": of all)."""
        if deployment:
            names.check_id(deployment, "deployment")
        nodes, _ = self.list_nodes()
        instances = self.page_instances(C.ListInstancesRequest(filter=f"deployment={deployment}" if deployment else ""))
        return C.ClusterSnapshot(
            nodes=nodes,
            instances=instances.instances,
            recent_events=[e for e in self.events.recent if events.concerns(e, deployment)],
        )
