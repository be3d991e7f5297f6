"""Domain errors and the one place that maps them to gRPC status codes.

Behaviour classes raise these; servicers never build status codes themselves. The
`ErrorMappingInterceptor` turns them into an aborted RPC with the same message.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class MotorError(Exception):
    """Base class: an error a caller can act on. The message must say what to fix."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(MotorError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MotorError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MotorError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(MotorError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(MotorError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(MotorError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ConfigError(MotorError):
    """A configuration value is wrong; the message names the field. Entry points exit with 2."""

    code = grpc.StatusCode.INVALID_ARGUMENT


# gRPC carries a status message in a trailer (16 KiB at most, whole metadata): a message that
# echoes a huge value would turn the answer into RESOURCE_EXHAUSTED. Longer ones are cut.
MAX_MESSAGE_CHARS = 2000


def status_message(exc: Exception) -> str:
    text = str(exc)
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS]}... (message cut: {len(text)} characters)"


# protobuf's parser stops at this many nested messages (upb's default); a Struct value (a
# deployment's engine_config) takes two per level of its JSON.
PROTOBUF_MAX_DEPTH = 100


class UndecodableRequest:
    """Stands in for a request body the method's deserializer refused. gRPC would answer a
    deserializer's exception with UNKNOWN before any interceptor runs; this placeholder reaches
    ErrorMappingInterceptor, which answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception):
        self.error = error

    def message(self) -> str:
        text = f"request could not be decoded: {self.error}"
        if "MaxDepth" in text:
            text += (
                f" (a message nests at most {PROTOBUF_MAX_DEPTH} levels; each level of a deployment's"
                " engine_config counts two)"
            )
        return text


def decoding(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserialize`, answering an UndecodableRequest instead of raising."""
    if deserialize is None or getattr(deserialize, "never_raises", False):
        return deserialize

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything a corrupt body makes a parser raise
            return UndecodableRequest(exc)

    decode.never_raises = True  # type: ignore[attr-defined]
    return decode


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, UndecodableRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_message(InvalidArgument(request.message())))


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_undecodable(request, context)
        try:
            return await behavior(request, context)
        except MotorError as exc:
            await context.abort(exc.code, status_message(exc))

    return wrapper


def _wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_unary(behavior)  # a stream written with context.write (grpc's health Watch)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_undecodable(request, context)
        try:
            async for item in behavior(request, context):
                yield item
        except MotorError as exc:
            await context.abort(exc.code, status_message(exc))

    return wrapper


def _wrap_bidi(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """A request stream ends with INVALID_ARGUMENT at its first undecodable message."""
    wrapped = _wrap_stream(behavior)

    async def decoded(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            await _refuse_undecodable(request, context)
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def wrapper(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for item in wrapped(decoded(requests, context), context):
                yield item

        return wrapper

    async def writer(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await wrapped(decoded(requests, context), context)

    return writer


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps `MotorError` raised by any servicer method to its status code and message, and an
    undecodable request body to INVALID_ARGUMENT (before authentication: gRPC decodes first)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return rewrap_handler(handler, _wrap_unary, _wrap_stream, _wrap_bidi)


def rewrap_handler(
    handler: grpc.RpcMethodHandler | None,
    wrap_unary: Callable[[Callable], Callable],
    wrap_stream: Callable[[Callable], Callable],
    wrap_bidi: Callable[[Callable], Callable] | None = None,
) -> grpc.RpcMethodHandler | None:
    """`handler` with its unary-unary, unary-stream or stream-stream behaviour passed through a
    wrapper (for interceptors; `wrap_bidi` defaults to `wrap_stream`, which passes the request
    stream on as it is), and a request deserializer that never raises (`decoding`);
    client-streaming ones (Motor serves none) are returned as they are."""
    if handler is None:
        return handler
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary),
            request_deserializer=decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream),
            request_deserializer=decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None:  # StreamHeartbeats
        return grpc.stream_stream_rpc_method_handler(
            (wrap_bidi or wrap_stream)(handler.stream_stream),
            request_deserializer=decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    return handler
