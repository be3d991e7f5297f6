"""TLS credentials that follow their files: rotate a certificate on disk, no restart.

A server's gRPC asks `_fetch` before every new handshake; a client channel (motor/security/channels.py)
asks before every call. Both get nothing new (keep the current files) unless a file's mtime,
size or inode changed, and then only a certificate and key that belong together, so a rotation
caught half way (new certificate, old key) keeps the previous pair until the second file lands;
an expired certificate, one from a CA outside the bundle or a deleted file keeps the previous files
too (said once per change).
Connections already open keep the certificate they started with.
"""

from __future__ import annotations

import datetime
import logging
import os
import stat
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from motor.errors import ConfigError

logger = logging.getLogger(__name__)


MAX_PEM_BYTES = 1 << 20  # a certificate chain, a key or a CA bundle is a few KB; a bundle of hundreds of CAs under 1 MB


def read_pem(path: str, field: str) -> bytes:
    """The bytes of a certificate or key file; a ConfigError naming the setting when it cannot be
    read. Only a regular file is read: a FIFO would block the reader (at a rotation, a node
    manager's event loop) until something wrote to it, and /dev/zero never ends."""
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ConfigError(f"{field}: {path!r} is not a regular file: give the path of a PEM file")
            data = handle.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path!r}: {exc.strerror}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(
            f"{field}: {path!r} is over {MAX_PEM_BYTES} bytes; a PEM certificate, key or CA bundle is far smaller"
        )
    return data


def check_key_pair(cert_pem: bytes, key_pem: bytes, cert_path: str, key_path: str) -> None:
    """Raise ConfigError unless `key_pem` is the private key of the first certificate of `cert_pem`."""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise ConfigError(f"cert: {cert_path!r} holds no PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # not PEM, encrypted, an unknown algorithm
        raise ConfigError(
            f"key: {key_path!r} holds no usable PEM private key, unencrypted, of a known algorithm ({exc})"
        ) from None
    if not usable_for_tls(key):
        kind = (
            f"ECDSA on {key.curve.name}"
            if isinstance(key, ec.EllipticCurvePrivateKey)
            else type(key).__name__.removesuffix("PrivateKey")
        )
        raise ConfigError(
            f"key: {key_path!r} holds a key gRPC's TLS cannot sign handshakes with ({kind}): use an RSA "
            "key or an ECDSA key on P-256 or P-384"
        )
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        cert_public = cert.public_key().public_bytes(serialization.Encoding.DER, public)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"cert: {cert_path!r} holds a public key of an unknown algorithm ({exc})") from None
    if cert_public != key.public_key().public_bytes(serialization.Encoding.DER, public):
        raise ConfigError(f"key: {key_path!r} is not the key of the certificate {cert_path!r}")


def usable_for_tls(key: object) -> bool:
    """Whether gRPC's TLS (BoringSSL, as grpcio builds it) can sign a handshake with `key`. Others
    (Ed25519, Ed448, P-521, DSA...) load here, and then every handshake fails."""
    return isinstance(key, rsa.RSAPrivateKey) or (
        isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, (ec.SECP256R1, ec.SECP384R1))
    )


def check_not_expired(cert_pem: bytes, cert_path: str) -> None:
    """Raise ConfigError when the first certificate of `cert_pem` has expired or is not valid yet:
    rotating to it would make every new handshake fail, where the certificate in use may still be good."""
    cert = x509.load_pem_x509_certificates(cert_pem)[0]
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        raise ConfigError(
            f"cert: {cert_path!r} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; write a "
            "current certificate and its key there"
        )
    if cert.not_valid_before_utc > now:
        raise ConfigError(
            f"cert: {cert_path!r} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
            "(check this host's clock, or issue it to start now)"
        )


def issued_by_bundle(cert_pem: bytes, ca_pem: bytes) -> bool:
    """Whether a certificate of `cert_pem` (the leaf, or an intermediate after it) is signed by one of the bundle."""
    bundle = x509.load_pem_x509_certificates(ca_pem)
    for cert in x509.load_pem_x509_certificates(cert_pem):
        for ca in bundle:
            try:
                cert.verify_directly_issued_by(ca)
                return True
            except (ValueError, TypeError, InvalidSignature):
                continue
    return False


def check_same_trust(before: TlsPems, after: TlsPems, cert_path: str, ca_path: str) -> None:
    """Raise ConfigError when the certificate in use is issued by a CA of the bundle and the new one
    is not: the peers, which trust that bundle, would refuse it at every new handshake. (A process
    whose own certificate never came from its bundle is not held to it.)"""
    if None in (before.cert, before.ca, after.cert, after.ca) or not issued_by_bundle(before.cert, before.ca):
        return
    if not issued_by_bundle(after.cert, after.ca):
        issuer = x509.load_pem_x509_certificates(after.cert)[0].issuer.rfc4514_string()
        raise ConfigError(
            f"cert: {cert_path!r} is not issued by a CA of {ca_path!r} (its issuer: {issuer}); peers "
            "trusting that bundle would refuse it: add its CA to the bundle first, or issue it from that CA"
        )


def check_ca_bundle(ca_pem: bytes, ca_path: str) -> None:
    """Raise ConfigError unless `ca_pem` holds at least one PEM certificate: an emptied or
    half-written bundle would make every new handshake fail."""
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise ConfigError(f"ca: {ca_path!r} holds no PEM certificate ({exc})") from None


@dataclass(frozen=True)
class TlsPems:
    """The contents of a certificate, its key and a CA bundle (None: that file is not used)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None


class TlsFileWatch:
    """A certificate, its key and a CA bundle (each optional) read from their files, and read again
    when one of them changes: `changed()` costs a stat per file, and answers new contents only
    once they are usable (the key belongs to the certificate, the bundle holds a certificate).
    Used by servers (ReloadingServerCredentials) and, one per set of files in a process
    (`shared`), by the client channels it keeps (motor/security/channels.py)."""

    _shared: dict[tuple[str | None, str | None, str | None], TlsFileWatch] = {}

    def __init__(self, cert: str | None, key: str | None, ca: str | None):
        self.files = {field: path for field, path in (("cert", cert), ("key", key), ("ca", ca)) if path}
        self.paths = list(self.files.values())
        self.reloads = 0
        self._stamp = self._stamps()
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        self.pems = self._read()  # at start a ConfigError naming the setting: exit 2

    @classmethod
    def shared(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFileWatch:
        """This process's one watch of these files: read once, so that a channel made later (to a
        new engine, a new node) starts from the last usable contents, even in the middle of a
        rotation, and every channel sees a change under the same `reloads` count."""
        files = (cert, key, ca)
        if files not in cls._shared:
            cls._shared[files] = cls(cert, key, ca)
        return cls._shared[files]

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self.paths:
            try:
                stat = os.stat(path)
            except OSError as exc:  # missing, a symlink loop: a state by its reason; _read names it, once a change
                stamps.append((-1, -1, -(exc.errno or 1)))
                continue
            stamps.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
        return tuple(stamps)

    def _read(self) -> TlsPems:
        """The files' contents once usable; else a ConfigError naming every bad file (an emptied
        bundle beside a garbled certificate is named too, not found only after the first is fixed)."""
        contents: dict[str, bytes] = {}
        problems: list[str] = []
        for field, path in self.files.items():
            try:
                contents[field] = read_pem(path, field)
            except ConfigError as exc:
                problems.append(str(exc))
        pair, ca = [contents.get(f) for f in ("cert", "key")], contents.get("ca")
        checks = (
            [lambda: check_key_pair(pair[0], pair[1], self.files["cert"], self.files["key"])]
            if None not in pair
            else []
        )
        checks += [lambda: check_ca_bundle(ca, self.files["ca"])] if ca is not None else []
        for check in checks:
            try:
                check()
            except ConfigError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError("; ".join(problems))
        return TlsPems(**contents)

    def changed(self) -> TlsPems | None:
        """The files' new contents when they changed and can be used; None otherwise (an unusable
        change, e.g. a certificate whose key has not landed yet, is logged once and retried)."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        try:
            pems = self._read()
            if pems.cert is not None:  # at start these are used (and refused by the peer, which says so)
                check_not_expired(pems.cert, self.files["cert"])
                check_same_trust(self.pems, pems, self.files["cert"], self.files.get("ca", ""))
        except Exception as exc:  # a ConfigError naming the file, or a library's surprise: the files in use stay
            if stamp != self._refused:  # asked before every handshake or call: say it once per change
                why = exc if isinstance(exc, ConfigError) else f"{', '.join(self.paths)}: {type(exc).__name__}: {exc}"
                logger.error("TLS files changed but cannot be used, keeping the previous ones: %s", why)
                self._refused = stamp
            return None
        if self._refused is not None:  # healed (a bad change came before): say it, once
            self._refused = None
            logger.info(
                "TLS files usable again: %s%s",
                ", ".join(self.paths),
                "" if pems == self.pems else " (new contents in use)",
            )
        if pems == self.pems:  # rewritten or touched, same contents: nothing to make again
            self._stamp = stamp
            return None
        self._stamp, self.pems = stamp, pems
        self.reloads += 1
        logger.info("TLS certificate re-read from %s", ", ".join(self.paths))
        return pems


class ReloadingServerCredentials:
    """`grpc.dynamic_ssl_server_credentials` over a certificate, key and optional client CA file."""

    def __init__(self, cert: str, key: str, ca: str | None = None, require_client_cert: bool = False):
        self.watch = TlsFileWatch(cert, key, ca)
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(self.watch.pems),
            self._fetch,
            require_client_authentication=bool(ca) and require_client_cert,
        )

    @staticmethod
    def _configuration(pems: TlsPems) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(pems.key, pems.cert)], root_certificates=pems.ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        pems = self.watch.changed()
        return None if pems is None else self._configuration(pems)
