"""The security settings every service shares, and the one rule for turning them into a server.

    tls_cert, tls_key   this process's certificate: served to callers, presented when it calls
    tls_ca              the trust bundle: verifies callers' and servers' certificates (mutual TLS)
    tokens_file         bearer tokens for operators and viewers (motor/security/tokens.py)
    token_listen        a second TLS address that asks for no client certificate, for token callers
    insecure            serve plaintext on a non-loopback address anyway (warned at every start)
    reflection          offer gRPC server reflection
    max_streams_per_caller, max_message_bytes, trust_domain

Secure by default: without TLS a server may listen on loopback only (a developer's cluster, where
every caller holds every role) unless `insecure` is set.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, model_validator

from motor.errors import ConfigError
from motor.security.access import AccessControl, AccessPolicy
from motor.security.identity import TRUST_DOMAIN
from motor.security.tokens import TokenStore
from motor.service.cli_config import Flag
from motor.service.config import ReadableFile, is_loopback
from motor.service.grpc_server import MAX_MESSAGE_BYTES, MotorServer, TlsFiles

if TYPE_CHECKING:  # prometheus_client must not load before the engine server sets its multiprocess dir
    from motor.service.grpc_metrics import GrpcServerMetrics
    from motor.service.server_calls import Gate

logger = logging.getLogger(__name__)


class SecuritySettings(BaseModel):
    """Mixed into each service's configuration: the same names as settings and as flags."""

    tls_cert: ReadableFile | None = None
    tls_key: ReadableFile | None = None
    tls_ca: ReadableFile | None = None
    tokens_file: ReadableFile | None = None
    token_listen: str | None = None
    insecure: bool = False
    reflection: bool = True
    max_streams_per_caller: int = Field(default=100, ge=1)
    max_message_bytes: int = Field(default=MAX_MESSAGE_BYTES, ge=64 * 1024)
    trust_domain: str = TRUST_DOMAIN

    @model_validator(mode="after")
    def _coherent(self) -> SecuritySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("tls_ca: required with tls_cert (the CA bundle that verifies callers: mutual TLS)")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_cert/tls_key: required with tls_ca")
        if self.token_listen and not (self.tls_cert and self.tokens_file):
            raise ValueError(
                "token_listen: needs tls_cert/tls_key/tls_ca and tokens_file (tokens travel over TLS only)"
            )
        return self

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None

    def client_tls(self) -> TlsFiles | None:
        """What this process presents and trusts when it calls another Motor service."""
        return TlsFiles(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca) if self.tls_enabled else None

    def check_listen(self, bind: str, setting: str = "listen") -> None:
        """Refuse plaintext on a non-loopback address unless `insecure`; warn when it is."""
        if self.tls_enabled or is_loopback(bind):
            return
        if not self.insecure:
            raise ConfigError(
                f"{setting}: {bind} is not a loopback address and TLS is off; set tls_cert, tls_key and tls_ca "
                "(--tls-cert/--tls-key/--tls-ca), or set insecure (--insecure) to serve plaintext to the network, "
                "where every caller holds every role"
            )
        logger.warning(
            "INSECURE: serving plaintext on %s: anyone who reaches it can call every RPC (docs/security.md)", bind
        )

    def server(
        self,
        bind: str,
        local_node: str | None = None,
        setting: str = "listen",
        metrics: GrpcServerMetrics | None = None,
        gate: Gate | None = None,
        port_setting: str | None = None,
    ) -> MotorServer:
        """A MotorServer on `bind` with these settings; `local_node`: on an engine server, the node
        whose manager may drain, sleep and wake it; `setting` (`port_setting` if given) is named
        when the address cannot be used."""
        self.check_listen(bind, setting)
        policy = AccessPolicy(
            secure=self.tls_enabled,
            tokens=TokenStore(self.tokens_file) if self.tokens_file else None,
            trust_domain=self.trust_domain,
            local_node=local_node,
            max_streams_per_caller=self.max_streams_per_caller,
        )
        tls = (
            TlsFiles(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca, require_client_cert=True)
            if self.tls_enabled
            else None
        )
        return MotorServer(
            bind,
            tls=tls,
            access=AccessControl(policy),
            gate=gate,
            reflection=self.reflection,
            token_bind=self.token_listen,
            token_tls=TlsFiles(cert=self.tls_cert, key=self.tls_key) if self.token_listen else None,
            max_message_bytes=self.max_message_bytes,
            metrics=metrics,
            setting=port_setting or setting,
        )


SECURITY_FLAGS = {  # every service's flags for SecuritySettings (motor/service/cli_config.py)
    "tls_cert": Flag("PEM certificate this process serves and presents (with --tls-key, --tls-ca)"),
    "tls_key": Flag("PEM key of --tls-cert"),
    "tls_ca": Flag("CA bundle that verifies callers and servers (mutual TLS)"),
    "tokens_file": Flag("bearer tokens of operators and viewers (docs/security.md)"),
    "token_listen": Flag("HOST:PORT of a TLS port without client certificates, for bearer tokens"),
    "insecure": Flag(
        "serve plaintext on a non-loopback address (every caller holds every role)", options={"action": "store_true"}
    ),
    "reflection": Flag(
        "offer gRPC server reflection (--no-reflection: off)", options={"action": argparse.BooleanOptionalAction}
    ),
    "max_streams_per_caller": Flag("open streams one caller may hold"),
    "max_message_bytes": Flag("largest message in either direction"),
    "trust_domain": Flag("SPIFFE trust domain of caller identities"),
}
