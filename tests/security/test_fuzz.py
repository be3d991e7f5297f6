"""Property-based fuzzing of every RPC of the three services (hypothesis): random and boundary
messages (strings with NUL and newlines, huge strings, unknown enum numbers, extreme integers)
against a real local cluster (controller, two node managers, the example deployment on sim
engines). No call may end in UNKNOWN or INTERNAL, every refusal names a field of the request,
and every server keeps serving."""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings

from motor.ports import free_port
from motor.v1 import controller_pb2, controller_pb2_grpc, engine_pb2, node_manager_pb2, types_pb2
from motorctl.up import LocalCluster
from tests.grpcurl.services import start_engine_server
from tests.security.messages import field_names, messages
from tests.support import REPO_ROOT, wait_for

SERVICES = {
    "controller": controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
    "node": node_manager_pb2.DESCRIPTOR.services_by_name["NodeManagerService"],
    "engine": engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
}
CASES = [(target, method) for target, service in SERVICES.items() for method in service.methods]
EXAMPLES = int(os.environ.get("MOTOR_FUZZ_EXAMPLES", "60"))
# Codes that say "the server is broken", never an answer to bad input.
BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp("fuzz")), nodes=2, controller_port=free_port(), heartbeat_interval=0.5,
        engine_port_base=23000, deployment_path=os.path.join(REPO_ROOT, "examples", "local-deployment.yaml"),
    )
    try:
        cluster.start(timeout=90)
        with grpc.insecure_channel(cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)

            def engine_address():
                for instance in stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances:
                    for engine in instance.engines:
                        if engine.mgmt_port and engine.health == types_pb2.HEALTH_STATUS_NORMAL:
                            return f"127.0.0.1:{engine.mgmt_port}"
                return None

            wait_for(engine_address, timeout=120, interval=0.5, what="a running engine")
        # A standalone engine server: fuzzing the controller and node manager moves the cluster's engines.
        engine, engine_address = start_engine_server(str(tmp_path_factory.mktemp("engine")))
        yield {"controller": cluster.controller_address, "node": f"127.0.0.1:{cluster.node_ports['node-a']}", "engine": engine_address}
        engine.stop()
    finally:
        problems = cluster.stop()
        assert not problems, problems


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("target, method", CASES, ids=[f"{t}-{m.name}" for t, m in CASES])
def test_random_requests_get_a_clear_answer_and_the_server_keeps_serving(cluster, target, method):
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    names = field_names(method.input_type)
    address = cluster[target]
    path = f"/{method.containing_service.full_name}/{method.name}"
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]) as channel:
        if method.server_streaming:
            call = channel.unary_stream(path, request_serializer=request_type.SerializeToString, response_deserializer=response_type.FromString)
        else:
            call = channel.unary_unary(path, request_serializer=request_type.SerializeToString, response_deserializer=response_type.FromString)

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(messages(method.input_type))
        def one_request(request):
            try:
                if method.server_streaming:
                    stream = call(request, timeout=20)
                    next(stream)
                    stream.cancel()
                else:
                    call(request, timeout=20)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                assert code not in BROKEN, f"{method.name}({request!r:.300}) -> {code.name}: {details}"
                assert not names or any(name in details for name in names), (
                    f"{method.name} -> {code.name}: {details!r} names no field of {method.input_type.name}"
                )

        one_request()
    assert _serving(address)
