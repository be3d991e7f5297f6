"""The leader gate inside the server's one interceptor (motor/service/server_calls.py), on a real
gRPC server with a stand-in for the election: a standby refuses a change naming the leader and
the metrics count the refusal; the leader answers, stores the change first and stamps its epoch;
a heartbeat stream is cut at the first beat after the leadership is lost.

And the handler contract the gate relies on: every call of a method is served by one handler,
built once (gRPC's generic handler answers the same object each time), and a servicer handler
that changes is wrapped again, gated as before."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from controller.ha.leader_gate import LeaderGate
from motor.leader import LEADER_METADATA
from motor.service.grpc_metrics import GrpcServerMetrics
from motor.service.grpc_server import MotorServer
from motor.service.server_calls import ServerCalls
from motor.v1 import controller_pb2, controller_pb2_grpc

C = controller_pb2
LEADER = "10.0.0.9:50051"
APPLY = "/motor.v1.ControllerService/ApplyDeployment"


class Store:
    def __init__(self) -> None:
        self.staged = 0


class Election:
    """What the gate asks of HighAvailability, with the leadership set by the test."""

    def __init__(self) -> None:
        self.leading, self.epoch, self.store, self.flushes = False, 7, Store(), []

    def is_leader(self) -> bool:
        return self.leading

    def not_leader(self) -> tuple[str, str]:
        return f"not the leader: ask {LEADER}", LEADER

    async def flush(self) -> None:
        self.flushes.append(self.store.staged)


class Servicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, ha: Election):
        self.ha = ha

    async def ApplyDeployment(self, request, context):
        self.ha.store.staged += 1  # a change staged for the store
        return C.ApplyDeploymentResponse(revision=3)

    async def RegisterNode(self, request, context):
        return C.RegisterNodeResponse()

    async def StreamHeartbeats(self, request_iterator, context):
        async for request in request_iterator:
            yield C.StreamHeartbeatsResponse(heartbeat=C.HeartbeatResponse(sequence=request.heartbeat.sequence))


def gated_interceptors(ha: Election) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of an HA controller's server, in the order its MotorServer installs them."""
    return [ServerCalls(gate=LeaderGate(ha))]


def gated_server(ha: Election, metrics: GrpcServerMetrics) -> MotorServer:
    """An HA controller's server, as controller/cli.py makes it."""
    return MotorServer("127.0.0.1:0", metrics=metrics, gate=LeaderGate(ha), reflection=False)


async def resolve(interceptors: list[grpc.aio.ServerInterceptor], method: str, handler: grpc.RpcMethodHandler):
    """The handler the server runs for a call of `method`, its servicer's handler being `handler`:
    each interceptor in order, the last one's continuation gRPC's lookup."""

    async def lookup(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return handler

    def chained(index: int):
        if index == len(interceptors):
            return lookup
        return lambda details: interceptors[index].intercept_service(chained(index + 1), details)

    return await chained(0)(_Details(method, ()))


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple):
        self.method, self.invocation_metadata = method, invocation_metadata


def _apply_handler() -> grpc.RpcMethodHandler:
    async def answer(request, context):
        return C.ApplyDeploymentResponse()

    return grpc.unary_unary_rpc_method_handler(
        answer, C.ApplyDeploymentRequest.FromString, C.ApplyDeploymentResponse.SerializeToString
    )


async def test_every_call_of_a_gated_method_is_served_by_one_handler_built_once():
    interceptors = gated_interceptors(Election())
    servicer_handler = _apply_handler()
    first = await resolve(interceptors, APPLY, servicer_handler)
    assert first is not servicer_handler  # wrapped: checked, gated, counted
    for _ in range(3):
        assert await resolve(interceptors, APPLY, servicer_handler) is first
    # A servicer handler that changes (another server's, a re-registration) is wrapped again.
    replaced = _apply_handler()
    again = await resolve(interceptors, APPLY, replaced)
    assert again is not first and again is not replaced
    assert await resolve(interceptors, APPLY, replaced) is again
    # An ungated method is wrapped once too; a method the server lacks stays unanswered.
    read = "/motor.v1.ControllerService/GetDeployment"
    assert await resolve(interceptors, read, servicer_handler) is await resolve(interceptors, read, servicer_handler)
    assert await resolve(interceptors, "/motor.v1.ControllerService/Nothing", None) is None


@pytest.fixture
async def gated():
    ha, registry = Election(), CollectorRegistry()
    metrics = GrpcServerMetrics(registry)
    server = gated_server(ha, metrics)
    server.add(controller_pb2_grpc.add_ControllerServiceServicer_to_server, Servicer(ha), "motor.v1.ControllerService")
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield ha, controller_pb2_grpc.ControllerServiceStub(channel), registry
    await server.server.stop(None)


def _handled(registry: CollectorRegistry, method: str, code: str) -> float:
    labels = dict(grpc_type="unary", grpc_service="motor.v1.ControllerService", grpc_method=method, grpc_code=code)
    return registry.get_sample_value("grpc_server_handled_total", labels) or 0.0


async def test_a_standby_refuses_a_change_naming_the_leader_and_the_leader_stores_it_first(gated):
    ha, stub, registry = gated
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ApplyDeployment(C.ApplyDeploymentRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and LEADER in refused.value.details()
    assert (LEADER_METADATA, LEADER) in tuple(refused.value.trailing_metadata())
    assert ha.store.staged == 0  # the servicer never ran
    assert _handled(registry, "ApplyDeployment", "UNAVAILABLE") == 1
    ha.leading = True
    reply = await stub.ApplyDeployment(C.ApplyDeploymentRequest(), timeout=5)
    assert reply.revision == 3 and ha.flushes == [1]  # the staged change flushed before the answer
    assert (await stub.RegisterNode(C.RegisterNodeRequest(), timeout=5)).controller_epoch == 7
    assert ha.flushes == [1]  # nothing staged: nothing to wait for
    assert _handled(registry, "ApplyDeployment", "OK") == 1


async def test_a_heartbeat_stream_is_stamped_and_cut_when_the_leadership_is_lost(gated):
    ha, stub, _ = gated
    ha.leading = True
    call = stub.StreamHeartbeats(timeout=10)
    await call.write(C.StreamHeartbeatsRequest(heartbeat=C.HeartbeatRequest(node_id="n", sequence=1)))
    reply = await call.read()
    assert reply.heartbeat.sequence == 1 and reply.heartbeat.controller_epoch == 7
    ha.leading = False
    await call.write(C.StreamHeartbeatsRequest(heartbeat=C.HeartbeatRequest(node_id="n", sequence=2)))
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        await call.read()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and LEADER in cut.value.details()
