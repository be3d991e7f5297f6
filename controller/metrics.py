"""Prometheus metrics of the controller: nodes and instances by state (read at scrape time
through the callables the controller passes), reschedules by reason, heartbeat ingest latency."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from motor.names import enum_short_name
from motor.v1 import controller_pb2

# Returns {state enum value: how many}; states it leaves out are reported as 0.
StateCounts = Callable[[], dict[int, int]]


class _StateCollector:
    def __init__(self, node_counts: StateCounts, instance_counts: StateCounts):
        self.gauges = [
            ("motor_controller_nodes", "Nodes by state", controller_pb2.NodeState, node_counts),
            ("motor_controller_instances", "Instances by state", controller_pb2.InstanceState, instance_counts),
        ]

    def describe(self):
        return []

    def collect(self):
        for name, help_text, enum_type, read in self.gauges:
            family = GaugeMetricFamily(name, help_text, labels=["state"])
            counts = read()
            for state in enum_type.values():
                if state:
                    family.add_metric([enum_short_name(enum_type, state)], counts.get(state, 0))
            yield family


class ControllerMetrics:
    def __init__(self, node_counts: StateCounts, instance_counts: StateCounts):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(node_counts, instance_counts))
        self.reschedules = Counter(
            "motor_controller_reschedules", "Engine restarts and moves by reason", ["reason"], registry=self.registry
        )
        self.registrations_refused = Counter(
            "motor_controller_registrations_refused",
            "RegisterNode calls refused, by reason (node_id_held: another live node manager process holds the node id)",
            ["reason"], registry=self.registry,
        )
        self.heartbeat_seconds = Histogram(
            "motor_controller_heartbeat_ingest_seconds", "Time to handle one Heartbeat RPC",
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=self.registry,
        )
