"""The controller's per-node, per-instance and per-engine series, read at scrape time from the
same views the API serves (ListNodes, ListInstances), and the engine list Prometheus discovers
its engine targets from (http_sd_configs).

State series are one-hot (kube-state-metrics' style): for each node, instance or engine, one
sample per possible state, 1 for the current one, so that `== 1` selects and `for:` works.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from motor.names import enum_short_name, role_name
from motor.v1 import controller_pb2, types_pb2

ListNodes = Callable[[], tuple[list[controller_pb2.Node], list[str]]]
ListInstances = Callable[[], list[controller_pb2.Instance]]


def _states(enum_type) -> list[tuple[int, str]]:
    return [(v, enum_short_name(enum_type, v).lower()) for v in enum_type.values() if v]


NODE_STATES = _states(controller_pb2.NodeState)
INSTANCE_STATES = _states(controller_pb2.InstanceState)
HEALTH_STATES = _states(types_pb2.HealthStatus)


def _one_hot(family: GaugeMetricFamily, labels: list[str], states: list[tuple[int, str]], current: int) -> None:
    for value, name in states:
        family.add_metric([*labels, name], 1.0 if value == current else 0.0)


class FleetCollector:
    def __init__(self, list_nodes: ListNodes, list_instances: ListInstances, clock: Callable[[], float] = time.time):
        self.list_nodes, self.list_instances, self.clock = list_nodes, list_instances, clock

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        nodes, alarms = self.list_nodes()
        yield from self._nodes(nodes, alarms)
        yield from self._instances(self.list_instances())

    def _nodes(self, nodes: list[controller_pb2.Node], alarms: list[str]) -> Iterable:
        state = GaugeMetricFamily(
            "motor_controller_node_state",
            "State of each node, 1 for the current one. lost: its engines are being moved (alert MotorNodeLost); "
            "suspect: silent and being re-checked.",
            labels=["node_id", "state"],
        )
        age = GaugeMetricFamily(
            "motor_controller_node_heartbeat_age_seconds",
            "Seconds since each node's last heartbeat. Above node_grace the node is suspect; steadily rising "
            "ages on many nodes at once point at the controller's network.",
            labels=["node_id"],
        )
        now = self.clock()
        for node in nodes:
            _one_hot(state, [node.info.node_id], NODE_STATES, node.state)
            if node.HasField("last_heartbeat"):
                age.add_metric([node.info.node_id], max(0.0, now - node.last_heartbeat.ToMicroseconds() / 1e6))
        alarm = GaugeMetricFamily(
            "motor_controller_silent_nodes_alarm",
            "1 while more than silent_share_alarm of the nodes are silent at once: the controller suspects its "
            "own network and declares none of them lost (nothing is rescheduled). Check the controller's network.",
        )
        alarm.add_metric([], 1.0 if alarms else 0.0)
        yield from (state, age, alarm)

    def _instances(self, instances: list[controller_pb2.Instance]) -> Iterable:
        state = GaugeMetricFamily(
            "motor_controller_instance_state",
            "State of each instance, 1 for the current one. Not ready for long: `motorctl instances` gives the "
            "reason (alert MotorInstanceNotReady).",
            labels=["instance_id", "group", "role", "state"],
        )
        health = GaugeMetricFamily(
            "motor_controller_engine_health",
            "Health of each engine as its node manager last reported it, 1 for the current one. abnormal: its "
            "probes fail; the node manager restarts it after abnormal_threshold heartbeats.",
            labels=["instance_id", "engine_id", "node_id", "health"],
        )
        restarts = CounterMetricFamily(
            "motor_controller_engine_restarts",
            "Restarts of each engine by the restart policy. Several in a few minutes is a crash loop (alert "
            "MotorEngineCrashLooping): read the engine's last failure reason.",
            labels=["instance_id", "engine_id"],
        )
        for inst in instances:
            _one_hot(state, [inst.instance_id, inst.group, role_name(inst.role)], INSTANCE_STATES, inst.state)
            for engine in inst.engines:
                _one_hot(health, [inst.instance_id, engine.engine_id, engine.node_id], HEALTH_STATES, engine.health)
                restarts.add_metric([inst.instance_id, engine.engine_id], engine.restarts)
        yield from (state, health, restarts)


def engine_targets(list_instances: ListInstances) -> list[dict]:
    """Prometheus HTTP service discovery: every placed engine's inference address (its /metrics), with
    its ids as labels. Served on the controller's metrics port at /discovery/engines."""
    targets = []
    for inst in list_instances():
        for engine in inst.engines:
            if not (engine.host and engine.port):
                continue
            labels = {"instance_id": inst.instance_id, "engine_id": engine.engine_id, "node_id": engine.node_id,
                      "role": role_name(inst.role)}
            targets.append({"targets": [f"{engine.host}:{engine.port}"], "labels": labels})
    return targets
