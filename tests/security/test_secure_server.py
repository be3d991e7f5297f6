"""Authentication, certificate rotation and stream limits on a real TLS server (127.0.0.1:0)
behind the access checks; grpcurl calls it as a user would."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from motor.security.access import AccessPolicy
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority
from motor.service.grpc_server import TlsFiles, aio_channel
from motor.v1 import controller_pb2, controller_pb2_grpc
from tests.support import async_wait_for, require
from tests.support.secure_services import client, mtls_files, policy, serve, token_of


def _stub(channel):
    return controller_pb2_grpc.ControllerServiceStub(channel)


@pytest.fixture
async def token_server(dev_pki):
    served = await serve(TlsFiles(cert=dev_pki.cert("controller"), key=dev_pki.key("controller")), policy(dev_pki))
    yield served
    await served.server.stop(None)


@pytest.mark.parametrize("presented", [None, "expired", "other-ca"])
async def test_mtls_refuses_a_client_without_a_valid_certificate(mtls_server, dev_pki, odd_certs, presented):
    if presented is None:
        channel = client(dev_pki, mtls_server.port)
    else:
        cert, key = odd_certs[presented]
        channel = aio_channel(f"localhost:{mtls_server.port}", TlsFiles(cert=cert, key=key, ca=dev_pki.ca))
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _stub(channel).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    # The handshake fails before any RPC exists, so gRPC reports the connection as UNAVAILABLE.
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.services.calls == []


@pytest.mark.parametrize("presented", ["no-identity", "foreign-domain"])
async def test_a_verified_certificate_without_a_motor_identity_is_unauthenticated(
    mtls_server, dev_pki, odd_certs, presented
):
    cert, key = odd_certs[presented]
    async with aio_channel(f"localhost:{mtls_server.port}", TlsFiles(cert=cert, key=key, ca=dev_pki.ca)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _stub(channel).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "spiffe://motor/" in refused.value.details() and "URI SANs" in refused.value.details()
    assert mtls_server.services.calls == []


@pytest.mark.parametrize(
    "header, expected",
    [
        (None, "no client certificate and no 'authorization: Bearer <token>' header"),
        ("Bearer not-a-token-anybody-issued", "not in this server's tokens file"),
        ("Basic dXNlcjpwYXNz", "not in this server's tokens file"),
    ],
)
async def test_token_port_refuses_missing_or_unknown_tokens(token_server, dev_pki, header, expected):
    metadata = (("authorization", header),) if header else ()
    async with client(dev_pki, token_server.port) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _stub(channel).ListNodes(controller_pb2.ListNodesRequest(), metadata=metadata, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert expected in refused.value.details()


async def test_health_stays_open_and_reflection_is_a_setting(dev_pki, token_server):
    async with client(dev_pki, token_server.port) as channel:  # no certificate, no token
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    quiet = await serve(
        TlsFiles(cert=dev_pki.cert("controller"), key=dev_pki.key("controller")), policy(dev_pki), reflection=False
    )
    try:
        for port, offered in [(token_server.port, True), (quiet.port, False)]:
            async with client(dev_pki, port) as channel:
                stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                )
                if offered:
                    names = [s.name for s in (await stream.read()).list_services_response.service]
                    assert "motor.v1.ControllerService" in names
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as missing:
                        await stream.read()
                    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
                stream.cancel()
    finally:
        await quiet.server.stop(None)


async def test_plaintext_mode_gives_every_caller_every_role(dev_pki):
    served = await serve(None, AccessPolicy(secure=False))
    try:
        async with aio_channel(f"127.0.0.1:{served.port}") as channel:
            await _stub(channel).ApplyDeployment(controller_pb2.ApplyDeploymentRequest(), timeout=10)
            await _stub(channel).Heartbeat(controller_pb2.HeartbeatRequest(node_id="node-b"), timeout=10)
        assert served.services.calls == ["ApplyDeployment", "Heartbeat"]
    finally:
        await served.server.stop(None)


async def test_streams_per_caller_are_limited_and_released(dev_pki):
    served = await serve(mtls_files(dev_pki), policy(dev_pki, max_streams_per_caller=2))
    try:
        async with (
            client(dev_pki, served.port, "viewer") as viewer,
            client(dev_pki, served.port, "operator") as operator,
        ):
            streams = [_stub(viewer).WatchEvents(controller_pb2.WatchEventsRequest()) for _ in range(2)]
            for stream in streams:
                await stream.read()
            third = _stub(viewer).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await third.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                "max_streams_per_caller=2" in refused.value.details()
                and "spiffe://motor/viewer/viewer" in refused.value.details()
            )
            other = _stub(operator).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=10)  # another caller
            await other.read()
            other.cancel()
            streams[0].cancel()
            await async_wait_for(
                lambda: served.access.open_streams.get("spiffe://motor/viewer/viewer") == 1, what="stream released"
            )
            again = _stub(viewer).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=10)
            await again.read()
            again.cancel()
            streams[1].cancel()
    finally:
        await served.server.stop(None)


def _served_certificate(port: int, pki) -> x509.Certificate:
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(pki.cert("viewer"), pki.key("viewer"))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


async def test_a_rotated_server_certificate_is_served_without_a_restart_and_open_streams_continue(dev_pki, tmp_path):
    cert, key = (
        CertificateAuthority.load(dev_pki.directory)
        .issue(Identity("controller"), ["localhost"])
        .save(str(tmp_path), "server")
    )
    served = await serve(TlsFiles(cert=cert, key=key, ca=dev_pki.ca, require_client_cert=True), policy(dev_pki))
    try:
        before = await asyncio.to_thread(_served_certificate, served.port, dev_pki)
        async with client(dev_pki, served.port, "viewer") as channel:
            stream = _stub(channel).WatchEvents(controller_pb2.WatchEventsRequest())
            await stream.read()
            # Rotate: a new key pair replaces both files (each in one rename).
            CertificateAuthority.load(dev_pki.directory).issue(Identity("controller"), ["localhost"]).save(
                str(tmp_path), "server"
            )
            after = await asyncio.to_thread(_served_certificate, served.port, dev_pki)
            assert after.serial_number != before.serial_number
            with open(cert, "rb") as handle:
                assert after == x509.load_pem_x509_certificate(handle.read())
            served.services.push()
            await asyncio.wait_for(stream.read(), 10)  # the stream opened before the rotation still delivers
            stream.cancel()
            async with client(dev_pki, served.port, "viewer") as fresh:  # and new connections handshake with it
                await _stub(fresh).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    finally:
        await served.server.stop(None)


async def test_a_half_written_rotation_keeps_serving_the_previous_pair(dev_pki, tmp_path):
    ca = CertificateAuthority.load(dev_pki.directory)
    cert, key = ca.issue(Identity("controller"), ["localhost"]).save(str(tmp_path), "server")
    served = await serve(TlsFiles(cert=cert, key=key, ca=dev_pki.ca, require_client_cert=True), policy(dev_pki))
    try:
        before = await asyncio.to_thread(_served_certificate, served.port, dev_pki)
        newer = ca.issue(Identity("controller"), ["localhost"])
        with open(cert, "wb") as handle:  # the certificate lands, its key not yet
            handle.write(newer.cert_pem)
        still = await asyncio.to_thread(_served_certificate, served.port, dev_pki)
        assert still.serial_number == before.serial_number
        newer.save(str(tmp_path), "server")
        after = await asyncio.to_thread(_served_certificate, served.port, dev_pki)
        assert after.serial_number == newer.certificate.serial_number
    finally:
        await served.server.stop(None)


@pytest.mark.parametrize("damage", [b"", b"-----BEGIN CERTIFICATE-----\nMIIB", b"not a certificate"])
async def test_an_emptied_or_garbled_ca_bundle_keeps_serving_the_previous_one(dev_pki, tmp_path, caplog, damage):
    """Hostile F14: a half-written CA bundle (a hand edit, a secret mounted mid-update) made every
    new handshake fail with nothing but an INFO line; now it is refused with an ERROR naming it."""
    ca_copy = tmp_path / "ca.crt"
    ca_copy.write_bytes(open(dev_pki.ca, "rb").read())
    cert, key = (
        CertificateAuthority.load(dev_pki.directory)
        .issue(Identity("controller"), ["localhost"])
        .save(str(tmp_path), "server")
    )
    served = await serve(TlsFiles(cert=cert, key=key, ca=str(ca_copy), require_client_cert=True), policy(dev_pki))
    try:
        ca_copy.write_bytes(damage)
        for _ in range(3):  # new connections, each asking for the credentials again
            async with client(dev_pki, served.port, "viewer") as channel:
                await _stub(channel).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "ca.crt" in r.getMessage()]
        assert len(errors) == 1 and "holds no PEM certificate" in errors[0].getMessage(), [
            r.getMessage() for r in errors
        ]
    finally:
        await served.server.stop(None)


async def test_oversized_messages_are_refused_naming_the_limit(dev_pki):
    from motor.service.grpc_server import MAX_MESSAGE_BYTES

    served = await serve(None, AccessPolicy(secure=False))
    try:
        async with aio_channel(f"127.0.0.1:{served.port}", options={"grpc.max_send_message_length": -1}) as channel:
            huge = controller_pb2.ReportEngineEventRequest(node_id="node-a", reason="x" * (MAX_MESSAGE_BYTES + 1))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _stub(channel).ReportEngineEvent(huge, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_MESSAGE_BYTES) in refused.value.details()
        assert served.services.calls == []
    finally:
        await served.server.stop(None)


def _grpcurl() -> str:
    path = shutil.which("grpcurl", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    require(path is not None, "grpcurl")
    return path


@pytest.mark.processes
async def test_grpcurl_with_a_client_certificate_or_a_token(dev_pki, mtls_server, token_server):
    grpcurl = _grpcurl()

    async def run(*args: str) -> subprocess.CompletedProcess:
        return await asyncio.to_thread(
            subprocess.run, [grpcurl, "-cacert", dev_pki.ca, *args], capture_output=True, text=True, timeout=30
        )

    viewer_cert = ["-cert", dev_pki.cert("viewer"), "-key", dev_pki.key("viewer")]
    listed = await run(*viewer_cert, f"localhost:{mtls_server.port}", "motor.v1.ControllerService/ListNodes")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {}
    applied = await run(
        *viewer_cert, "-d", "{}", f"localhost:{mtls_server.port}", "motor.v1.ControllerService/ApplyDeployment"
    )
    assert applied.returncode != 0 and "PermissionDenied" in applied.stderr and "needs role operator" in applied.stderr

    bearer = ["-H", f"authorization: Bearer {token_of(dev_pki, 'operator')}"]
    applied = await run(
        *bearer, "-d", "{}", f"127.0.0.1:{token_server.port}", "motor.v1.ControllerService/ApplyDeployment"
    )
    assert applied.returncode == 0, applied.stderr
    anonymous = await run(f"127.0.0.1:{token_server.port}", "motor.v1.ControllerService/ListNodes")
    assert anonymous.returncode != 0 and "Unauthenticated" in anonymous.stderr
    assert token_server.services.calls == ["ApplyDeployment"]


@pytest.mark.parametrize("method", ["ListNodes", "StreamHeartbeats"])
async def test_an_undecodable_request_from_anyone_is_invalid_argument_not_unknown(
    token_server, mtls_server, dev_pki, method
):
    """gRPC decodes a unary request before any interceptor runs, so even a caller without a token
    gets the decoding answer (it used to be UNKNOWN, 'Wire format was corrupt'); a stream is
    authenticated when it opens, before its first message is read."""
    corrupt = b"\xff\xff\xff\xff\x0f"
    for port, name in [(token_server.port, None), (mtls_server.port, "node-a")]:
        anonymous_stream = name is None and method == "StreamHeartbeats"
        async with client(dev_pki, port, name) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                path = f"/motor.v1.ControllerService/{method}"
                if method == "StreamHeartbeats":
                    call = channel.stream_stream(path)(iter([corrupt]), timeout=10)
                    await call.read()
                else:
                    await channel.unary_unary(path)(corrupt, timeout=10)
        if anonymous_stream:
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
            continue
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert refused.value.details().startswith("request could not be decoded: ")
    assert "ListNodes" not in token_server.services.calls + mtls_server.services.calls
