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
(gRPC decodes a unary request before any interceptor runs); then access; then the gate, when
the server has one (the HA controller's leader gate, controller/ha/leader_gate.py); then the
servicer. The gate is a hook of this interceptor, not an interceptor of its own: it is applied
to a method's handler once, when the handler is wrapped, so every call of the method runs one
wrapper built once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from motor.errors import MotorError, decoding, refuse_undecodable, status_message

if TYPE_CHECKING:  # prometheus_client must not be imported before the engine server sets its multiprocess dir
    from motor.service.grpc_metrics import GrpcServerMetrics, MethodMetrics

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
# A call's opening checks: (the request to pass on, the stream slot it holds or None).
Opener = Callable[[Any, grpc.aio.ServicerContext], Awaitable[tuple[Any, str | None]]]


Caller = Any  # whoever AccessControl.admit authenticated (motor/security/access.py), passed back to it


class AccessControl(Protocol):
    """What the interceptor asks of the server's access checks at each step of a call
    (motor/security/access.py implements it; the security package stands on this one, not the
    other way round)."""

    async def admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Caller | None: ...

    async def check_message(
        self, method: str, caller: Caller, request: Any, context: grpc.aio.ServicerContext
    ) -> None: ...

    async def enter_stream(self, caller: Caller | None, context: grpc.aio.ServicerContext) -> str: ...

    def leave_stream(self, key: str | None) -> None: ...


class Gate(Protocol):
    """A check the server runs inside its calls of some methods, after the access checks."""

    def gated(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler to run for `method` (`handler` itself when the method is not gated)."""
        ...


class ServerCalls(grpc.aio.ServerInterceptor):
    """Wraps every method handler once: metrics (when given), access (when given), the gate
    (when given), decoding and error mapping (always). The server's only interceptor."""

    def __init__(
        self, metrics: GrpcServerMetrics | None = None, access: AccessControl | None = None, gate: Gate | None = None
    ):
        self.metrics, self.access, self.gate = metrics, access, gate
        # method -> (the handler gRPC found, its wrapped handler): gRPC's generic handlers answer
        # the same object for every call of a method; a handler that changed is wrapped again.
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
        if self.gate is not None:  # inside the checks and the metrics: a refusal of its own is counted
            handler = self.gate.gated(method, handler)
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
        method, access = self.method, self.access

        async def admit(request: Any, context: grpc.aio.ServicerContext) -> tuple[Any, None]:
            await refuse_undecodable(request, context)
            if access is not None:
                await access.admit(method, request, context)
            return request, None

        return self.answered(behavior, self.metrics_of(kind), admit)

    def answered(
        self, behavior: Callable[..., Awaitable[Any]], metrics: MethodMetrics | None, open_call: Opener
    ) -> Callable[..., Awaitable[Any]]:
        """A behaviour that is a coroutine (a unary answer, a client stream's answer, a stream
        written with context.write): opened by `open_call` (its checks; the request it passes on
        and the stream slot it holds, if any), its domain errors mapped, counted at its end."""
        access = self.access

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            began, outcome, key = _begin(metrics), grpc.StatusCode.UNKNOWN, None
            try:
                request, key = await open_call(request, context)
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
                _end(access, key, metrics, context, began, outcome)

        return answered

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

        if not inspect.isasyncgenfunction(behavior):  # grpc's health Watch, or a client stream
            return self.answered(behavior, metrics, open_stream)

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
                _end(access, key, metrics, context, began, outcome)

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


def _end(
    access: AccessControl | None,
    key: str | None,
    metrics: MethodMetrics | None,
    context: grpc.aio.ServicerContext,
    began: float,
    outcome: grpc.StatusCode,
) -> None:
    """A call's end: its stream slot given back (if it held one), then counted with its code."""
    if access is not None:
        access.leave_stream(key)
    if metrics is not None:
        metrics.finish(context, began, outcome)
