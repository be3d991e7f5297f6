"""Local etcd members on loopback (`motorctl up --ha`, the HA tests): the `etcd` binary from PATH
(Debian's etcd-server), each member with its own data directory and client/peer ports."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field

from motor.errors import MotorError
from motor.ports import free_port
from motor.processes import launch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EtcdTls:
    """Client TLS of the members: their certificate and key (valid for 127.0.0.1) and the CA
    whose client certificates they require (etcd's --client-cert-auth)."""

    ca: str
    cert: str
    key: str

    def context(self) -> ssl.SSLContext:
        """For the health check: trusts the CA, presents the members' own certificate."""
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context


@dataclass
class EtcdMember:
    name: str
    data_dir: str
    client_port: int
    peer_port: int
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = field(default=None, repr=False)
    tls: EtcdTls | None = None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        """etcd's own /health: true only when this member is part of a cluster with a leader."""
        try:
            context = self.tls.context() if self.tls else None
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=context) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError):
            return False


class EtcdCluster:
    """`size` members on loopback; start(), kill/restart one, stop() leaves no process behind."""

    def __init__(
        self,
        base_dir: str,
        size: int = 1,
        name: str = "motor-etcd",
        env: dict[str, str] | None = None,
        tls: EtcdTls | None = None,
    ):
        self.base_dir = base_dir
        self.env = env  # the members' environment (None: this process's)
        self.tls = tls  # client connections over TLS with client certificates (peers stay on loopback)
        self.members = [
            EtcdMember(f"{name}-{i}", os.path.join(base_dir, f"member-{i}"), free_port(), free_port(), tls=tls)
            for i in range(size)
        ]
        self.token = f"{name}-{os.getpid()}-{time.monotonic_ns()}"

    @property
    def url(self) -> str:
        """The `--store` address of the whole cluster."""
        return "etcd://" + ",".join(member.endpoint for member in self.members)

    def _argv(self, member: EtcdMember) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise MotorError("etcd is not on PATH: install Debian's etcd-server (scripts/etcd-server.sh)")
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [
            binary,
            "--name",
            member.name,
            "--data-dir",
            member.data_dir,
            "--listen-client-urls",
            member.client_url,
            "--advertise-client-urls",
            member.client_url,
            "--listen-peer-urls",
            member.peer_url,
            "--initial-advertise-peer-urls",
            member.peer_url,
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            self.token,
            "--initial-cluster-state",
            "new",  # ignored when the data directory exists
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ] + (
            [
                "--cert-file",
                self.tls.cert,
                "--key-file",
                self.tls.key,
                "--trusted-ca-file",
                self.tls.ca,
                "--client-cert-auth",
            ]
            if self.tls
            else []
        )

    def start_member(self, index: int) -> EtcdMember:
        member = self.members[index]
        if not member.running():
            member.process = launch(self._argv(member), os.path.join(self.base_dir, f"{member.name}.log"), env=self.env)
        return member

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for index in range(len(self.members)):
            self.start_member(index)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0, members: list[EtcdMember] | None = None) -> None:
        members = members if members is not None else [m for m in self.members if m.running()]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(member.healthy() for member in members):
                return
            for member in members:
                if not member.running():
                    raise MotorError(f"etcd member {member.name} exited: see {self.base_dir}/{member.name}.log")
            time.sleep(0.1)
        raise MotorError(f"etcd members not healthy after {timeout}s: see the logs in {self.base_dir}")

    def signal_member(self, index: int, sig: int) -> None:
        member = self.members[index]
        if member.running():
            assert member.process is not None
            os.killpg(member.process.pid, sig)

    def kill_member(self, index: int) -> None:
        """kill -9 of one member (its data directory stays: start_member brings it back)."""
        member = self.members[index]
        if member.running():
            self.signal_member(index, signal.SIGKILL)
            assert member.process is not None
            member.process.wait(10)

    def stop(self) -> None:
        """Stop every member: SIGTERM, then SIGKILL of any left after a deadline."""
        for index, member in enumerate(self.members):
            if member.running():
                self.signal_member(index, signal.SIGCONT)  # a paused member cannot handle SIGTERM
                self.signal_member(index, signal.SIGTERM)
        for index, member in enumerate(self.members):
            if member.process is None:
                continue
            try:
                member.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill_member(index)
