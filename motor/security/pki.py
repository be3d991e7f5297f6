"""A small certificate authority for development clusters and tests (`motorctl pki ...`).

    ca = CertificateAuthority.create()
    ca.save("pki")                                            # pki/ca.crt, pki/ca.key
    pair = ca.issue(Identity("node", "node-a"), hosts=["localhost", "127.0.0.1"])
    pair.save("pki", "node-a")                                # pki/node-a.crt, pki/node-a.key

Every leaf certificate carries its identity as a SPIFFE URI SAN (see motor/security/identity.py) and may
serve and be a client at once (a node manager is both); `hosts` become DNS or IP SANs, the names
a server is reached at. Keys are ECDSA P-256 (fast handshakes) and written mode 0600.
Production sites bring their own PKI (docs/security.md); nothing here is needed at run time.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from motor.errors import ConfigError
from motor.security.identity import TRUST_DOMAIN, Identity

CA_CERT, CA_KEY = "ca.crt", "ca.key"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Motor"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def subject_alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """'127.0.0.1' -> an IP SAN, 'localhost' -> a DNS SAN."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def write_private(path: str, data: bytes) -> None:
    """Write a secret readable by its owner only (mode 0600, also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(data)


def write_atomically(path: str, data: bytes, private: bool = False) -> None:
    """Replace `path` in one rename, so a server re-reading it never sees half a file."""
    partial = f"{path}.partial"
    if private:
        write_private(partial, data)
    else:
        with open(partial, "wb") as handle:
            handle.write(data)
    os.replace(partial, path)


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes

    def save(self, directory: str, name: str) -> tuple[str, str]:
        """Write `<name>.crt` and `<name>.key` (0600) under `directory`; returns both paths."""
        os.makedirs(directory, exist_ok=True)
        cert_path, key_path = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
        write_atomically(key_path, self.key_pem, private=True)
        write_atomically(cert_path, self.cert_pem)
        return cert_path, key_path

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


class CertificateAuthority:
    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey):
        self.cert = cert
        self.key = key

    @classmethod
    def create(cls, common_name: str = "Motor development CA", days: int = 3650) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, directory: str) -> CertificateAuthority:
        """Read `ca.crt` and `ca.key` from `directory` (made by `motorctl pki init`)."""
        paths = os.path.join(directory, CA_CERT), os.path.join(directory, CA_KEY)
        try:
            with open(paths[0], "rb") as cert_file, open(paths[1], "rb") as key_file:
                cert = x509.load_pem_x509_certificate(cert_file.read())
                key = serialization.load_pem_private_key(key_file.read(), password=None)
        except OSError as exc:
            raise ConfigError(
                f"--dir: no CA in {directory!r} ({exc.strerror}: {exc.filename}); run `motorctl pki init` first"
            ) from None
        except ValueError as exc:
            raise ConfigError(f"--dir: {directory!r} holds no readable PEM CA: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"--dir: {paths[1]} is not an EC key (this helper signs with ECDSA P-256)")
        return cls(cert, key)

    def save(self, directory: str) -> tuple[str, str]:
        return KeyPair(self.cert.public_bytes(serialization.Encoding.PEM), _key_pem(self.key)).save(directory, "ca")

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        identity: Identity | None,
        hosts: Iterable[str] = (),
        days: float = 365,
        not_before: datetime.datetime | None = None,
        trust_domain: str = TRUST_DOMAIN,
    ) -> KeyPair:
        """A leaf certificate for `identity` (a URI SAN), valid as server for `hosts` and as client.

        `not_before` and a small `days` make an already expired certificate (for tests).
        """
        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or (_now() - datetime.timedelta(minutes=5))
        sans = subject_alt_names(hosts)
        if identity is not None:
            sans.append(x509.UniformResourceIdentifier(identity.uri(trust_domain)))
        if not sans:
            raise ConfigError("a certificate needs an identity or at least one host name")
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(identity.path() if identity else next(iter(hosts))))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))
