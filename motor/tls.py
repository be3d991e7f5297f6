"""TLS server credentials that follow their files: rotate a certificate on disk, no restart.

gRPC asks `_fetch` before every new handshake; it answers None (keep the current files) unless a
file's mtime, size or inode changed, and then only with a certificate and key that belong
together, so a rotation caught half way (new certificate, old key) keeps the previous pair
until the second file lands. Connections already open keep the certificate they started with.
"""

from __future__ import annotations

import logging
import os

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from motor.errors import ConfigError

logger = logging.getLogger(__name__)


def read_pem(path: str, field: str) -> bytes:
    """The bytes of a certificate or key file; a ConfigError naming the setting when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path!r}: {exc.strerror}") from None


def check_key_pair(cert_pem: bytes, key_pem: bytes, cert_path: str, key_path: str) -> None:
    """Raise ConfigError unless `key_pem` is the private key of the first certificate of `cert_pem`."""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise ConfigError(f"cert: {cert_path!r} holds no PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"key: {key_path!r} holds no unencrypted PEM private key ({exc})") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(serialization.Encoding.DER, public) != key.public_key().public_bytes(
        serialization.Encoding.DER, public
    ):
        raise ConfigError(f"key: {key_path!r} is not the key of the certificate {cert_path!r}")


def check_ca_bundle(ca_pem: bytes, ca_path: str) -> None:
    """Raise ConfigError unless `ca_pem` holds at least one PEM certificate: an emptied or
    half-written bundle would make every new handshake fail."""
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise ConfigError(f"ca: {ca_path!r} holds no PEM certificate ({exc})") from None


class ReloadingServerCredentials:
    """`grpc.dynamic_ssl_server_credentials` over a certificate, key and optional client CA file."""

    def __init__(self, cert: str, key: str, ca: str | None = None, require_client_cert: bool = False):
        self.paths = [cert, key] + ([ca] if ca else [])
        self.reloads = 0
        self._stamp = self._stamps()
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        initial = self._configuration()
        self.credentials = grpc.dynamic_ssl_server_credentials(
            initial, self._fetch, require_client_authentication=bool(ca) and require_client_cert
        )

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self.paths:
            try:
                stat = os.stat(path)
            except OSError as exc:
                raise ConfigError(f"cannot read {path!r}: {exc.strerror}") from None
            stamps.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
        return tuple(stamps)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert_path, key_path = self.paths[0], self.paths[1]
        cert, key = read_pem(cert_path, "cert"), read_pem(key_path, "key")
        check_key_pair(cert, key, cert_path, key_path)
        ca = read_pem(self.paths[2], "ca") if len(self.paths) > 2 else None
        if ca is not None:
            check_ca_bundle(ca, self.paths[2])
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = None
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            configuration = self._configuration()
        except ConfigError as exc:
            if stamp is None or stamp != self._refused:  # asked before every handshake: say it once per change
                logger.error("TLS files changed but cannot be used, keeping the previous ones: %s", exc)
                self._refused = stamp
            return None
        self._stamp = stamp
        self.reloads += 1
        logger.info("TLS certificate re-read from %s", ", ".join(self.paths))
        return configuration
