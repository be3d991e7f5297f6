"""How motorctl reaches a Motor service: plaintext, or TLS with a client certificate or a token."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from motor.errors import ConfigError
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
