"""Prometheus metrics of one node manager (its own registry, so tests can run several).

The node manager exports its own engines' series (health, restarts), as the kubelet does for its
pods: the controller keeps only fleet aggregates (controller/fleet/series.py), so a scrape of it
stays small at any fleet size, and each engine's series comes from the host that runs it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from motor.contract.names import enum_short_name
from motor.service.scraped import ScrapedCollector
from motor.v1 import types_pb2

STATES = [types_pb2.EngineState.Name(v).removeprefix("ENGINE_STATE_").lower() for v in (1, 2, 3, 4, 5)]
KILL_REASONS = ("abnormal", "stop_deadline", "orphans", "unassigned", "leftover")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, node_id: str):
        self.registry = CollectorRegistry()
        self.engines = Gauge(
            "motor_node_manager_engines",
            "Engine processes on this node by lifecycle state. Engines stuck in starting point at a slow model "
            "load or a bad engine_command; failed ones are restarted by the controller's policy.",
            ["node", "state"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "motor_node_manager_engine_restarts",
            "Engines launched again on this node for an id that ran before (a new generation or a restart), per "
            "engine. Several in a few minutes: the engine keeps failing (alert MotorEngineCrashLooping; "
            "motor_node_manager_engine_kills_total says why it was stopped).",
            ["node", "instance_id", "engine_id"],
            registry=self.registry,
        )
        self.kills = Counter(
            "motor_node_manager_engine_kills",
            "Engines (or leftovers of their process tree) killed by the node manager, by reason: abnormal "
            "(unhealthy for abnormal_threshold heartbeats), stop_deadline (ignored SIGTERM), orphans, unassigned, "
            "leftover. Rising abnormal kills: read those engines' logs.",
            ["node", "reason"],
            registry=self.registry,
        )
        self.failures = Counter(
            "motor_node_manager_engine_failures",
            "Engines that ended in FAILED (exited, killed or never became healthy). Their exit reason is in "
            "`motorctl instances` and the engine's log under the node's log directory.",
            ["node"],
            registry=self.registry,
        )
        self.store_write_failures = Counter(
            "motor_node_manager_store_write_failures",
            "Engine record writes the disk refused (full, read-only, failing) under the node's state_dir, retries "
            "included. Rising: free space there; exits are still recorded in memory and reported meanwhile (alert "
            "MotorNodeStoreFailing).",
            ["node"],
            registry=self.registry,
        )
        self.heartbeat_latency = Histogram(
            "motor_node_manager_heartbeat_latency_seconds",
            "Latency of Heartbeat calls to the controller. Close to the controller's node_grace, the node "
            "risks being declared lost: check the network and the controller's load.",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.status_latency = Histogram(
            "motor_node_manager_status_latency_seconds",
            "Latency of GetStatus calls to engines (answered calls only). High values mean engines answer "
            "their management plane slowly: check the engines' load and motor_event_loop_lag_seconds.",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.node = node_id
        for reason in KILL_REASONS:  # present from the start, so rate() sees the first one
            self.kills.labels(node_id, reason)

    def watch_engines(self, engines: Callable[[], Iterable]) -> None:
        """Export each engine's health as `engines()` (its EngineRecords) says at scrape time."""
        self.registry.register(_EngineHealth(self.node, engines))

    def launched(self, instance_id: str, engine_id: str, again: bool) -> None:
        """An engine launched (or adopted: `again` False); its restart count is there from its first
        launch, at 0, so that increase() sees the first restart."""
        child = self.restarts.labels(self.node, instance_id, engine_id)
        if again:
            child.inc()

    def set_states(self, counts: dict[str, int]) -> None:
        for state in STATES:
            self.engines.labels(self.node, state).set(counts.get(state, 0))

    def kill(self, reason: str) -> None:
        self.kills.labels(self.node, reason).inc()


HEALTH_STATES = [(v, enum_short_name(types_pb2.HealthStatus, v).lower()) for v in types_pb2.HealthStatus.values() if v]


class _EngineHealth(ScrapedCollector):
    """One-hot health of each engine this node manager runs (kube-state-metrics' style: `== 1`
    selects, `for:` works). Engines that ended (stopped, failed) have no line."""

    def __init__(self, node: str, engines: Callable[[], Iterable]):
        self.node, self.engines = node, engines

    def collect(self):
        family = GaugeMetricFamily(
            "motor_node_manager_engine_health",
            "Health of each running engine on this node as its engine server reports it, 1 for the current one. "
            "abnormal: its probes fail; the node manager restarts it after abnormal_threshold heartbeats.",
            labels=["node", "instance_id", "engine_id", "health"],
        )
        for record in self.engines():
            if not record.active:
                continue
            for value, name in HEALTH_STATES:
                family.add_metric(
                    [self.node, record.spec.instance_id, record.engine_id, name], 1 if record.health == value else 0
                )
        yield family
