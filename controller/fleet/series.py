"""What only the controller knows about the fleet, in aggregates, and the engine list Prometheus
discovers its engine targets from (http_sd_configs).

Per-engine series live where the engine runs: each node manager exports its own engines' health
and restarts (node_manager/metrics.py), as the kubelet does for its pods. The controller keeps:
- instances per deployment, group, role, spare and state, and how long the oldest instance of a
  group has been in each state other than READY (the alert MotorInstanceNotReady);
- per node, only the nodes that are not READY (SUSPECT or LOST: the alert MotorNodeLost names
  the node), so a healthy fleet adds no line per node;
- the oldest heartbeat age among the live nodes, and the silent-nodes alarm.
An instance's own state, revision and restarts are in `motorctl instances` and its events
(WatchEvents, the controller's log): docs/observability.md says why.

At 10,000 nodes x 8 engines a scrape of these is a few kilobytes and a few milliseconds
(bench/fleet_scrape.py); the rendering reads the tables once and yields nothing until done.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable

from controller.model.cluster import ClusterState
from controller.model.nodes import NODE_READY
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.names import enum_short_name, role_name
from motor.v1 import controller_pb2


def _states(enum_type) -> list[tuple[int, str]]:
    return [(v, enum_short_name(enum_type, v).lower()) for v in enum_type.values() if v]


NODE_STATES = dict(_states(controller_pb2.NodeState))
INSTANCE_STATES = _states(controller_pb2.InstanceState)
READY = controller_pb2.INSTANCE_STATE_READY

# name, type, help: the exposition header of each family, in the order they are written.
NODE_UNREADY = (
    "motor_controller_node_unready",
    "gauge",
    "1 for each node that is not READY, by state (lost: its engines are being moved, alert MotorNodeLost; "
    "suspect: silent and being re-checked). READY nodes have no line; motor_controller_nodes counts all.",
)
HEARTBEAT_AGE_MAX = (
    "motor_controller_node_heartbeat_age_max_seconds",
    "gauge",
    "Seconds since the oldest heartbeat among the nodes not lost. Above the node grace "
    "(motor_controller_node_grace_seconds) a node is suspect; a rise on many nodes at once "
    '(motor_controller_nodes{state="SUSPECT"}) points at the controller\'s network.',
)
SILENT_ALARM = (
    "motor_controller_silent_nodes_alarm",
    "gauge",
    "1 while more than silent_share_alarm of the nodes are silent at once: the controller suspects its "
    "own network and declares none of them lost (nothing is rescheduled). Check the controller's network.",
)
GROUP_INSTANCES = (
    "motor_controller_group_instances",
    "gauge",
    'Instances of each deployment\'s group by state; warm spares are counted apart (spare="true"). '
    "`motorctl instances` names them and gives each one's reason.",
)
NOT_READY_SECONDS = (
    "motor_controller_group_not_ready_seconds",
    "gauge",
    "For each group and state other than ready: how long its oldest instance in that state has been in it. "
    "Above 600 for long: alert MotorInstanceNotReady; `motorctl instances` gives the reason.",
)


def header(family: tuple[str, str, str]) -> str:
    name, kind, help_text = family
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def labels(**pairs: str) -> str:
    return ",".join(f'{k}="{label_value(v)}"' for k, v in pairs.items())


class FleetSeries:
    """Renders the fleet aggregates from `state`'s tables; `alarm()` is the silent-nodes alarm's
    message ("" when off); `clock.time()` is read for ages."""

    def __init__(self, state: ClusterState, alarm: Callable[[], str], clock: Clock = SYSTEM_CLOCK):
        self.state, self.alarm, self.clock = state, alarm, clock

    async def render(self) -> AsyncIterator[bytes]:
        yield self.text().encode()

    def text(self) -> str:
        now = self.clock.time()
        return self._nodes(now) + self._instances(now)

    def _nodes(self, now: float) -> str:
        lines = [header(NODE_UNREADY)]
        oldest = now
        for n in self.state.nodes.values():
            if n.state != NODE_READY:
                lines.append(f"{NODE_UNREADY[0]}{{{labels(node_id=n.node_id, state=NODE_STATES[n.state])}}} 1\n")
                if NODE_STATES[n.state] == "lost":
                    continue
            # (a node restored from the store has not heartbeated yet: no age)
            if n.last_heartbeat_wall and n.last_heartbeat_wall < oldest:
                oldest = n.last_heartbeat_wall
        lines.append(header(HEARTBEAT_AGE_MAX) + f"{HEARTBEAT_AGE_MAX[0]} {max(0.0, now - oldest):.3f}\n")
        lines.append(header(SILENT_ALARM) + f"{SILENT_ALARM[0]} {1 if self.alarm() else 0}\n")
        return "".join(lines)

    def _instances(self, now: float) -> str:
        st = self.state
        counts: collections.Counter = collections.Counter()
        since: dict[tuple, float] = {}  # (group key, state) -> the oldest change into it
        groups: dict[tuple[str, bool], str] = {}  # (group, spare) -> its label text
        for i in st.instances.values():
            key = groups.get((i.group, i.spare))
            if key is None:
                spare = "true" if i.spare else "false"
                key = labels(deployment=st.deployment_of(i), group=i.group, role=role_name(i.role), spare=spare)
                groups[(i.group, i.spare)] = key
            counts[key, i.state] += 1
            if i.state != READY and i.state_changed_at:
                at = since.get((key, i.state))
                if at is None or i.state_changed_at < at:
                    since[key, i.state] = i.state_changed_at
        lines = [header(GROUP_INSTANCES)]
        for key in sorted(groups.values()):
            for value, name in INSTANCE_STATES:
                lines.append(f'{GROUP_INSTANCES[0]}{{{key},state="{name}"}} {counts.get((key, value), 0)}\n')
        lines.append(header(NOT_READY_SECONDS))
        names = dict(INSTANCE_STATES)
        for (key, value), at in sorted(since.items()):
            lines.append(f'{NOT_READY_SECONDS[0]}{{{key},state="{names[value]}"}} {max(0.0, now - at):.3f}\n')
        return "".join(lines)


def engine_targets(state: ClusterState) -> list[dict]:
    """Prometheus HTTP service discovery: every placed engine's inference address (its /metrics), with
    its ids, its deployment and the deployment's model as labels (every series scraped from it carries
    them: request-level panels and alerts group by deployment). Served on the controller's metrics
    port at /discovery/engines."""
    targets = []
    instances = state.instances
    for slot in state.slots.values():
        inst = instances.get(slot.instance_id)
        if inst is None or not (slot.host and slot.port):
            continue
        deployment = state.deployment_of(inst)
        labels_ = {
            "instance_id": slot.instance_id,
            "engine_id": slot.engine_id,
            "node_id": slot.node_id,
            "role": role_name(inst.role),
            "deployment": deployment,
            "model": next(iter(state.deployments.served_models(deployment)), ""),
        }
        targets.append({"targets": [f"{slot.host}:{slot.port}"], "labels": labels_})
    return targets
