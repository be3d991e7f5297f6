"""The leader gate of an HA controller's server: mutating ControllerService calls only on the
leader, and stored in etcd before they return; on a standby they answer UNAVAILABLE naming the
leader (message and trailing metadata `motor-leader`). The feeds routers follow only from the
leader, ended when it stops leading (docs/ha.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import grpc

from motor.leader import ELECTION_METADATA, LEADER_METADATA


class Leadership(Protocol):
    """What the gate asks of the process's leadership (controller/ha/high_availability.py)."""

    store: Any  # the etcd store: its `staged` writes are flushed before a mutating call returns
    epoch: int

    def is_leader(self) -> bool: ...

    def not_leader(self) -> tuple[str, str]: ...

    async def flush(self) -> None: ...


# ControllerService methods that change state or feed the leader's liveness.
MUTATING_METHODS = frozenset(
    {
        "RegisterNode",
        "Heartbeat",
        "StreamHeartbeats",
        "ReportEngineEvent",
        "ApplyDeployment",
        "DeleteDeployment",
        "PauseRollout",
        "ResumeRollout",
        "UndoRollout",
        "ReportFrontDoor",  # the leader's rollouts and spares read it
    }
)
# Feeds only the leader serves: routers follow WatchEndpoints, and a standby's view knows no
# engine's health, so its (empty) list would take every worker out of a router.
LEADER_ONLY_FEEDS = frozenset({"WatchEndpoints"})


class LeaderGate:
    """Mutating ControllerService calls: only on the leader, and stored before they return. The
    feeds routers follow: only from the leader, ended when it stops leading. A hook of the
    server's one interceptor (motor/service/server_calls.py, `Gate`), which asks it once per
    method's handler and keeps what it answers."""

    def __init__(self, ha: Leadership, service: str = "motor.v1.ControllerService"):
        self.ha, self.service = ha, service

    def gated(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, _, name = method.lstrip("/").rpartition("/")
        if service != self.service or name not in MUTATING_METHODS | LEADER_ONLY_FEEDS:
            return handler
        return self._gate(handler)

    def _gate(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        ha = self.ha

        async def refuse_unless_leader(context: grpc.aio.ServicerContext) -> None:
            if not ha.is_leader():
                message, leader = ha.not_leader()
                context.set_trailing_metadata(
                    ((LEADER_METADATA, leader),) if leader else ((ELECTION_METADATA, "under way"),)
                )
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        async def while_leading(
            method: Callable[..., Any], requests: Any, context: grpc.aio.ServicerContext, stamp_epoch: bool = False
        ) -> Any:
            """A streaming call's replies, each only while leading (the call is refused at once
            when this controller stops leading)."""
            await refuse_unless_leader(context)
            async for reply in method(requests, context):
                await refuse_unless_leader(context)
                if stamp_epoch:  # as Heartbeat's answer: nodes learn the epoch
                    reply.heartbeat.controller_epoch = ha.epoch
                yield reply

        if handler.unary_stream is not None:  # WatchEndpoints: every message only while leading
            feed = handler.unary_stream

            async def gated_feed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in while_leading(feed, request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(
                gated_feed,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:  # StreamHeartbeats: every beat only while leading
            stream = handler.stream_stream

            async def gated_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in while_leading(stream, requests, context, stamp_epoch=True):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(
                gated_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        async def gated(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await refuse_unless_leader(context)
            staged = ha.store.staged
            reply = await behavior(request, context)
            if ha.store.staged != staged:
                await ha.flush()
            if hasattr(reply, "controller_epoch"):  # RegisterNode, Heartbeat: nodes learn the epoch
                reply.controller_epoch = ha.epoch
            return reply

        return grpc.unary_unary_rpc_method_handler(
            gated, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
