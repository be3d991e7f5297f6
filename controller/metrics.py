"""Prometheus metrics of the controller: nodes and instances by state (read at scrape time),
reschedules by reason, heartbeat ingest latency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from motor.names import enum_short_name
from motor.v1 import controller_pb2

if TYPE_CHECKING:
    from controller.core import Controller


class _StateCollector:
    def __init__(self, controller: "Controller"):
        self.controller = controller

    def describe(self):
        return []

    def collect(self):
        nodes = GaugeMetricFamily("motor_controller_nodes", "Nodes by state", labels=["state"])
        counts = {v: 0 for v in controller_pb2.NodeState.values() if v}
        for node in self.controller.nodes.values():
            counts[node.state] = counts.get(node.state, 0) + 1
        for state, count in counts.items():
            nodes.add_metric([enum_short_name(controller_pb2.NodeState, state)], count)
        yield nodes
        instances = GaugeMetricFamily("motor_controller_instances", "Instances by state", labels=["state"])
        counts = {v: 0 for v in controller_pb2.InstanceState.values() if v}
        for inst in self.controller.instances.values():
            counts[inst.state] = counts.get(inst.state, 0) + 1
        for state, count in counts.items():
            instances.add_metric([enum_short_name(controller_pb2.InstanceState, state)], count)
        yield instances


class ControllerMetrics:
    def __init__(self, controller: "Controller"):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(controller))
        self.reschedules = Counter(
            "motor_controller_reschedules", "Engine restarts and moves by reason", ["reason"], registry=self.registry
        )
        self.heartbeat_seconds = Histogram(
            "motor_controller_heartbeat_ingest_seconds", "Time to handle one Heartbeat RPC",
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=self.registry,
        )
