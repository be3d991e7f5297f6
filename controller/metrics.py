"""Prometheus metrics of the controller: nodes and instances by state (read at scrape time
through the callables the controller passes), reschedules by reason and rate-limit hold-backs,
time from an engine's failure to its replacement NORMAL, heartbeat ingest latency. The store's
series (controller.store.write_metrics) come in as `collectors`; the fleet aggregates (per group and
state, the nodes not READY) are rendered apart (controller.fleet_metrics) and served after
these. Per-engine series are the node managers' (node_manager/metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from motor.contract.names import enum_short_name
from motor.service.scraped import ScrapedCollector
from motor.v1 import controller_pb2

# Returns {state enum value: how many}; states it leaves out are reported as 0.
StateCounts = Callable[[], dict[int, int]]


class _StateCollector(ScrapedCollector):
    def __init__(self, node_counts: StateCounts, instance_counts: StateCounts):
        self.gauges = [
            (
                "motor_controller_nodes",
                "Nodes by state (LOST: engines moved elsewhere; SUSPECT: silent, being "
                "re-checked). motor_controller_node_unready names the nodes not READY.",
                controller_pb2.NodeState,
                node_counts,
            ),
            (
                "motor_controller_instances",
                "Instances by state; anything but READY for long needs a look "
                "(motor_controller_group_instances by group; `motorctl instances` names them).",
                controller_pb2.InstanceState,
                instance_counts,
            ),
        ]

    def collect(self):
        for name, help_text, enum_type, read in self.gauges:
            family = GaugeMetricFamily(name, help_text, labels=["state"])
            counts = read()
            for state in enum_type.values():
                if state:
                    family.add_metric([enum_short_name(enum_type, state)], counts.get(state, 0))
            yield family


class _RevisionCollector(ScrapedCollector):
    """Instances per deployment and revision: during a rollout the old revision's count falls as
    the new one's rises; a count left on an old revision is a rollout paused or stuck."""

    def __init__(self, revision_counts: Callable[[], dict[tuple[str, int], int]]):
        self.read = revision_counts

    def collect(self):
        family = GaugeMetricFamily(
            "motor_controller_instances_by_revision",
            "Instances by deployment and the revision whose spec they run (ListDeployments shows the rollout).",
            labels=["deployment", "revision"],
        )
        for (deployment, revision), count in sorted(self.read().items()):
            family.add_metric([deployment, str(revision)], count)
        yield family


class ControllerMetrics:
    def __init__(
        self,
        node_counts: StateCounts,
        instance_counts: StateCounts,
        collectors: Iterable = (),
        revision_counts: Callable[[], dict[tuple[str, int], int]] = dict,
    ):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(node_counts, instance_counts))
        self.registry.register(_RevisionCollector(revision_counts))
        for collector in collectors:
            self.registry.register(collector)
        self.reschedules = Counter(
            "motor_controller_reschedules",
            "Engine restarts (engine_failed) and moves off lost nodes (node_lost). A steady rate of "
            "engine_failed means engines keep failing: see motor_node_manager_engine_restarts_total per engine.",
            ["reason"],
            registry=self.registry,
        )
        self.registrations_refused = Counter(
            "motor_controller_registrations_refused",
            "RegisterNode calls refused, by reason (node_id_held: another live node manager process holds the node id)",
            ["reason"],
            registry=self.registry,
        )
        self.heartbeats_refused = Counter(
            "motor_controller_heartbeats_refused",
            "Heartbeats refused (RESOURCE_EXHAUSTED, not read) because the node beats far faster than the "
            "interval it was told: a node manager that does not keep to the heartbeat rate budget.",
            ["node_id"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "motor_controller_reschedules_rate_limited",
            "Engines whose move was held back by the reschedule rate limit (reschedule_rate). Many during a "
            "node loss is the limit doing its job; raise reschedule_rate if recovery is too slow.",
            registry=self.registry,
        )
        self.recovery_seconds = Histogram(
            "motor_controller_engine_recovery_seconds",
            "Time from an engine's failure (or its node's loss) to its replacement NORMAL: the outage an "
            "instance sees. A rising p90 (motor:engine_recovery_seconds:p90_1h) points at slow engine "
            "start-up, backoff, or no free accelerators.",
            buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )
        for reason in ("engine_failed", "node_lost"):  # present from the start, so rate() sees the first one
            self.reschedules.labels(reason=reason)
        self.heartbeat_interval = Gauge(
            "motor_controller_heartbeat_interval_seconds",
            "Heartbeat interval the controller announces to node managers: --heartbeat-interval, longer when "
            "the fleet would exceed --max-heartbeats-per-second (live nodes / that rate).",
            registry=self.registry,
        )
        self.node_grace = Gauge(
            "motor_controller_node_grace_seconds",
            "Silence after which a node turns SUSPECT: --node-grace scaled with the announced interval. A node "
            "is declared lost within this + 2 intervals + --recheck-timeout.",
            registry=self.registry,
        )
        self.handling_cpu = Counter(
            "motor_controller_handling_cpu_seconds_total",
            "CPU the controller's own code spent handling heartbeats and engine reports, by call (gRPC's "
            "reading and writing of the messages not counted): over the calls handled, what one costs it, "
            "apart from gRPC (bench/controller_scale.py splits the rest).",
            ["call"],
            registry=self.registry,
        )
        self.heartbeat_cpu, self.report_cpu = self.handling_cpu.labels("heartbeat"), self.handling_cpu.labels("report")
        self.heartbeat_seconds = Histogram(
            "motor_controller_heartbeat_ingest_seconds",
            "Time to handle one Heartbeat RPC. Above the heartbeat interval the controller falls behind "
            "its nodes: check motor_event_loop_lag_seconds and the store's write latency.",
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=self.registry,
        )
