"""The settings every service shares: secure defaults, coherent TLS files, one server with a
certificate port and a bearer-token port."""

from __future__ import annotations

import logging

import grpc
import pytest

from motor.errors import ConfigError
from motor.security.security_config import SecuritySettings, is_loopback
from motor.service.config import validate
from motor.v1 import controller_pb2, controller_pb2_grpc
from tests.support.secure_services import EmptyServices, client, token_of


@pytest.mark.parametrize(
    "bind, loopback",
    [
        ("127.0.0.1:50051", True),
        ("127.3.4.5:1", True),
        ("localhost:0", True),
        ("[::1]:50051", True),
        ("0.0.0.0:50051", False),
        ("[::]:50051", False),
        (":50051", False),
        ("10.0.0.7:50051", False),
        ("node-a:50052", False),
    ],
)
def test_loopback_addresses(bind, loopback):
    assert is_loopback(bind) is loopback


def test_plaintext_on_the_network_is_refused_unless_insecure_which_warns(caplog, dev_pki):
    with pytest.raises(ConfigError) as refused:
        SecuritySettings().check_listen("0.0.0.0:50052")
    assert "listen: 0.0.0.0:50052 is not a loopback address" in str(refused.value) and "--insecure" in str(
        refused.value
    )
    with caplog.at_level(logging.WARNING):
        SecuritySettings(insecure=True).check_listen("0.0.0.0:50052")
    assert "INSECURE: serving plaintext on 0.0.0.0:50052" in caplog.text
    SecuritySettings().check_listen("127.0.0.1:50052")  # a developer's loopback cluster
    tls = SecuritySettings(tls_cert=dev_pki.cert("node-a"), tls_key=dev_pki.key("node-a"), tls_ca=dev_pki.ca)
    tls.check_listen("0.0.0.0:50052")


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"tls_cert": "{cert}"}, "tls_cert and tls_key go together"),
        ({"tls_cert": "{cert}", "tls_key": "{key}"}, "tls_ca: required with tls_cert"),
        ({"tls_ca": "{ca}"}, "tls_cert/tls_key: required with tls_ca"),
        (
            {"tls_cert": "{cert}", "tls_key": "{key}", "tls_ca": "{ca}", "token_listen": "127.0.0.1:0"},
            "token_listen: needs",
        ),
        ({"tls_ca": "/nonexistent/ca.crt"}, "tls_ca: cannot read '/nonexistent/ca.crt'"),
        ({"max_streams_per_caller": 0}, "max_streams_per_caller"),
    ],
)
def test_incoherent_settings_name_the_setting(dev_pki, settings, named):
    files = {"cert": dev_pki.cert("controller"), "key": dev_pki.key("controller"), "ca": dev_pki.ca}
    data = {k: v.format(**files) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ConfigError) as refused:
        validate(SecuritySettings, data, source="test")
    assert named in str(refused.value)


async def test_one_server_with_a_certificate_port_and_a_token_port(dev_pki):
    settings = SecuritySettings(
        tls_cert=dev_pki.cert("controller"),
        tls_key=dev_pki.key("controller"),
        tls_ca=dev_pki.ca,
        tokens_file=dev_pki.tokens,
        token_listen="127.0.0.1:0",
        reflection=False,
    )
    server = settings.server("0.0.0.0:0")
    services = EmptyServices()
    services.register(server)
    port = await server.start()
    try:
        async with client(dev_pki, port, "viewer") as by_cert:
            await controller_pb2_grpc.ControllerServiceStub(by_cert).ListNodes(
                controller_pb2.ListNodesRequest(), timeout=10
            )
        bearer = (("authorization", f"Bearer {token_of(dev_pki, 'operator')}"),)
        async with client(dev_pki, server.token_port) as by_token:
            stub = controller_pb2_grpc.ControllerServiceStub(by_token)
            await stub.ApplyDeployment(controller_pb2.ApplyDeploymentRequest(), metadata=bearer, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                await stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert services.calls == ["ListNodes", "ApplyDeployment"]
    finally:
        await server.stop(None)
