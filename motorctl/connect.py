"""How motorctl reaches a Motor service: plaintext, or TLS with a client certificate or a token."""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass

import grpc

from motor.errors import ConfigError
from motor.service.config import split_host_port
from motor.service.grpc_server import CHANNEL_OPTIONS, TlsFiles, channel_credentials


@dataclass(frozen=True)
class Credentials:
    """Plaintext when `ca` is None; else TLS verified by `ca`, with a certificate and/or a token."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert or self.token_file) and not self.ca:
            raise ConfigError("--cert and --token-file need --cacert (the CA that signed the server's certificate)")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--cert and --key go together")

    def channel(self, target: str) -> grpc.Channel:
        if self.ca is None:
            return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        credentials = channel_credentials(TlsFiles(cert=self.cert, key=self.key, ca=self.ca))
        if self.token_file:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self._token())
            )
        return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)

    def _token(self) -> str:
        try:
            with open(self.token_file, encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file: cannot read {self.token_file!r}: {exc.strerror}") from None


def add_credential_flags(parser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--cacert",
        default=env("MOTOR_CACERT"),
        help="CA bundle of the server's certificate: connect with TLS [env MOTOR_CACERT]",
    )
    parser.add_argument("--cert", default=env("MOTOR_CERT"), help="client certificate (with --key) [env MOTOR_CERT]")
    parser.add_argument("--key", default=env("MOTOR_KEY"), help="key of --cert [env MOTOR_KEY]")
    parser.add_argument(
        "--token-file", default=env("MOTOR_TOKEN_FILE"), help="file holding a bearer token [env MOTOR_TOKEN_FILE]"
    )


def credentials_from(args) -> Credentials:
    return Credentials(ca=args.cacert, cert=args.cert, key=args.key, token_file=args.token_file)


def speaks_tls(target: str, timeout: float = 2.0) -> bool | None:
    """Whether the server at `target` answers a TLS handshake (None: nothing answers there).

    Unverified on purpose: it only tells the protocol apart. A TLS server answers with its
    certificate or, asking for one we do not give, with a TLS alert; a plaintext gRPC server reads
    the hello as a broken HTTP/2 preface and closes, or answers with a frame that is no TLS record."""
    try:
        host, port = split_host_port(target)
        raw = socket.create_connection((host, port), timeout=timeout)
    except (OSError, ValueError):
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with raw:
        try:
            with context.wrap_socket(raw, server_hostname=host):
                return True
        except ssl.SSLError as exc:
            return "ALERT" in str(exc).upper()
        except OSError:  # reset or closed mid-handshake
            return False


def tls_mismatch(target: str, credentials: Credentials) -> str | None:
    """What to change when the controller at `target` speaks the other protocol than motorctl was
    told to (the channel itself only says "Socket closed" or "WRONG_VERSION_NUMBER"), else None."""
    tls = speaks_tls(target)
    if tls is True and credentials.ca is None:
        return (
            "this controller speaks TLS: give --cacert CA with --cert/--key (or --token-file) "
            "[env MOTOR_CACERT, MOTOR_CERT, MOTOR_KEY, MOTOR_TOKEN_FILE]; `motorctl up --tls` prints the ones "
            "for its cluster"
        )
    if tls is False and credentials.ca is not None:
        return (
            "this controller speaks plaintext: leave out --cacert/--cert/--key/--token-file (and env MOTOR_CACERT, "
            "MOTOR_CERT, MOTOR_KEY, MOTOR_TOKEN_FILE), or start it with --tls-cert/--tls-key/--tls-ca"
        )
    return None
