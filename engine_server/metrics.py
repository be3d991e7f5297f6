"""The engine server's own Prometheus metrics, multiprocess-safe, served on the inference plane.

With PROMETHEUS_MULTIPROC_DIR set (engine_server.prometheus_dir), values are written to the shared
directory and `registry()` collects every process's files, as vLLM's `/metrics` does.
"""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from motor.service.grpc_metrics import GrpcServerMetrics
from motor.service.loop_lag import EventLoopLag

PROBE_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def registry() -> CollectorRegistry:
    """The registry a `/metrics` route should render: every process's metrics in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        collected = CollectorRegistry()
        multiprocess.MultiProcessCollector(collected)
        return collected
    return REGISTRY


class EngineServerMetrics:
    """Probe count by outcome, probe latency, health status and current interval.

    Create one per process (tests pass their own CollectorRegistry)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        self.probes = Counter(
            "motor_engine_server_probes",
            "Virtual-inference probes sent, by outcome (success, failure). Failures while busy are expected and not "
            "counted; see motor_engine_server_probe_counted_failures_total for the ones that matter.",
            ["outcome"],
            registry=registry,
        )
        self.counted_failures = Counter(
            "motor_engine_server_probe_counted_failures",
            "Failed probes that counted towards max_failure_count: they failed while the accelerator was idle (below "
            "npu_usage_threshold) or while the engine produced no tokens and completed no scheduler steps, so it is "
            "likely hung. Read its log (alert MotorProbesFailingWhileIdle).",
            registry=registry,
        )
        self.probe_latency = Histogram(
            "motor_engine_server_probe_latency_seconds",
            "Latency of virtual-inference probes, to the answer or the timeout. Rising towards probe_timeout "
            "means the engine answers slowly even to one token: check its load and log.",
            buckets=PROBE_LATENCY_BUCKETS,
            registry=registry,
        )
        # livemostrecent: the value of the live process that set it last (one engine server per dir).
        self.status = Gauge(
            "motor_engine_server_health_status",
            "Health status this engine server reports: 1 INIT (loading), 2 NORMAL, 3 ABNORMAL. ABNORMAL for "
            "abnormal_threshold heartbeats gets the engine restarted by its node manager.",
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.probe_interval = Gauge(
            "motor_engine_server_probe_interval_seconds",
            "Current interval between virtual-inference probes: probe_interval when idle, busy_probe_interval under "
            "load. "
            "Informational; tune those settings if failures are noticed too late.",
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.consecutive_failures = Gauge(
            "motor_engine_server_consecutive_failures",
            "Consecutive failed checks (counted probe failures, failed GET /health). At max_failure_count the engine "
            "turns ABNORMAL; a value above 0 that does not reset means the engine keeps failing them.",
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.probe_utilization = Gauge(
            "motor_engine_server_utilization_peak_percent",
            "Peak accelerator utilization over the last probe round's sampling window, in percent. Below "
            "npu_usage_threshold the engine counts as idle, so probe failures count.",
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.not_serving = Gauge(
            "motor_engine_server_not_serving",
            "1 while the stall watchdog holds this engine out of the routers, by cause: stalled (client requests in "
            "flight and no progress for stall_timeout) or failing (client requests fail with server errors and none "
            "succeeds). Lasting stall_kill_after it turns ABNORMAL and is replaced (alert MotorEngineNotServing).",
            ["cause"],
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.serving_changes = Counter(
            "motor_engine_server_serving_changes",
            "Changes of the stall watchdog's verdict, by the state entered: stalled, failing (the engine left the "
            "routers) or serving (it came back). Stalls that come back quickly mean stall_timeout is too short "
            "for this model's longest step.",
            ["to"],
            registry=registry,
        )
        for cause in ("stalled", "failing"):
            self.not_serving.labels(cause)
        for to in ("stalled", "failing", "serving"):
            self.serving_changes.labels(to)
        for outcome in ("success", "failure"):
            self.probes.labels(outcome)
        # The series every Motor service has (management-plane RPCs, event-loop lag).
        self.grpc = GrpcServerMetrics(registry)
        self.loop_lag = EventLoopLag(registry)


_process_metrics: EngineServerMetrics | None = None


def process_metrics() -> EngineServerMetrics:
    """The metrics of this process (created on first use, in the default registry)."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = EngineServerMetrics()
    return _process_metrics
