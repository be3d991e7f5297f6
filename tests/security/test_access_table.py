"""The access table, exercised as a table: every Motor RPC, called by every kind of caller over a
real TLS connection (certificates from motor/security/pki.py, tokens from a tokens file), is allowed
exactly for the roles docs/security.md lists, and refused with PERMISSION_DENIED otherwise."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from motor.security.access import ACCESS_TABLE
from motor.service.grpc_server import TlsFiles
from tests.support.secure_services import (
    SERVICES,
    client,
    method_path,
    mtls_files,
    policy,
    request_class,
    response_class,
    serve,
    token_of,
)

CERT_CALLERS = ["controller", "node-a", "node-b", "operator", "viewer", "router-sync"]
TOKEN_CALLERS = ["operator-token", "viewer-token"]
READERS = {"operator", "viewer", "operator-token", "viewer-token"}

# Who may call what (the engine server under test belongs to node-a). Requests name node-a.
EXPECTED = {
    "ControllerService/RegisterNode": {"node-a"},
    "ControllerService/Heartbeat": {"node-a"},
    "ControllerService/StreamHeartbeats": {"node-a"},
    "ControllerService/ReportEngineEvent": {"node-a"},
    "ControllerService/ApplyDeployment": {"operator", "operator-token"},
    "ControllerService/DeleteDeployment": {"operator", "operator-token"},
    "ControllerService/PauseRollout": {"operator", "operator-token"},
    "ControllerService/ResumeRollout": {"operator", "operator-token"},
    "ControllerService/UndoRollout": {"operator", "operator-token"},
    "ControllerService/GetDeployment": READERS,
    "ControllerService/ListDeployments": READERS,
    "ControllerService/ListNodes": READERS,
    "ControllerService/ListInstances": READERS,
    "ControllerService/ListEndpoints": READERS | {"router-sync"},
    "ControllerService/WatchEvents": READERS,
    "ControllerService/WatchEndpoints": READERS | {"router-sync"},
    "ControllerService/ListControllers": READERS,
    "ControllerService/ReportFrontDoor": {"router-sync"},
    "NodeManagerService/StartEngine": {"controller"},
    "NodeManagerService/StopEngine": {"controller"},
    "NodeManagerService/GetEngine": READERS | {"controller"},
    "NodeManagerService/ListEngines": READERS | {"controller"},
    "NodeManagerService/WatchEngines": READERS | {"controller"},
    "EngineService/Drain": {"node-a"},
    "EngineService/Sleep": {"node-a"},
    "EngineService/WakeUp": {"node-a"},
    "EngineService/GetStatus": READERS | {"node-a"},
    "EngineService/WatchProbes": READERS | {"node-a"},
}

METHODS = [m for service in SERVICES for m in service.methods]


def test_every_rpc_of_every_service_has_a_rule_and_an_expectation():
    served = {method_path(m) for m in METHODS}
    assert served <= set(ACCESS_TABLE), f"methods without a rule: {served - set(ACCESS_TABLE)}"
    assert {f"{m.containing_service.name}/{m.name}" for m in METHODS} == set(EXPECTED)
    for service in (
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    ):
        for method in service.methods:
            assert method_path(method) in ACCESS_TABLE


def _request(method):
    request = request_class(method)()
    if method.name == "RegisterNode":
        request.node.node_id = "node-a"
    elif method.name in ("Heartbeat", "ReportEngineEvent"):
        request.node_id = "node-a"
    elif method.name == "StreamHeartbeats":
        request.heartbeat.node_id = "node-a"
    return request


async def _call(channel, method, metadata=()):
    path = method_path(method)
    kwargs = dict(
        request_serializer=request_class(method).SerializeToString,
        response_deserializer=response_class(method).FromString,
    )
    if method.client_streaming:
        call = channel.stream_stream(path, **kwargs)(iter([_request(method)]), metadata=metadata, timeout=10)
        await call.read()
        call.cancel()
    elif method.server_streaming:
        call = channel.unary_stream(path, **kwargs)(_request(method), metadata=metadata, timeout=10)
        await call.read()
        call.cancel()
    else:
        await channel.unary_unary(path, **kwargs)(_request(method), metadata=metadata, timeout=10)


@pytest.fixture(scope="module")
async def servers(dev_pki):
    """An mTLS server (identities from certificates) and a TLS server for bearer tokens."""
    mtls = await serve(mtls_files(dev_pki), policy(dev_pki, local_node="node-a"))
    tokens = await serve(
        TlsFiles(cert=dev_pki.cert("controller"), key=dev_pki.key("controller")), policy(dev_pki, local_node="node-a")
    )
    yield mtls, tokens
    await mtls.server.stop(None)
    await tokens.server.stop(None)


@pytest.mark.parametrize("caller", CERT_CALLERS + TOKEN_CALLERS)
async def test_each_caller_reaches_exactly_the_methods_of_its_role(servers, dev_pki, caller):
    mtls, tokens = servers
    if caller in TOKEN_CALLERS:
        channel = client(dev_pki, tokens.port)
        metadata = (("authorization", f"Bearer {token_of(dev_pki, caller.removesuffix('-token'))}"),)
        shown = f"token:{caller.removesuffix('-token')}"
    else:
        channel = client(dev_pki, mtls.port, caller)
        metadata = ()
        shown = "spiffe://motor/" + (
            "controller"
            if caller == "controller"
            else f"node/{caller}"
            if caller.startswith("node")
            else f"{caller}/{caller}"
        )
    wrong = []
    async with channel:
        for method in METHODS:
            key = f"{method.containing_service.name}/{method.name}"
            try:
                await _call(channel, method, metadata)
                outcome = "allowed"
            except grpc.aio.AioRpcError as exc:
                outcome = exc.code().name
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    assert shown in exc.details() and "needs role" in exc.details(), exc.details()
            expected = "allowed" if caller in EXPECTED[key] else "PERMISSION_DENIED"
            if outcome != expected:
                wrong.append(f"{key}: {outcome}, expected {expected}")
    assert not wrong, "\n".join(wrong)


async def test_a_node_may_act_only_for_itself(servers, dev_pki):
    mtls, _ = servers
    async with client(dev_pki, mtls.port, "node-a") as channel:
        heartbeat = next(m for m in METHODS if m.name == "Heartbeat")
        request = request_class(heartbeat)(node_id="node-b", generation=3)
        call = channel.unary_unary(
            method_path(heartbeat),
            request_serializer=request.SerializeToString,
            response_deserializer=response_class(heartbeat).FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = refused.value.details()
    assert "spiffe://motor/node/node-a" in details and "node:node-b" in details and "node_id='node-b'" in details


async def test_a_refusal_quotes_the_node_id_of_the_request_short_and_escaped(servers, dev_pki):
    """The role a refusal names comes from the request: 'node-a\\n' and a 1 MB id are quoted as
    excerpts (no raw newline in the message, no megabyte echoed back)."""
    mtls, _ = servers
    heartbeat = next(m for m in METHODS if m.name == "Heartbeat")
    async with client(dev_pki, mtls.port, "node-b") as channel:
        call = channel.unary_unary(
            method_path(heartbeat),
            request_serializer=request_class(heartbeat).SerializeToString,
            response_deserializer=response_class(heartbeat).FromString,
        )
        for node_id, quoted in [("node-a\n", "node:'node-a\\n'"), ("n" * (1 << 20), "(1048576 characters)")]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request_class(heartbeat)(node_id=node_id, generation=3), timeout=10)
            details = refused.value.details()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, details[:300]
            assert "\n" not in details and len(details) < 1000 and quoted in details, details[:300]


async def test_a_node_may_stream_only_its_own_heartbeats(servers, dev_pki):
    mtls, _ = servers
    stream = next(m for m in METHODS if m.name == "StreamHeartbeats")
    async with client(dev_pki, mtls.port, "node-a") as channel:
        call = channel.stream_stream(
            method_path(stream),
            request_serializer=request_class(stream).SerializeToString,
            response_deserializer=response_class(stream).FromString,
        )(timeout=10)
        await call.write(request_class(stream)(heartbeat={"node_id": "node-a"}))
        await call.read()  # its own heartbeat: answered
        await call.write(request_class(stream)(heartbeat={"node_id": "node-b", "generation": 3}))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
            await call
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = refused.value.details()
    assert "spiffe://motor/node/node-a" in details and "heartbeat.node_id='node-b'" in details


async def test_a_node_is_not_the_node_manager_of_another_nodes_engines(servers, dev_pki):
    mtls, _ = servers
    drain = next(m for m in METHODS if m.name == "Drain")
    async with client(dev_pki, mtls.port, "node-b") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _call(channel, drain)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "node-manager" in refused.value.details() and "spiffe://motor/node/node-b" in refused.value.details()
