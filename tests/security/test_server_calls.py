"""The one interceptor of every Motor server (motor/service/server_calls.py) on a real mutual-TLS
server: a heartbeat stream's every message is checked, the refusals end the stream with the code
a caller acts on, the metrics count each call with that code, and a stream's slot is given back."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from motor.security.access import AccessControl
from motor.service.grpc_metrics import GrpcServerMetrics
from motor.service.grpc_server import MotorServer
from tests.support import async_wait_for
from tests.support.secure_services import SERVICES, client, mtls_files, policy, request_class, response_class, serve

HEARTBEATS = "/motor.v1.ControllerService/StreamHeartbeats"
STREAM_LABELS = dict(grpc_type="bidi_stream", grpc_service="motor.v1.ControllerService", grpc_method="StreamHeartbeats")


@pytest.fixture
async def counted(dev_pki):
    registry = CollectorRegistry()
    served = await serve(mtls_files(dev_pki), policy(dev_pki), metrics=GrpcServerMetrics(registry))
    yield served, registry
    await served.server.stop(None)


def handled(registry: CollectorRegistry, code: str) -> float:
    return registry.get_sample_value("grpc_server_handled_total", {**STREAM_LABELS, "grpc_code": code}) or 0.0


async def test_each_message_of_a_heartbeat_stream_is_checked_counted_and_its_slot_given_back(counted, dev_pki):
    served, registry = counted
    stream = SERVICES[0].methods_by_name["StreamHeartbeats"]
    beat = request_class(stream)
    async with client(dev_pki, served.port, "node-a") as channel:
        open_call = channel.stream_stream(
            HEARTBEATS,
            request_serializer=beat.SerializeToString,
            response_deserializer=response_class(stream).FromString,
        )
        # Several beats of its own node: each answered (the wrapped handler serves every call).
        for _ in range(2):
            call = open_call(timeout=10)
            for _ in range(3):
                await call.write(beat(heartbeat={"node_id": "node-a"}))
                await call.read()
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
        # Another node's beat after its own: PERMISSION_DENIED, at that message.
        call = open_call(timeout=10)
        await call.write(beat(heartbeat={"node_id": "node-a"}))
        await call.read()
        await call.write(beat(heartbeat={"node_id": "node-b"}))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A corrupt message mid-stream: INVALID_ARGUMENT, before the servicer sees it.
        raw = channel.stream_stream(HEARTBEATS)(timeout=10)
        await raw.write(beat(heartbeat={"node_id": "node-a"}).SerializeToString())
        await raw.read()
        await raw.write(b"\xff\xff\xff\xff\x0f")
        with pytest.raises(grpc.aio.AioRpcError) as corrupt:
            await raw.read()
        assert corrupt.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert corrupt.value.details().startswith("request could not be decoded: ")
    await async_wait_for(lambda: handled(registry, "INVALID_ARGUMENT") == 1, what="the corrupt stream counted")
    assert registry.get_sample_value("grpc_server_started_total", STREAM_LABELS) == 4
    assert handled(registry, "OK") == 2 and handled(registry, "PERMISSION_DENIED") == 1
    assert served.access.open_streams == {}  # every stream's slot given back
    assert served.services.calls.count("StreamHeartbeats") == 4


async def test_a_client_streaming_method_is_checked_too(dev_pki):
    """Motor serves no client-streaming method yet; one added later is refused like any method
    missing from the access table, not let through unchecked."""

    async def upload(requests, context):
        async for _ in requests:
            pass
        return b""

    server = MotorServer("127.0.0.1:0", tls=mtls_files(dev_pki), access=AccessControl(policy(dev_pki)))
    server.server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Uploads", {"Upload": grpc.stream_unary_rpc_method_handler(upload)})]
    )
    port = await server.start()
    try:
        async with client(dev_pki, port, "operator") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.stream_unary("/test.Uploads/Upload")(iter([b"a", b"b"]), timeout=10)
    finally:
        await server.stop(None)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "/test.Uploads/Upload is not in the access table" in refused.value.details()
