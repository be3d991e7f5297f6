"""Connecting to etcd: `etcd://host:port,host:port/prefix` addresses, TLS, and the aetcd client.

aetcd (asyncio, etcd's gRPC API) is the client: its calls are coroutines on the controller's
own event loop, so an etcd round trip never blocks it (docs/ha.md says why it was chosen over
etcd3gw). aetcd 1.0.0 opens only plaintext channels to one address; `_Client` builds the
channel itself: TLS when a CA is given, and every member's address in one gRPC target so that
the channel moves to another member when the one it uses goes away.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import aetcd
import grpc
from aetcd import rpc, watcher

from motor.errors import ConfigError
from motor.security.channels import RetiredChannels
from motor.service.tls import TlsFileWatch, read_pem

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "/motor"
# etcd closes connections that ping more often than every 5 s (--grpc-keepalive-min-time).
_CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}


@dataclass(frozen=True)
class EtcdTarget:
    """Where the controller's state lives in etcd and how to reach it."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX
    ca_file: str | None = None  # TLS on when set
    cert_file: str | None = None  # client certificate (etcd's --client-cert-auth)
    key_file: str | None = None
    request_timeout: float = 2.0  # deadline of every unary call (s)
    # With TLS and several endpoints: the name every member's certificate is checked against
    # (one gRPC channel walks all members, so one name); default: the first endpoint's host.
    server_name: str | None = None

    def tls_name(self) -> str | None:
        """The name TLS checks the members' certificates against, when not each one's address."""
        if not self.ca_file or (len(self.endpoints) == 1 and not self.server_name):
            return None
        return self.server_name or self.endpoints[0][0]

    def describe(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        return f"etcd{'s' if self.ca_file else ''}://{hosts}{self.prefix}"


def parse_etcd_url(url: str, setting: str = "--store") -> tuple[tuple[tuple[str, int], ...], str]:
    """`etcd://h1:2379,h2:2379/prefix` -> ((h1, 2379), (h2, 2379)), "/prefix"."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ConfigError(f"{setting}: {url!r} is not etcd://host:port[,host:port...][/prefix]")
    endpoints = []
    for item in parts.netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"{setting}: endpoint {item!r} in {url!r} must be host:port with a port in 1-65535")
        endpoints.append((host, int(port)))
    prefix = parts.path.rstrip("/") or DEFAULT_PREFIX
    return tuple(endpoints), prefix


def _grpc_target(endpoints: tuple[tuple[str, int], ...]) -> str:
    """One endpoint: its name as is. Several: every member's IPv4 address in one `ipv4:` target,
    which the channel's pick_first policy walks when a member stops answering."""
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    addresses = []
    for host, port in endpoints:
        try:
            ip = str(ipaddress.IPv4Address(host))
        except ValueError:
            try:
                ip = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            except socket.gaierror as exc:
                raise ConfigError(f"--store: cannot resolve etcd endpoint {host!r}: {exc}") from exc
        addresses.append(f"{ip}:{port}")
    return "ipv4:" + ",".join(addresses)


class _Client(aetcd.Client):
    """aetcd's client on a channel Motor builds (TLS, several members)."""

    def __init__(self, target: EtcdTarget):
        options = dict(_CHANNEL_OPTIONS)
        if target.tls_name():
            options["grpc.ssl_target_name_override"] = target.tls_name()
        super().__init__(timeout=target.request_timeout, options=options)
        self._grpc_target = _grpc_target(target.endpoints)
        self._files: TlsFileWatch | None = None
        if target.ca_file:
            # Read here first, so that an unreadable file at start is an error naming its flag.
            for path, flag in (
                (target.ca_file, "--etcd-ca"),
                (target.key_file, "--etcd-key"),
                (target.cert_file, "--etcd-cert"),
            ):
                if path:
                    read_pem(path, flag)
            self._files = TlsFileWatch.shared(target.cert_file, target.key_file, target.ca_file)
        self._made_at = 0  # the version of the files the channel was made with
        self._retired = RetiredChannels()

    def _files_renewed(self) -> bool:
        """The TLS files changed (a renewed certificate, a new CA) since the channel was made."""
        if self._files is None:
            return False
        self._files.changed()
        return self._files.reloads != self._made_at

    async def connect(self) -> None:
        # Replaces aetcd's connect (plaintext, one address), which aetcd runs before every call;
        # nothing here awaits, so two tasks cannot both build a channel. With TLS, a channel is
        # made again once the files changed (motor/security/channels.py does the same for Motor's own
        # channels): new calls use it, calls and watches on the old one finish there, and it is
        # closed RETIRE_GRACE later (a watch cut then is opened again by its owner).
        renewed = self._connected.is_set() and self._files_renewed()
        if self._connected.is_set() and not renewed:
            return
        options = list(self._options.items())
        old = self.channel if renewed else None
        if self._files is None:
            self.channel = grpc.aio.insecure_channel(self._grpc_target, options=options)
        else:
            self._made_at, pems = self._files.reloads, self._files.pems
            credentials = grpc.ssl_channel_credentials(
                root_certificates=pems.ca, private_key=pems.key, certificate_chain=pems.cert
            )
            self.channel = grpc.aio.secure_channel(self._grpc_target, credentials, options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=None)
        self._connected.set()
        if old is not None:
            logger.info("TLS files changed: new calls to etcd use a new channel with them")
            self._retired.retire(old, self._grpc_target)

    async def close(self) -> None:
        await self._retired.close()
        await super().close()


def connect(target: EtcdTarget) -> aetcd.Client:
    """A client for `target` (the channel opens on first use)."""
    if bool(target.cert_file) != bool(target.key_file):
        raise ConfigError("--etcd-cert and --etcd-key go together: give both or neither")
    if target.cert_file and not target.ca_file:
        raise ConfigError("--etcd-cert needs --etcd-ca (the CA that signed the etcd members' certificates)")
    return _Client(target)


# What an etcd call raises when the cluster cannot answer now (no member reachable, no quorum,
# deadline passed): callers retry or report UNAVAILABLE.
UNAVAILABLE_ERRORS = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.InternalError,
    TimeoutError,
)


def unreachable_hint(target: EtcdTarget) -> str:
    """What to check when etcd cannot be read at all (a TLS mismatch looks like an unreachable
    member to the client: the handshake fails and gRPC reports UNAVAILABLE)."""
    if not target.ca_file:
        hint = "if the members serve TLS, give --etcd-ca (and --etcd-cert/--etcd-key for --client-cert-auth)"
    elif not target.cert_file:
        hint = (
            "members started with --client-cert-auth refuse a caller without a client certificate: "
            "give --etcd-cert and --etcd-key"
        )
    else:
        hint = (
            "--etcd-ca must be the CA of the members' certificates and --etcd-cert/--etcd-key a client "
            "certificate the members' --trusted-ca-file signed"
        )
    if target.tls_name():
        hint += f"; every member's certificate must be valid for {target.tls_name()!r} (--etcd-server-name)"
    elif target.ca_file:
        hint += "; the member's certificate must be valid for the address in --store"
    return f"check that the members run and are reachable; {hint}"
