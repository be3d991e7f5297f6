"""The controller's per-node, per-instance and per-engine series, and the engine list Prometheus
discovers its engine targets from (http_sd_configs).

State series are one-hot (kube-state-metrics' style): for each node, instance or engine, one
sample per possible state, 1 for the current one, so that `== 1` selects and `for:` works.

At fleet scale these are hundreds of thousands of samples (10,000 nodes x 8 engines: 400,000),
which prometheus_client would rebuild and format on every scrape, on the controller's event
loop, for seconds. So they are rendered here instead, straight from the controller's tables:
each node's, instance's and engine's lines are kept as text and made again only when what
they show changed (a state, a restart), a scrape joins the kept text, and it yields to the
loop every `chunk` rows, so heartbeats are answered while a large fleet is being scraped.
Only the heartbeat ages are new numbers at every scrape. Each row's lines are consistent; a
scrape of a large fleet spans a few loop turns, like any scrape of a changing system.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from controller.state import ClusterState
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.names import enum_short_name, role_name
from motor.v1 import controller_pb2, types_pb2


def _states(enum_type) -> list[tuple[int, str]]:
    return [(v, enum_short_name(enum_type, v).lower()) for v in enum_type.values() if v]


NODE_STATES = _states(controller_pb2.NodeState)
INSTANCE_STATES = _states(controller_pb2.InstanceState)
HEALTH_STATES = _states(types_pb2.HealthStatus)

# name, type, help: the exposition header of each family, in the order they are written.
NODE_STATE = (
    "motor_controller_node_state",
    "gauge",
    "State of each node, 1 for the current one. lost: its engines are being moved (alert MotorNodeLost); "
    "suspect: silent and being re-checked.",
)
HEARTBEAT_AGE = (
    "motor_controller_node_heartbeat_age_seconds",
    "gauge",
    "Seconds since each node's last heartbeat. Above the node grace (motor_controller_node_grace_seconds) the node is "
    "suspect; steadily rising "
    "ages on many nodes at once point at the controller's network.",
)
SILENT_ALARM = (
    "motor_controller_silent_nodes_alarm",
    "gauge",
    "1 while more than silent_share_alarm of the nodes are silent at once: the controller suspects its "
    "own network and declares none of them lost (nothing is rescheduled). Check the controller's network.",
)
INSTANCE_STATE = (
    "motor_controller_instance_state",
    "gauge",
    "State of each instance, 1 for the current one. Not ready for long: `motorctl instances` gives the "
    "reason (alert MotorInstanceNotReady).",
)
ENGINE_HEALTH = (
    "motor_controller_engine_health",
    "gauge",
    "Health of each engine as its node manager last reported it, 1 for the current one. abnormal: its "
    "probes fail; the node manager restarts it after abnormal_threshold heartbeats.",
)
ENGINE_RESTARTS = (
    "motor_controller_engine_restarts_total",
    "counter",
    "Restarts of each engine by the restart policy. Several in a few minutes is a crash loop (alert "
    "MotorEngineCrashLooping): read the engine's last failure reason.",
)


def header(family: tuple[str, str, str]) -> str:
    name, kind, help_text = family
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def labels(**pairs: str) -> str:
    return ",".join(f'{k}="{label_value(v)}"' for k, v in pairs.items())


def one_hot(name: str, label_text: str, states: list[tuple[int, str]], current: int, key: str) -> str:
    return "".join(
        f'{name}{{{label_text},{key}="{state_name}"}} {1 if value == current else 0}\n' for value, state_name in states
    )


class FleetSeries:
    """Renders the fleet series from `state`'s tables; `alarm()` is the silent-nodes alarm's
    message ("" when off); `clock.time()` is read for heartbeat ages."""

    def __init__(self, state: ClusterState, alarm: Callable[[], str], clock: Clock = SYSTEM_CLOCK, chunk: int = 500):
        self.state, self.alarm, self.clock, self.chunk = state, alarm, clock, chunk
        # id -> (what the lines show, the lines): made again only when the first part changes.
        self._node_lines: dict[str, tuple[int, str, str]] = {}
        self._instance_lines: dict[str, tuple[tuple, str]] = {}
        self._engine_lines: dict[str, tuple[tuple, str, str]] = {}

    async def render(self) -> AsyncIterator[bytes]:
        """The exposition text of every fleet series, in pieces of `chunk` rows; the loop runs between pieces."""
        nodes = list(self.state.nodes.values())
        instances = dict(self.state.instances)
        slots = [s for s in self.state.slots.values() if s.instance_id in instances]
        kept_nodes: dict[str, tuple[int, str, str]] = {}
        async for piece in self._family(NODE_STATE, nodes, lambda n: self._node(n, kept_nodes)[1]):
            yield piece
        self._node_lines = kept_nodes
        now = self.clock.time()
        heard = [n for n in nodes if n.last_heartbeat_wall]
        async for piece in self._family(
            HEARTBEAT_AGE, heard, lambda n: f"{kept_nodes[n.node_id][2]}{max(0.0, now - n.last_heartbeat_wall):.3f}\n"
        ):
            yield piece
        yield (header(SILENT_ALARM) + f"{SILENT_ALARM[0]} {1 if self.alarm() else 0}\n").encode()
        kept_instances: dict[str, tuple[tuple, str]] = {}
        async for piece in self._family(
            INSTANCE_STATE, list(instances.values()), lambda i: self._instance(i, kept_instances)[1]
        ):
            yield piece
        self._instance_lines = kept_instances
        kept_engines: dict[str, tuple[tuple, str, str]] = {}
        async for piece in self._family(ENGINE_HEALTH, slots, lambda s: self._engine(s, kept_engines)[1]):
            yield piece
        self._engine_lines = kept_engines
        async for piece in self._family(ENGINE_RESTARTS, list(kept_engines.values()), lambda lines: lines[2]):
            yield piece

    async def _family(
        self, family: tuple[str, str, str], rows: list, text: Callable[[Any], str]
    ) -> AsyncIterator[bytes]:
        """A family's header, then its rows' text `chunk` rows at a time, the loop running in between."""
        yield header(family).encode()
        for begin in range(0, len(rows), self.chunk):
            yield "".join(text(row) for row in rows[begin : begin + self.chunk]).encode()
            await asyncio.sleep(0)

    def _node(self, node, kept: dict) -> tuple[int, str, str]:
        lines = self._node_lines.get(node.node_id)
        if lines is None or lines[0] != node.state:
            label_text = labels(node_id=node.node_id)
            lines = (
                node.state,
                one_hot(NODE_STATE[0], label_text, NODE_STATES, node.state, "state"),
                f"{HEARTBEAT_AGE[0]}{{{label_text}}} ",
            )
        kept[node.node_id] = lines
        return lines

    def _instance(self, inst, kept: dict) -> tuple[tuple, str]:
        shown = (inst.group, inst.role, inst.state)
        lines = self._instance_lines.get(inst.instance_id)
        if lines is None or lines[0] != shown:
            label_text = labels(instance_id=inst.instance_id, group=inst.group, role=role_name(inst.role))
            lines = (shown, one_hot(INSTANCE_STATE[0], label_text, INSTANCE_STATES, inst.state, "state"))
        kept[inst.instance_id] = lines
        return lines

    def _engine(self, slot, kept: dict) -> tuple[tuple, str, str]:
        shown = (slot.instance_id, slot.node_id, slot.health, slot.restarts)
        lines = self._engine_lines.get(slot.engine_id)
        if lines is None or lines[0] != shown:
            ids = labels(instance_id=slot.instance_id, engine_id=slot.engine_id)
            lines = (
                shown,
                one_hot(
                    ENGINE_HEALTH[0],
                    f'{ids},node_id="{label_value(slot.node_id)}"',
                    HEALTH_STATES,
                    slot.health,
                    "health",
                ),
                f"{ENGINE_RESTARTS[0]}{{{ids}}} {slot.restarts}\n",
            )
        kept[slot.engine_id] = lines
        return lines


def engine_targets(state: ClusterState) -> list[dict]:
    """Prometheus HTTP service discovery: every placed engine's inference address (its /metrics), with
    its ids as labels. Served on the controller's metrics port at /discovery/engines."""
    targets = []
    instances = state.instances
    for slot in state.slots.values():
        inst = instances.get(slot.instance_id)
        if inst is None or not (slot.host and slot.port):
            continue
        labels_ = {
            "instance_id": slot.instance_id,
            "engine_id": slot.engine_id,
            "node_id": slot.node_id,
            "role": role_name(inst.role),
        }
        targets.append({"targets": [f"{slot.host}:{slot.port}"], "labels": labels_})
    return targets
