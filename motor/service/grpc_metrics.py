"""gRPC server metrics per method and status code, for every Motor server (MotorServer installs it).

The series are those of py-grpc-prometheus (and of go-grpc-prometheus), so existing dashboards
and rules work: grpc_server_started_total, grpc_server_handled_total{grpc_code},
grpc_server_handling_seconds. py-grpc-prometheus itself only wraps synchronous servers
(grpc.ServerInterceptor); Motor's servers are grpc.aio, so their one interceptor
(motor/service/server_calls.py) counts every call here.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

LABELS = ["grpc_type", "grpc_service", "grpc_method"]
HANDLING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GrpcServerMetrics:
    """Started and finished RPCs and their durations, for every method of one server."""

    def __init__(self, registry: CollectorRegistry | None):
        self.started = Counter(
            "grpc_server_started",
            "RPCs started on the server, by method. Compare with handled to see calls in flight.",
            LABELS,
            registry=registry,
        )
        self.handled = Counter(
            "grpc_server_handled",
            "RPCs finished on the server, by method and status code. A rising share of codes other than OK "
            "(motor:grpc_server_error_ratio:rate5m) means callers see failures: the code names the cause.",
            [*LABELS, "grpc_code"],
            registry=registry,
        )
        self.handling = Histogram(
            "grpc_server_handling_seconds",
            "Time to handle an RPC to its end (streams: their whole life). Slow unary calls point at a "
            "loaded service: compare with motor_event_loop_lag_seconds.",
            LABELS,
            buckets=HANDLING_BUCKETS,
            registry=registry,
        )

    def method(self, kind: str, path: str) -> MethodMetrics:
        """The series of one method (`kind`: unary, server_stream or bidi_stream; `path`:
        /package.Service/Method), looked up once rather than on every call."""
        service, _, name = path.lstrip("/").rpartition("/")
        labels = (kind, service, name)
        return MethodMetrics(self, labels)


class MethodMetrics:
    """One method's children of the series: started and timed on every call, handled by code."""

    __slots__ = ("metrics", "labels", "started", "handling", "handled")

    def __init__(self, metrics: GrpcServerMetrics, labels: tuple[str, ...]):
        self.metrics, self.labels = metrics, labels
        self.started = metrics.started.labels(*labels)
        self.handling = metrics.handling.labels(*labels)
        self.handled: dict[str, Any] = {}

    def finish(self, context: grpc.aio.ServicerContext, began: float, outcome: grpc.StatusCode) -> None:
        """Counts the call as handled with its status code and times it."""
        # An abort (access checks, a mapped domain error) leaves its code on the context.
        code = context.code() or outcome
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        handled = self.handled.get(name)
        if handled is None:
            handled = self.handled[name] = self.metrics.handled.labels(*self.labels, name)
        handled.inc()
        self.handling.observe(time.perf_counter() - began)
