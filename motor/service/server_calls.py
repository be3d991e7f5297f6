"""The one interceptor in front of every Motor server's methods: each call is counted and timed
(motor/service/grpc_metrics.py), its caller authenticated and authorized (motor/security/access.py),
an undecodable request answered INVALID_ARGUMENT and a domain error mapped to its status code
(motor/errors.py).

One wrapper does all of it because each layer of wrapping costs on every message: a heartbeat
stream passed through five async generators per reply and four per request when each concern
was an interceptor of its own, and at 10,000 nodes those frames, and the garbage collector
walking them, took about a fifth of the controller's CPU (docs/benchmarks.md). Here a reply
passes one generator and a request one small iterator; a method's wrapped handler is built once
and reused for every call of it.

The order inside a call is the one the separate interceptors had: the metrics see the status
code every check sets; an undecodable request is refused before the caller is authenticated
(gRPC decodes a unary request before any interceptor runs); then access; then the servicer.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from motor.errors import MotorError, decoding, refuse_undecodable, status_message

if TYPE_CHECKING:  # prometheus_client must not be imported before the engine server sets its multiprocess dir
    from motor.security.access import AccessControl, Caller
    from motor.service.grpc_metrics import GrpcServerMetrics, MethodMetrics

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class ServerCalls(grpc.aio.ServerInterceptor):
    """Wraps every method handler once: metrics (when given), access (when given), decoding and
    error mapping (always). Install it first, so that other interceptors run inside it."""

    def __init__(self, metrics: GrpcServerMetrics | None = None, access: AccessControl | None = None):
        self.metrics, self.access = metrics, access
        # method -> (the handler gRPC found, its wrapped handler): gRPC's generic handlers answer
        # the same object for every call of a method; another interceptor's fresh one is rewrapped.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        call = _Call(method, self.metrics, self.access)
        decode = decoding(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            behavior = call.unary(handler.unary_unary, "unary")
            return grpc.unary_unary_rpc_method_handler(behavior, decode, serialize)
        if handler.unary_stream is not None:
            behavior = call.stream(handler.unary_stream, "server_stream", reads_stream=False)
            return grpc.unary_stream_rpc_method_handler(behavior, decode, serialize)
        if handler.stream_stream is not None:  # StreamHeartbeats
            behavior = call.stream(handler.stream_stream, "bidi_stream", reads_stream=True)
            return grpc.stream_stream_rpc_method_handler(behavior, decode, serialize)
        # Client streaming (Motor serves none yet): checked like the others, never let through unchecked.
        behavior = call.stream(handler.stream_unary, "client_stream", reads_stream=True)
        return grpc.stream_unary_rpc_method_handler(behavior, decode, serialize)


class _Call:
    """The wrappers of one method's behaviour."""

    def __init__(self, method: str, metrics: GrpcServerMetrics | None, access: AccessControl | None):
        self.method, self.metrics, self.access = method, metrics, access

    def metrics_of(self, kind: str) -> MethodMetrics | None:
        return self.metrics.method(kind, self.method) if self.metrics is not None else None

    def unary(self, behavior: Callable[..., Awaitable[Any]], kind: str) -> Callable[..., Awaitable[Any]]:
        method, access, metrics = self.method, self.access, self.metrics_of(kind)

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            began, outcome = _begin(metrics), grpc.StatusCode.UNKNOWN
            try:
                await refuse_undecodable(request, context)
                if access is not None:
                    await access.admit(method, request, context)
                try:
                    response = await behavior(request, context)
                except MotorError as exc:
                    await context.abort(exc.code, status_message(exc))
                outcome = grpc.StatusCode.OK
                return response
            except asyncio.CancelledError:
                outcome = grpc.StatusCode.CANCELLED
                raise
            finally:
                if metrics is not None:
                    metrics.finish(context, began, outcome)

        return unary

    def stream(self, behavior: Callable[..., Any], kind: str, reads_stream: bool) -> Callable[..., Any]:
        """A streaming method: counted against its caller's open streams while it lasts; with
        `reads_stream`, each request message is checked as it is read (`CheckedRequests`)."""
        method, access, metrics = self.method, self.access, self.metrics_of(kind)

        async def open_stream(request: Any, context: grpc.aio.ServicerContext) -> tuple[Any, str | None]:
            caller: Caller | None = None
            if not reads_stream:
                await refuse_undecodable(request, context)
            if access is not None:
                caller = await access.admit(method, None if reads_stream else request, context)
                key = await access.enter_stream(caller, context)
            else:
                key = None
            if reads_stream:  # grpc's own iterator is bypassed: the checks read the messages
                request = CheckedRequests(context, method, caller, access)
            return request, key

        if not inspect.isasyncgenfunction(behavior):
            # A coroutine: a stream written with context.write (grpc's health Watch), or a client
            # stream's single answer.

            async def written(request: Any, context: grpc.aio.ServicerContext) -> Any:
                began, outcome, key = _begin(metrics), grpc.StatusCode.UNKNOWN, None
                try:
                    request, key = await open_stream(request, context)
                    try:
                        response = await behavior(request, context)
                    except MotorError as exc:
                        await context.abort(exc.code, status_message(exc))
                    outcome = grpc.StatusCode.OK
                    return response
                except asyncio.CancelledError:
                    outcome = grpc.StatusCode.CANCELLED
                    raise
                finally:
                    _leave(access, key)
                    if metrics is not None:
                        metrics.finish(context, began, outcome)

            return written

        async def replies(request: Any, context: grpc.aio.ServicerContext) -> Any:
            began, outcome, key = _begin(metrics), grpc.StatusCode.UNKNOWN, None
            try:
                request, key = await open_stream(request, context)
                try:
                    async for reply in behavior(request, context):
                        yield reply
                except MotorError as exc:
                    await context.abort(exc.code, status_message(exc))
                outcome = grpc.StatusCode.OK
            except (asyncio.CancelledError, GeneratorExit):
                outcome = grpc.StatusCode.CANCELLED
                raise
            finally:
                _leave(access, key)
                if metrics is not None:
                    metrics.finish(context, began, outcome)

        return replies


class CheckedRequests:
    """A request stream read straight from the call (`context.read()`): each message is refused
    when undecodable, and checked as a unary request would be (a node's heartbeat stream may carry
    only its own node's heartbeats), before the servicer sees it. Read by one `async for`, as
    grpc's own request iterator is (Motor's servicers read no other way)."""

    __slots__ = ("context", "method", "caller", "access")

    def __init__(
        self, context: grpc.aio.ServicerContext, method: str, caller: Caller | None, access: AccessControl | None
    ):
        self.context, self.method, self.caller, self.access = context, method, caller, access

    def __aiter__(self) -> CheckedRequests:
        return self

    async def __anext__(self) -> Any:
        request = await self.context.read()
        if request is grpc.aio.EOF:
            raise StopAsyncIteration
        await refuse_undecodable(request, self.context)
        if self.caller is not None and self.access is not None:
            await self.access.check_message(self.method, self.caller, request, self.context)
        return request


def _begin(metrics: MethodMetrics | None) -> float:
    if metrics is None:
        return 0.0
    metrics.started.inc()
    return time.perf_counter()


def _leave(access: AccessControl | None, key: str | None) -> None:
    if access is not None:
        access.leave_stream(key)
