"""Domain errors and the one place that maps them to gRPC status codes.

Behaviour classes raise these; servicers never build status codes themselves. Every Motor
server's interceptor (motor/service/server_calls.py) turns them into an aborted RPC with the same
message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class MotorError(Exception):
    """Base class: an error a caller can act on. The message must say what to fix. A subclass
    names the status code it is answered with in its header (`code=`); it inherits its parent's
    otherwise."""

    code = grpc.StatusCode.INTERNAL

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class InvalidArgument(MotorError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """The request itself is wrong (a field, a name, a value out of range): fix it and send it again."""


class NotFound(MotorError, code=grpc.StatusCode.NOT_FOUND):
    """What the request names (a deployment, node, engine, instance) does not exist."""


class AlreadyExists(MotorError, code=grpc.StatusCode.ALREADY_EXISTS):
    """What the request would create exists already, in another form (an engine id running another spec)."""


class FailedPrecondition(MotorError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """Valid, but not now or not here: the state of what it names refuses it (e.g. sleep on a CPU build)."""


class Unavailable(MotorError, code=grpc.StatusCode.UNAVAILABLE):
    """Cannot be done for the moment (not registered yet, leadership lost, no etcd quorum): retry."""


class ResourceExhausted(MotorError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """A limit is reached (engines per node, a heartbeat rate, a subscriber's queue); the message names it."""


class ConfigError(MotorError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """A configuration value is wrong; the message names the field. Entry points exit with 2."""


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
    the server's interceptor, which answers INVALID_ARGUMENT (`refuse_undecodable`)."""

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


async def refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    """Ends the call with INVALID_ARGUMENT when `request` is one `decoding` could not decode."""
    if isinstance(request, UndecodableRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_message(InvalidArgument(request.message())))
