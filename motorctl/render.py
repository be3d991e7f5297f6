"""Tables for people: nodes, instances and engine health (also the live view of `motorctl up`)."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterable, Sequence

from motor.contract.names import enum_short_name, role_name
from motor.v1 import controller_pb2, types_pb2


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _short(text: str, limit: int = 70) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ago(stamp) -> str:
    if not stamp.seconds and not stamp.nanos:
        return "-"
    seconds = (datetime.datetime.now(datetime.UTC) - stamp.ToDatetime(datetime.UTC)).total_seconds()
    return f"{max(seconds, 0):.1f}s ago"


def standby_banner(reply) -> str:
    """A first line saying that a standby answered (its view lacks liveness, engine state and health)."""
    return f"STANDBY VIEW: {reply.standby_view}\n\n" if reply.standby_view else ""


def render_nodes(reply: controller_pb2.ListNodesResponse) -> str:
    return standby_banner(reply) + _nodes_table(reply)


def _nodes_table(reply: controller_pb2.ListNodesResponse) -> str:
    rows = [
        (
            n.info.node_id,
            enum_short_name(controller_pb2.NodeState, n.state),
            n.generation,
            n.info.address,
            f"{len(n.free_accelerator_ids)}/{len(n.info.accelerator_ids)}",
            sum(1 for e in n.engines if e.state in (types_pb2.ENGINE_STATE_STARTING, types_pb2.ENGINE_STATE_RUNNING)),
            _ago(n.last_heartbeat),
            _short(n.state_reason, 60),
        )
        for n in reply.nodes
    ]
    out = table(["NODE", "STATE", "GEN", "ADDRESS", "FREE ACC", "ENGINES", "HEARTBEAT", "REASON"], rows)
    for alarm in reply.alarms:
        out += f"\nALARM: {alarm}"
    return out


def render_instances(reply: controller_pb2.ListInstancesResponse) -> str:
    rows = [
        (
            i.instance_id,
            role_name(i.role),
            enum_short_name(controller_pb2.InstanceState, i.state) + (" (spare)" if i.spare else ""),
            i.restarts,
            i.revision,
            i.paired_instance_id or "-",
            _short(i.state_reason),
        )
        for i in reply.instances
    ]
    return table(["INSTANCE", "ROLE", "STATE", "RESTARTS", "REVISION", "PAIRED", "REASON"], rows)


def render_engines(reply: controller_pb2.ListInstancesResponse) -> str:
    rows = []
    for inst in reply.instances:
        for e in inst.engines:
            rows.append(
                (
                    e.engine_id,
                    e.node_id or "-",
                    f"{e.host}:{e.port}" if e.port else "-",
                    e.mgmt_port or "-",
                    e.pid or "-",
                    enum_short_name(types_pb2.EngineState, e.state),
                    enum_short_name(types_pb2.HealthStatus, e.health),
                    e.restarts,
                    e.generation,
                    _short(e.last_failure_reason, 50) or "-",
                )
            )
    header = ["ENGINE", "NODE", "ENDPOINT", "MGMT", "PID", "STATE", "HEALTH", "RESTARTS", "GEN", "LAST FAILURE"]
    return table(header, rows)


def render_endpoints(reply: controller_pb2.ListEndpointsResponse) -> str:
    return standby_banner(reply) + table(
        ["ENGINE", "ROLE", "URL"], [(e.engine_id, role_name(e.role), e.url) for e in reply.endpoints]
    )


def render_event(event: controller_pb2.Event) -> str:
    when = event.time.ToDatetime(datetime.UTC).astimezone().strftime("%H:%M:%S.%f")[:-3]
    times = f" (x{event.count})" if event.count > 1 else ""  # a failure that repeats: one event, counted
    kind = enum_short_name(controller_pb2.EventType, event.type)
    return f"{when}  #{event.sequence:<5} {kind:<22} {event.message}{times}"


def render_status(nodes: controller_pb2.ListNodesResponse, instances: controller_pb2.ListInstancesResponse) -> str:
    """Nodes, instances and engine health: the whole cluster on one screen."""
    return standby_banner(nodes) + "\n\n".join(
        [
            "NODES\n" + _nodes_table(nodes),
            "INSTANCES\n" + render_instances(instances),
            "ENGINES\n" + render_engines(instances),
        ]
    )


def quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader is gone (`motorctl ... | head`): later prints and
    the interpreter's last flush raise no BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def render_controllers(reply: controller_pb2.ListControllersResponse) -> str:
    """`motorctl controllers`: who leads, who stands by, the epoch and the lease."""
    rows = [
        (c.address, "leader" if c.leader else "standby", c.name if c.name != c.address else "")
        for c in reply.controllers
    ]
    head = (
        f"store: {reply.store}\nleader: {reply.leader_address or '(election in progress)'}  epoch: {reply.epoch}  "
        f"lease: {reply.lease_ttl.ToTimedelta().total_seconds():g}s"
    )
    return head + "\n\n" + table(["ADDRESS", "ROLE", "NAME"], rows)


def render_deployments(reply: controller_pb2.ListDeploymentsResponse) -> str:
    """`motorctl deployments`: each deployment, its model, revision, serving instance counts, warm spares and
    rollout."""
    rows = [
        (
            d.deployment.name,
            d.deployment.model,
            d.revision,
            d.instances,
            d.ready_instances,
            d.pending_instances,
            f"{d.ready_spare_instances}/{d.spare_instances} ready" if d.spare_instances else "-",
            rollout_state_name(d.rollout_state),
        )
        for d in reply.deployments
    ]
    out = table(["NAME", "MODEL", "REVISION", "INSTANCES", "READY", "PENDING", "SPARES", "ROLLOUT"], rows)
    scaled = [(d.deployment.name, s.group, s.desired, s.current, s.reason) for d in reply.deployments for s in d.scale]
    if scaled:  # only where a group autoscales: the table above stays as scripts read it
        out += "\n\n" + table(["DEPLOYMENT", "AUTOSCALED GROUP", "DESIRED", "CURRENT", "WHY"], scaled)
    return out


def rollout_state_name(state: int) -> str:
    return enum_short_name(controller_pb2.RolloutState, state) if state else "-"


def render_rollout(d: controller_pb2.DeploymentSummary) -> str:
    """`motorctl rollout status`: where a deployment's rollout stands, counted as `kubectl rollout
    status` does: of the desired instances, how many run the new revision and are available, and
    how many old ones are left to replace."""
    desired = sum(g.count for g in d.deployment.instance_groups)  # warm spares apart
    name, state = d.deployment.name, rollout_state_name(d.rollout_state)
    lines = [f"deployment {name!r} revision {d.revision}: rollout {state}"]
    if d.rollout_state == controller_pb2.ROLLOUT_STATE_COMPLETE:
        lines.append(
            f"  successfully rolled out: {d.updated_available_instances} of {desired} updated instances available"
        )
    else:
        lines.append(
            f"  {d.updated_available_instances} of {desired} updated instances available "
            f"({d.updated_instances} updated), {d.old_instances} old instance(s) remaining"
        )
    if d.rollout_reason:
        lines.append(f"  {d.rollout_reason}")
    return "\n".join(lines)
