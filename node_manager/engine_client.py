"""Calls from the node manager to one engine's management plane (GetStatus, WatchProbes).

`EngineClient` is what the engine monitor needs; `GrpcEngineClient` is the real one (gRPC, with
the node's TLS settings); tests give the monitor a scripted fake instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from motor.security.channels import ReloadingChannel
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from node_manager.config import NodeManagerConfig


class NoAnswer(Exception):
    """The engine did not answer a call; the message says how (shown in the health reason)."""


class EngineClient(Protocol):
    async def get_status(self, timeout: float) -> types_pb2.EngineStatus:
        """The engine's status within `timeout` seconds; NoAnswer when there is none."""

    def watch_probes(self) -> AsyncIterator[engine_pb2.WatchProbesResponse]:
        """The engine's probe stream; ends with NoAnswer when the call fails."""

    async def close(self) -> None: ...


# Makes a client for the engine of a spec (one per monitoring loop, closed when it ends).
EngineClientFactory = Callable[[types_pb2.EngineSpec], EngineClient]


class GrpcEngineClient:
    def __init__(self, spec: types_pb2.EngineSpec, config: NodeManagerConfig):
        host = spec.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        # Reconnect quickly: a starting engine binds its port within a second or so, and the
        # default 1 s (growing) reconnect backoff would delay noticing that it is up.
        fast_reconnect = {
            "grpc.initial_reconnect_backoff_ms": 50,
            "grpc.min_reconnect_backoff_ms": 50,
            "grpc.max_reconnect_backoff_ms": 1000,
        }
        # Engines serve with this node's own certificate (config.engine_argv), so the node
        # manager verifies them and presents the same certificate: it is their node-manager.
        # Rotated files are used without a restart (motor/security/channels.py).
        self.channel = ReloadingChannel(f"{host}:{spec.mgmt_port}", config.client_tls(), options=fast_reconnect)

    @property
    def stub(self) -> engine_pb2_grpc.EngineServiceStub:
        return self.channel.stub(engine_pb2_grpc.EngineServiceStub)

    async def get_status(self, timeout: float) -> types_pb2.EngineStatus:
        try:
            # wait_for_ready: within the deadline, wait for the engine's port instead of
            # failing at once on the channel's reconnect backoff from when it was starting.
            reply = await self.stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise NoAnswer(f"GetStatus timed out after {timeout:g}s") from None
            raise NoAnswer(f"GetStatus failed: {exc.code().name}: {exc.details()}") from None
        return reply.status

    async def watch_probes(self) -> AsyncIterator[engine_pb2.WatchProbesResponse]:
        try:
            async for message in self.stub.WatchProbes(engine_pb2.WatchProbesRequest(), wait_for_ready=True):
                yield message
        except grpc.aio.AioRpcError as exc:
            raise NoAnswer(exc.code().name) from None

    async def close(self) -> None:
        await self.channel.close()
