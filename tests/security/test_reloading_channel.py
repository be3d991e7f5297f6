"""motor/security/channels.py on a real mutual-TLS server: a kept channel follows its rotated client files,
a call running on the old channel is not cut, and a half-written rotation is not used."""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import re
import shutil

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from motor.errors import ConfigError
from motor.security.channels import ReloadingChannel
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority, write_atomically
from motor.service.grpc_server import TlsFiles
from motor.service.tls import TlsFileWatch
from motor.v1 import controller_pb2, controller_pb2_grpc

Stub = controller_pb2_grpc.ControllerServiceStub


@pytest.fixture
def client_files(dev_pki, tmp_path) -> TlsFiles:
    """The viewer's files, copied: the test rotates them."""
    return TlsFiles(
        cert=shutil.copy(dev_pki.cert("viewer"), tmp_path),
        key=shutil.copy(dev_pki.key("viewer"), tmp_path),
        ca=shutil.copy(dev_pki.ca, tmp_path),
    )


async def test_a_rotated_client_certificate_makes_a_new_channel_and_calls_on_the_old_one_finish(
    mtls_server, dev_pki, client_files, tmp_path
):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        first = kept.stub(Stub)
        assert kept.stub(Stub) is first  # unchanged files: the same stub, no new channel
        stream = first.WatchEvents(controller_pb2.WatchEventsRequest())
        await stream.read()

        # A node's certificate, which may not list nodes: the new channel presents it (refused),
        # which shows it is the one in use, while the stream on the old channel goes on.
        ca = CertificateAuthority.load(dev_pki.directory)
        ca.issue(Identity("node", "node-a"), []).save(str(tmp_path), "viewer")
        refused_stub = kept.stub(Stub)
        assert refused_stub is not first and kept.replaced == 1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await refused_stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        mtls_server.services.push()
        await asyncio.wait_for(stream.read(), 10)  # the call in flight on the old channel was not cut

        # Rotated again, to a viewer: calls work on the newest channel.
        ca.issue(Identity("viewer", "viewer"), []).save(str(tmp_path), "viewer")
        await kept.stub(Stub).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
        assert kept.replaced == 2
        stream.cancel()
    finally:
        await kept.close()


async def test_a_half_written_rotation_keeps_the_channel_until_the_key_lands(
    mtls_server, dev_pki, client_files, caplog
):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        newer = CertificateAuthority.load(dev_pki.directory).issue(Identity("viewer", "viewer"), [])
        with open(client_files.cert, "wb") as handle:  # the certificate lands, its key not yet
            handle.write(newer.cert_pem)
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                assert kept.stub(Stub) is stub
                await stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
            # A channel made now (to a new engine, a new node) starts from the last usable pair.
            later = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
            try:
                await later.stub(Stub).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
            finally:
                await later.close()
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "is not the key of the certificate" in errors[0], errors
        with open(client_files.key, "wb") as handle:
            handle.write(newer.key_pem)
        assert kept.stub(Stub) is not stub and kept.replaced == 1
        await kept.stub(Stub).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    finally:
        await kept.close()


async def _calls_on_the_kept_channel(kept: ReloadingChannel, stub, caplog, times: int = 5) -> list[str]:
    """`times` calls that must go on the channel in use; the ERROR lines they logged."""
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        for _ in range(times):
            assert kept.stub(Stub) is stub
            await stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


async def test_a_deleted_certificate_keeps_the_channel_and_is_said_once(mtls_server, dev_pki, client_files, caplog):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        os.remove(client_files.cert)  # a rotation that removes the old file before writing the new one
        errors = await _calls_on_the_kept_channel(kept, stub, caplog)
        assert len(errors) == 1 and client_files.cert in errors[0] and "No such file" in errors[0], errors
        CertificateAuthority.load(dev_pki.directory).issue(Identity("viewer", "viewer"), []).save(
            os.path.dirname(client_files.cert), "viewer"
        )
        assert kept.stub(Stub) is not stub and kept.replaced == 1
        await kept.stub(Stub).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    finally:
        await kept.close()


async def test_a_rotation_to_an_expired_certificate_keeps_the_last_good_one(mtls_server, dev_pki, client_files, caplog):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
        CertificateAuthority.load(dev_pki.directory).issue(
            Identity("viewer", "viewer"), [], days=1, not_before=long_ago
        ).save(os.path.dirname(client_files.cert), "viewer")
        errors = await _calls_on_the_kept_channel(kept, stub, caplog)
        assert len(errors) == 1 and f"cert: {client_files.cert!r} expired on" in errors[0], errors
    finally:
        await kept.close()


async def test_a_rotation_to_a_certificate_of_a_ca_outside_the_bundle_keeps_the_last_good_one(
    mtls_server, client_files, caplog
):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        stranger = CertificateAuthority.create("stranger")
        stranger.issue(Identity("viewer", "viewer"), []).save(os.path.dirname(client_files.cert), "viewer")
        errors = await _calls_on_the_kept_channel(kept, stub, caplog)
        assert (
            len(errors) == 1
            and f"cert: {client_files.cert!r} is not issued by a CA of {client_files.ca!r}" in errors[0]
        ), errors
        assert "CN=stranger" in errors[0]
        # The bundle now holds its CA too (a CA rotation's first step): the certificate is taken.
        with open(client_files.ca, "ab") as bundle:
            bundle.write(stranger.cert_pem)
        assert kept.stub(Stub) is not stub and kept.replaced == 1
    finally:
        await kept.close()


async def test_files_rewritten_with_the_same_contents_keep_the_channel(mtls_server, client_files):
    # A renewal job that rewrites unchanged files (or touches them) every minute must not make
    # every process reconnect and reopen its heartbeat stream each time.
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        for _ in range(3):
            for path in (client_files.key, client_files.cert, client_files.ca):
                write_atomically(path, open(path, "rb").read())
            assert kept.stub(Stub) is stub
        assert kept.replaced == 0
        await stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    finally:
        await kept.close()


def _key_of_an_unknown_algorithm() -> bytes:
    """A PKCS #8 private key whose algorithm (OID 1.2.3.4) no TLS library knows: `cryptography`
    answers UnsupportedAlgorithm, which is neither ValueError nor TypeError."""
    algorithm = b"\x30\x05\x06\x03\x2a\x03\x04"
    body = b"\x02\x01\x00" + algorithm + b"\x04\x04\x04\x02\x00\x00"
    return (
        b"-----BEGIN PRIVATE KEY-----\n"
        + base64.encodebytes(b"\x30" + bytes([len(body)]) + body)
        + b"-----END PRIVATE KEY-----\n"
    )


async def test_a_rotation_to_a_key_of_an_unknown_algorithm_keeps_the_last_good_one(mtls_server, client_files, caplog):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        with open(client_files.key, "wb") as handle:
            handle.write(_key_of_an_unknown_algorithm())
        errors = await _calls_on_the_kept_channel(kept, stub, caplog)
        assert len(errors) == 1 and f"key: {client_files.key!r} holds no usable PEM private key" in errors[0], errors
        assert "1.2.3.4" in errors[0]
    finally:
        await kept.close()


def test_a_key_of_an_unknown_algorithm_at_start_is_a_config_error_naming_the_file(client_files):
    with open(client_files.key, "wb") as handle:
        handle.write(_key_of_an_unknown_algorithm())
    with pytest.raises(ConfigError, match=f"key: {re.escape(repr(client_files.key))} holds no usable PEM private key"):
        TlsFileWatch(client_files.cert, client_files.key, client_files.ca)


def test_an_unexpected_failure_reading_rotated_files_keeps_the_last_good_ones(client_files, monkeypatch, caplog):
    """Whatever a check of new files raises (a library's surprise), the files in use stay: the
    server asks before every handshake, and an exception there would fail them all."""
    watch = TlsFileWatch(client_files.cert, client_files.key, client_files.ca)
    before = watch.pems
    os.utime(client_files.cert, ns=(1, 1))  # a change to look at
    monkeypatch.setattr("motor.service.tls.check_not_expired", lambda *args: 1 / 0)
    with caplog.at_level(logging.ERROR):
        assert watch.changed() is None and watch.changed() is None
    assert watch.pems is before
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "ZeroDivisionError" in errors[0], errors


def _self_signed(key) -> bytes:
    """A certificate of `key`'s public key, signed by it (Ed25519 signs with no hash)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd")])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM)


@pytest.mark.parametrize("kind", ["ed25519", "p521"])
def test_a_key_grpc_cannot_sign_handshakes_with_is_a_config_error_naming_the_file(kind, tmp_path):
    """cryptography loads these, but gRPC's TLS offers no signature algorithm for them: a server
    with one started, and every handshake failed (a rotation to one took it too)."""
    key = ed25519.Ed25519PrivateKey.generate() if kind == "ed25519" else ec.generate_private_key(ec.SECP521R1())
    cert_path, key_path = str(tmp_path / "odd.crt"), str(tmp_path / "odd.key")
    write_atomically(cert_path, _self_signed(key))
    write_atomically(
        key_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    with pytest.raises(
        ConfigError, match=f"key: {re.escape(repr(key_path))} .*use an RSA key or an ECDSA key on P-256 or P-384"
    ):
        TlsFileWatch(cert_path, key_path, None)


async def test_a_rotation_to_a_certificate_not_valid_yet_keeps_the_last_good_one(
    mtls_server, dev_pki, client_files, caplog
):
    kept = ReloadingChannel(f"localhost:{mtls_server.port}", client_files)
    try:
        stub = kept.stub(Stub)
        tomorrow = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
        CertificateAuthority.load(dev_pki.directory).issue(Identity("viewer", "viewer"), [], not_before=tomorrow).save(
            os.path.dirname(client_files.cert), "viewer"
        )
        errors = await _calls_on_the_kept_channel(kept, stub, caplog)
        assert len(errors) == 1 and f"cert: {client_files.cert!r} is not valid before" in errors[0], errors
    finally:
        await kept.close()


def test_a_fifo_or_a_device_as_a_tls_file_is_refused_without_reading_it(client_files, tmp_path, caplog):
    """A FIFO would block the reader (a node manager's loop, at its next handshake) until a writer
    came; /dev/zero would be read until memory ran out. Only regular files are read."""
    fifo = str(tmp_path / "fifo.key")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=f"key: {re.escape(repr(fifo))} is not a regular file"):
        TlsFileWatch(client_files.cert, fifo, client_files.ca)
    with pytest.raises(ConfigError, match="cert: '/dev/zero' is not a regular file"):
        TlsFileWatch("/dev/zero", client_files.key, client_files.ca)

    watch = TlsFileWatch(client_files.cert, client_files.key, client_files.ca)
    before = watch.pems
    os.remove(client_files.key)
    os.mkfifo(client_files.key)  # at a rotation: the files in use stay, said once
    with caplog.at_level(logging.ERROR):
        assert watch.changed() is None and watch.changed() is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert watch.pems is before and len(errors) == 1 and "is not a regular file" in errors[0], errors


def test_a_missing_file_that_turns_into_a_symlink_loop_is_said_again_with_the_new_reason(client_files, caplog):
    """Both cannot be stat'ed; the operator who fixed 'no such file' with a bad link must hear
    why it still is not used, not silence."""
    watch = TlsFileWatch(client_files.cert, client_files.key, client_files.ca)
    os.remove(client_files.key)
    with caplog.at_level(logging.ERROR):
        assert watch.changed() is None
        os.symlink(client_files.key, client_files.key + ".tmp")
        os.replace(client_files.key + ".tmp", client_files.key)  # a link to itself
        assert watch.changed() is None and watch.changed() is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and "No such file" in errors[0] and "Too many levels of symbolic links" in errors[1], errors


def test_a_healed_file_is_said_to_be_used_again(client_files, caplog):
    """Garbage written over the certificate, then the good file back: both said, once each."""
    watch = TlsFileWatch(client_files.cert, client_files.key, client_files.ca)
    good = open(client_files.cert, "rb").read()
    with caplog.at_level(logging.INFO, logger="motor.service.tls"):
        write_atomically(client_files.cert, b"garbage\n")
        assert watch.changed() is None and watch.changed() is None
        write_atomically(client_files.cert, good)
        assert watch.changed() is None  # the same contents as in use: nothing to make again
        assert watch.changed() is None
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["ERROR", "INFO"], said
    assert said[1][1].startswith("TLS files usable again") and client_files.cert in said[1][1], said


def test_every_bad_file_is_named_an_emptied_ca_bundle_too(client_files, caplog):
    watch = TlsFileWatch(client_files.cert, client_files.key, client_files.ca)
    write_atomically(client_files.cert, b"garbage\n")
    write_atomically(client_files.ca, b"")
    with caplog.at_level(logging.ERROR, logger="motor.service.tls"):
        assert watch.changed() is None
    [error] = [r.getMessage() for r in caplog.records]
    assert f"cert: {client_files.cert!r} holds no PEM certificate" in error, error
    assert f"ca: {client_files.ca!r} holds no PEM certificate" in error, error
    with pytest.raises(ConfigError, match=r"cert: .*; ca: "):  # at start: one error naming both
        TlsFileWatch(client_files.cert, client_files.key, client_files.ca)
