"""TLS on the management plane, with a CA, server and client certificates made by the test."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.support.engine_server_process import sim_config

pytestmark = pytest.mark.processes

NORMAL = types_pb2.HEALTH_STATUS_NORMAL


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, issuer_key, issuer_name, key, *, ca: bool, usage=None, sans=()):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, cert=None, key=None):
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a stranger's."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("motor test CA", ca_key, _name("motor test CA"), ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "engine-server", ca_key, ca.subject, server_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )  # fmt: skip
    client = _issue("node-manager", ca_key, ca.subject, client_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    rogue = _issue("rogue", rogue_key, _name("rogue"), rogue_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {
        "ca": _write(folder / "ca.pem", ca),
        "server_cert": _write(folder / "server.pem", server),
        "server_key": _write(folder / "server.key", key=server_key),
        "client_cert": _write(folder / "client.pem", client),
        "client_key": _write(folder / "client.key", key=client_key),
        "rogue_cert": _write(folder / "rogue.pem", rogue),
        "rogue_key": _write(folder / "rogue.key", key=rogue_key),
    }


def _read(path):
    with open(path, "rb") as handle:
        return handle.read()


def _call(port: int, credentials: grpc.ChannelCredentials | None):
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=5).status


def _tls_config(pki, with_ca: bool) -> dict:
    tls = {"enable_tls": True, "cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    if with_ca:
        tls["ca_file"] = pki["ca"]
    return sim_config(mgmt_tls_config=tls)


def _wait_up(es, credentials):
    from tests.support import wait_for

    return wait_for(lambda: _call(es.mgmt_port, credentials).status == NORMAL, timeout=30, what="NORMAL over TLS")


def test_tls_server_refuses_plaintext_and_serves_tls_clients(engine_server, pki):
    es = engine_server(_tls_config(pki, with_ca=False))
    tls_client = grpc.ssl_channel_credentials(root_certificates=_read(pki["ca"]))
    _wait_up(es, tls_client)
    with pytest.raises(grpc.RpcError) as error:
        _call(es.mgmt_port, None)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the server's CA refuses the connection as well.
    stranger = grpc.ssl_channel_credentials(root_certificates=_read(pki["rogue_cert"]))
    with pytest.raises(grpc.RpcError):
        _call(es.mgmt_port, stranger)


def test_with_ca_file_the_server_requires_a_client_certificate_it_signed(engine_server, pki):
    es = engine_server(_tls_config(pki, with_ca=True))
    ca = _read(pki["ca"])
    signed = grpc.ssl_channel_credentials(ca, _read(pki["client_key"]), _read(pki["client_cert"]))
    _wait_up(es, signed)
    for credentials in (
        grpc.ssl_channel_credentials(ca),  # no client certificate
        grpc.ssl_channel_credentials(ca, _read(pki["rogue_key"]), _read(pki["rogue_cert"])),  # not signed by the CA
    ):
        with pytest.raises(grpc.RpcError) as error:
            _call(es.mgmt_port, credentials)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
