"""gRPC server metrics per method and status code, for every Motor server (MotorServer installs it).

The series are those of py-grpc-prometheus (and of go-grpc-prometheus), so existing dashboards
and rules work: grpc_server_started_total, grpc_server_handled_total{grpc_code},
grpc_server_handling_seconds. py-grpc-prometheus itself only wraps synchronous servers
(grpc.ServerInterceptor); Motor's servers are grpc.aio, hence this interceptor.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from motor.errors import rewrap_handler

LABELS = ["grpc_type", "grpc_service", "grpc_method"]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
HANDLING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """Counts started and finished RPCs and times them. Install it outermost, so that it sees the
    status code other interceptors set (ErrorMappingInterceptor's aborts)."""

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

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Any:
        service, _, method = details.method.lstrip("/").rpartition("/")
        return rewrap_handler(
            await continuation(details),
            lambda behavior: self._unary(behavior, ("unary", service, method)),
            lambda behavior: self._stream(behavior, ("server_stream", service, method)),
            lambda behavior: self._stream(behavior, ("bidi_stream", service, method)),
        )

    def _finish(
        self, labels: tuple[str, ...], context: grpc.aio.ServicerContext, began: float, outcome: grpc.StatusCode
    ) -> None:
        # An abort (context.abort, the error-mapping interceptor) leaves its code on the context.
        code = context.code() or outcome
        self.handled.labels(*labels, code.name if isinstance(code, grpc.StatusCode) else str(code)).inc()
        self.handling.labels(*labels).observe(time.perf_counter() - began)

    def _unary(self, behavior: Callable[..., Awaitable[Any]], labels: tuple[str, ...]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.started.labels(*labels).inc()
            began, outcome = time.perf_counter(), grpc.StatusCode.UNKNOWN
            try:
                response = await behavior(request, context)
                outcome = grpc.StatusCode.OK
                return response
            except asyncio.CancelledError:
                outcome = grpc.StatusCode.CANCELLED
                raise
            finally:
                self._finish(labels, context, began, outcome)

        return wrapper

    def _stream(self, behavior: Callable[..., Any], labels: tuple[str, ...]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            return self._unary(behavior, labels)  # a stream written with context.write (grpc's health Watch)

        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.started.labels(*labels).inc()
            began, outcome = time.perf_counter(), grpc.StatusCode.UNKNOWN
            try:
                async for item in behavior(request, context):
                    yield item
                outcome = grpc.StatusCode.OK
            except (asyncio.CancelledError, GeneratorExit):
                outcome = grpc.StatusCode.CANCELLED
                raise
            finally:
                self._finish(labels, context, began, outcome)

        return wrapper
