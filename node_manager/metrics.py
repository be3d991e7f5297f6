"""Prometheus metrics of one node manager (its own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from motor.v1 import types_pb2

STATES = [types_pb2.EngineState.Name(v).removeprefix("ENGINE_STATE_").lower() for v in (1, 2, 3, 4, 5)]
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, node_id: str):
        self.registry = CollectorRegistry()
        self.engines = Gauge(
            "motor_node_manager_engines", "Engines by state", ["node", "state"], registry=self.registry
        )
        self.restarts = Counter(
            "motor_node_manager_engine_restarts",
            "Engines launched again for an id that ran before (a new generation or a restart)",
            ["node"],
            registry=self.registry,
        )
        self.kills = Counter(
            "motor_node_manager_engine_kills",
            "Engines (or leftovers of their process tree) killed by the node manager, by reason: "
            "abnormal, stop_deadline, orphans, unassigned, leftover",
            ["node", "reason"],
            registry=self.registry,
        )
        self.failures = Counter(
            "motor_node_manager_engine_failures", "Engines that ended in FAILED", ["node"], registry=self.registry
        )
        self.heartbeat_latency = Histogram(
            "motor_node_manager_heartbeat_latency_seconds",
            "Latency of Heartbeat calls to the controller",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.status_latency = Histogram(
            "motor_node_manager_status_latency_seconds",
            "Latency of GetStatus calls to engines (answered calls only)",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.node = node_id

    def set_states(self, counts: dict[str, int]) -> None:
        for state in STATES:
            self.engines.labels(self.node, state).set(counts.get(state, 0))

    def kill(self, reason: str) -> None:
        self.kills.labels(self.node, reason).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
