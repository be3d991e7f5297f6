"""Every Motor service behind the real secure server with empty servicers, the access policy, and
clients with the dev PKI's identities."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory

from motor.security.access import AccessControl, AccessPolicy
from motor.security.tokens import TokenStore
from motor.service.grpc_metrics import GrpcServerMetrics
from motor.service.grpc_server import MotorServer, TlsFiles, aio_channel
from motor.v1 import controller_pb2, engine_pb2, node_manager_pb2
from motorctl.pki_command import DevPki

SERVICES = [
    controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
    node_manager_pb2.DESCRIPTOR.services_by_name["NodeManagerService"],
    engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
]


def method_path(method: Any) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def request_class(method: Any) -> Any:
    return message_factory.GetMessageClass(method.input_type)


def response_class(method: Any) -> Any:
    return message_factory.GetMessageClass(method.output_type)


class EmptyServices:
    """Every RPC of SERVICES answers an empty response (ApplyDeployment echoes the deployment);
    streams send one, then one more at each `push`."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.queues: list[asyncio.Queue] = []

    def push(self) -> None:
        for queue in self.queues:
            queue.put_nowait(None)

    def _unary(self, method: Any):
        async def answer(request, context):
            self.calls.append(method.name)
            response = response_class(method)()
            if method.name == "ApplyDeployment":  # clients print the deployment they get back
                response.deployment.CopyFrom(request.deployment)
            return response

        return answer

    def _stream(self, method: Any):
        async def answer(request, context):
            self.calls.append(method.name)
            queue: asyncio.Queue = asyncio.Queue()
            self.queues.append(queue)
            try:
                yield response_class(method)()
                while True:
                    await queue.get()
                    yield response_class(method)()
            finally:
                self.queues.remove(queue)

        return answer

    def _bidi(self, method: Any):
        async def answer(requests, context):  # one answer per message (StreamHeartbeats)
            self.calls.append(method.name)
            async for _ in requests:
                yield response_class(method)()

        return answer

    def register(self, server: MotorServer) -> None:
        for service in SERVICES:
            handlers = {}
            for method in service.methods:
                if method.client_streaming:
                    make, behaviour = grpc.stream_stream_rpc_method_handler, self._bidi(method)
                elif method.server_streaming:
                    make, behaviour = grpc.unary_stream_rpc_method_handler, self._stream(method)
                else:
                    make, behaviour = grpc.unary_unary_rpc_method_handler, self._unary(method)
                handlers[method.name] = make(
                    behaviour,
                    request_deserializer=request_class(method).FromString,
                    response_serializer=response_class(method).SerializeToString,
                )
            generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
            server.add(lambda _, s, g=generic: s.add_generic_rpc_handlers((g,)), None, service.full_name)


@dataclass
class Served:
    server: MotorServer
    services: EmptyServices
    port: int
    access: AccessControl
    extra_ports: list[int] = field(default_factory=list)


async def serve(
    tls: TlsFiles | None,
    policy: AccessPolicy,
    bind: str = "127.0.0.1:0",
    reflection: bool = True,
    metrics: GrpcServerMetrics | None = None,
) -> Served:
    access = AccessControl(policy)
    server = MotorServer(bind, tls=tls, access=access, reflection=reflection, metrics=metrics)
    services = EmptyServices()
    services.register(server)
    port = await server.start()
    return Served(server, services, port, access)


def mtls_files(pki: DevPki, name: str = "controller") -> TlsFiles:
    return TlsFiles(cert=pki.cert(name), key=pki.key(name), ca=pki.ca, require_client_cert=True)


def client(pki: DevPki, port: int, name: str | None = None, host: str = "localhost") -> grpc.aio.Channel:
    """A TLS channel trusting the dev CA, presenting `name`'s certificate when given."""
    files = TlsFiles(cert=pki.cert(name), key=pki.key(name), ca=pki.ca) if name else TlsFiles(ca=pki.ca)
    return aio_channel(f"{host}:{port}", files)


def token_of(pki: DevPki, name: str) -> str:
    with open(pki.token_file(name)) as handle:
        return handle.read().strip()


def policy(pki: DevPki, **kw: Any) -> AccessPolicy:
    return AccessPolicy(secure=True, tokens=TokenStore(pki.tokens), **kw)
