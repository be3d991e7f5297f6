"""gRPC server and channel helpers: every Motor server serves grpc.health.v1 and reflection.

Usage:
    server = MotorServer(bind="127.0.0.1:0", tls=None)
    server.add(engine_pb2_grpc.add_EngineServiceServicer_to_server, servicer,
               engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name)
    port = await server.start()     # the port actually bound
    ...
    await server.stop(grace=1.0)
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from motor.errors import ConfigError
from motor.service.server_calls import AccessControl, Gate, ServerCalls
from motor.service.tls import ReloadingServerCredentials, TlsFileWatch, TlsPems

if TYPE_CHECKING:  # prometheus_client must not be imported before the engine server sets its multiprocess dir
    from motor.service.grpc_metrics import GrpcServerMetrics

logger = logging.getLogger(__name__)

# Large fleets send big heartbeats; keep messages well above the 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A healed partition must be noticed in seconds: keepalive pings find a dead TCP connection,
# and the reconnect backoff is capped (gRPC's default grows to 120 s, which once held a node
# manager off its controller for ~50 s after a partition healed).
CHANNEL_OPTIONS = [
    *_MESSAGE_SIZE_OPTIONS,
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Servers accept those pings (by default they answer frequent pings with GOAWAY). No
# SO_REUSEPORT (gRPC's default on Linux): with it a second controller given a taken --listen
# started and the kernel split connections between the two.
SERVER_OPTIONS = [
    *_MESSAGE_SIZE_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # No BDP probing: it sized receive windows for bulk transfers, of which Motor's servers take
    # none, and the server sent a PING after almost every message it received (a heartbeat: one
    # more frame out and one more in, each a TLS record). Off: 15-20% less controller CPU per
    # heartbeat (bench/controller_scale.py, docs/benchmarks.md).
    ("grpc.http2.bdp_probe", 0),
]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS server or client. `ca` on a server turns on client verification."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    require_client_cert: bool = False


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Credentials that re-read the files when they change (motor/service/tls.py)."""
    if not tls.cert or not tls.key:
        raise ConfigError("TLS needs both a certificate and a key")
    return ReloadingServerCredentials(tls.cert, tls.key, tls.ca, tls.require_client_cert).credentials


def channel_credentials(tls: TlsFiles, pems: TlsPems | None = None) -> grpc.ChannelCredentials:
    """Client credentials from `tls`'s files, or from `pems` already read from them."""
    pems = pems or TlsFileWatch(tls.cert, tls.key, tls.ca).pems
    return grpc.ssl_channel_credentials(root_certificates=pems.ca, private_key=pems.key, certificate_chain=pems.cert)


def aio_channel(
    target: str,
    tls: TlsFiles | None = None,
    server_name: str | None = None,
    options: dict[str, Any] | None = None,
    pems: TlsPems | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to `target`, plaintext or TLS; `options` override CHANNEL_OPTIONS by key.
    A process that keeps a channel uses motor/security/channels.py, which follows rotated TLS files."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(options or {})
    options = list(merged.items())
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, channel_credentials(tls, pems), options=options)


class MotorServer:
    """An asyncio gRPC server with health, reflection, domain-error mapping and, when given, metrics and
    access checks built in."""

    def __init__(
        self,
        bind: str,
        tls: TlsFiles | None = None,
        gate: Gate | None = None,
        reflection: bool = True,
        token_bind: str | None = None,
        token_tls: TlsFiles | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        metrics: GrpcServerMetrics | None = None,
        access: AccessControl | None = None,
        setting: str = "listen",
        token_setting: str = "token_listen",
    ):
        """`token_bind`: a second TLS port that asks for no client certificate (bearer tokens);
        `metrics`, `access`: counted and checked calls, and `gate`: a check inside them
        (the HA controller's leader gate), all in the server's one interceptor
        (motor/service/server_calls.py); `setting`/`token_setting`: the settings named when a port cannot be bound."""
        self.bind = bind
        self.setting, self.token_setting = setting, token_setting
        self.tls = tls
        self.reflection = reflection
        self.token_bind, self.token_tls = token_bind, token_tls
        sizes = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self.server = grpc.aio.server(
            interceptors=[ServerCalls(metrics, access, gate)],
            options=list(dict([*SERVER_OPTIONS, *sizes]).items()),
        )
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = [health.SERVICE_NAME]
        self.port: int | None = None
        self.token_port: int | None = None

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, service_name: str) -> None:
        register(servicer, self.server)
        self.service_names.append(service_name)

    async def start(self) -> int:
        if self.reflection:
            reflection.enable_server_reflection([*self.service_names, reflection.SERVICE_NAME], self.server)
        port = self._listen(self.bind, self.tls, self.setting)
        if self.token_bind and self.token_tls:
            self.token_port = self._listen(self.token_bind, self.token_tls, self.token_setting)
            logger.info("bearer-token TLS port %d (%s)", self.token_port, self.token_bind)
        await self.server.start()
        self.port = port
        for name in ["", *self.service_names]:
            await self.set_serving(name, True)
        logger.info("gRPC server listening on %s (port %d, %s)", self.bind, port, "TLS" if self.tls else "plaintext")
        return port

    def _listen(self, bind: str, tls: TlsFiles | None, setting: str) -> int:
        # Checked first: gRPC says only that it failed (and logs a line of its own).
        in_use, problem = bind_problem(bind)
        if in_use:
            raise ConfigError(f"{setting}: cannot listen on {bind}: {problem}")
        try:
            port = (
                self.server.add_secure_port(bind, server_credentials(tls))
                if tls
                else self.server.add_insecure_port(bind)
            )
        except RuntimeError:
            port = 0
        if port == 0:
            raise ConfigError(
                f"{setting}: cannot listen on {bind}: {bind_problem(bind)[1] or 'in use or not available'}"
            )
        return port

    async def set_serving(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        result = self.health.set(service, status)
        if hasattr(result, "__await__"):
            await result

    async def stop(self, grace: float | None = 1.0) -> None:
        for name in ["", *self.service_names]:
            await self.set_serving(name, False)
        await self.server.stop(grace)


def bind_problem(bind: str) -> tuple[bool, str | None]:
    """(in use, why) for a TCP listener on HOST:PORT, found by binding it as gRPC would: e.g.
    (True, '127.0.0.1:50051 is in use (...)'), or (False, None) when it can be bound."""
    host, _, port = bind.rpartition(":")
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError) as exc:
        return False, f"{bind} is not a HOST:PORT this machine can listen on ({exc})"
    problem = None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True, f"{bind} is in use (another process listens there; stop it or choose another port)"
                problem = problem or f"{bind} is not available ({exc.strerror})"
    return False, problem


def service_name(pb2_module: Any, name: str) -> str:
    """Full name of a service, e.g. service_name(engine_pb2, 'EngineService') -> 'motor.v1.EngineService'."""
    return pb2_module.DESCRIPTOR.services_by_name[name].full_name
