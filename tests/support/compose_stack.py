"""Drives compose.yaml with the real docker engine and compose CLI, for the compose tests.

Everything goes through the real tools a user has: `docker compose` (v2) when installed, else
`docker-compose` (v1.29); `docker kill`, `docker network disconnect/connect`, `docker exec`.
The controller is queried through its published port from the host, as users do."""

from __future__ import annotations

import json
import logging
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import grpc

from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from tests.support import REPO_ROOT, wait_for

logger = logging.getLogger(__name__)

NODE_SERVICES = ("node-a", "node-b", "node-c")
CONTROLLER_SERVICES = ("controller", "controller-b")
ETCD_SERVICES = ("etcd-1", "etcd-2", "etcd-3")
SERVICES = (*ETCD_SERVICES, *CONTROLLER_SERVICES, *NODE_SERVICES)

# Lists every engine server process of a container as "<instance_id>/rank<dp_rank> <pid>" lines:
# the engine id comes from the --instance-id/--dp-rank arguments node managers launch it with.
_LIST_ENGINES = r"""
import os
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        argv = open(f'/proc/{pid}/cmdline', 'rb').read().decode().split('\0')
        state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]
    except OSError:
        continue
    if state == 'Z' or '--instance-id' not in argv or not any('engine_server' in a for a in argv[:2]):
        continue
    rank = argv[argv.index('--dp-rank') + 1] if '--dp-rank' in argv else '0'
    print(f"{argv[argv.index('--instance-id') + 1]}/rank{rank} {pid}")
"""


def compose_command() -> list[str] | None:
    """`docker compose` (v2) if the plugin is there, else `docker-compose` (v1), else None."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def docker_engine_running() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def run(
    argv: list[str], timeout: float = 300, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@dataclass
class ComposeStack:
    """One compose project of compose.yaml, isolated by project name, host port and subnets."""

    compose: list[str]
    project: str
    image: str
    base_image: str
    controller_port: int
    prometheus_image: str = "prom/prometheus:v2.53.0"
    prometheus_port: int = 0
    etcd_image: str = "gcr.io/etcd-development/etcd:v3.4.23"
    controller_b_port: int = 0  # controller-b's published port
    router_port: int = 0  # the router's published port (8080 when 0)
    control_net: str = "10.213.100"  # first three octets; the default stack uses 10.213.0/10.213.1
    data_net: str = "10.213.101"
    router_net: str = "10.213.102"
    node_addresses: dict[str, int] = field(default_factory=lambda: {"node-a": 11, "node-b": 12, "node-c": 13})
    # The certificates the stack's `pki` service made, copied to the host by fetch_pki().
    pki_dir: str = ""

    @property
    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            COMPOSE_PROJECT_NAME=self.project,
            MOTOR_IMAGE=self.image,
            MOTOR_BASE_IMAGE=self.base_image,
            MOTOR_CONTROLLER_PORT=str(self.controller_port),
            MOTOR_CONTROLLER_B_PORT=str(self.controller_b_port),
            MOTOR_ETCD_IMAGE=self.etcd_image,
            MOTOR_PROMETHEUS_IMAGE=self.prometheus_image,
            MOTOR_PROMETHEUS_PORT=str(self.prometheus_port),
            MOTOR_ROUTER_PORT=str(self.router_port or 8080),
            MOTOR_CONTROL_NET=self.control_net,
            MOTOR_DATA_NET=self.data_net,
            MOTOR_ROUTER_NET=self.router_net,
        )

    @property
    def controller_address(self) -> str:
        return f"localhost:{self.controller_port}"

    def published(self, service: str) -> str:
        """The host address of a controller service's published port."""
        return f"localhost:{self.controller_port if service == 'controller' else self.controller_b_port}"

    def leader(self) -> str:
        """The published address of the leading controller (the first port when none answers):
        only the leader has the engines' live state and health."""
        for service in ("controller", "controller-b"):
            try:
                leader = self.controllers(self.published(service)).leader_address.rsplit(":", 1)[0]
            except grpc.RpcError:
                continue
            if leader in ("controller", "controller-b"):
                return self.published(leader)
        return self.controller_address

    def compose_run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.compose, *args], timeout=timeout, check=check, env=self.env)

    def fetch_pki(self, directory: str) -> str:
        """Copies the `pki` volume out of the one-shot pki container, as docs/compose.md shows."""
        run(["docker", "cp", f"{self.container('pki')}:/pki", directory])
        self.pki_dir = os.path.join(directory, "pki")
        return self.pki_dir

    def pki(self, name: str) -> str:
        assert self.pki_dir, "fetch_pki() first"
        return os.path.join(self.pki_dir, name)

    def tls_flags(self, identity: str = "operator", dash: str = "--") -> list[str]:
        """CA, certificate and key flags for motorctl (dash '--') or grpcurl (dash '-')."""
        return [
            f"{dash}cacert",
            self.pki("ca.crt"),
            f"{dash}cert",
            self.pki(f"{identity}.crt"),
            f"{dash}key",
            self.pki(f"{identity}.key"),
        ]

    def channel(self, identity: str = "operator", address: str = "") -> grpc.Channel:
        """A mutual-TLS channel to a published controller port (the first one's by default), as `identity`."""

        def read(name: str) -> bytes:
            with open(self.pki(name), "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read("ca.crt"), read(f"{identity}.key"), read(f"{identity}.crt"))
        return grpc.secure_channel(address or self.controller_address, credentials)

    # Prometheus, through its published port -----------------------------------------------

    def prometheus(self, path: str, **params: str):
        """GET Prometheus' HTTP API (`/api/v1/...`); returns its `data`."""
        url = f"http://127.0.0.1:{self.prometheus_port}{path}" + (
            "?" + urllib.parse.urlencode(params) if params else ""
        )
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def firing_alerts(self, name: str) -> list[dict]:
        return [
            a["labels"]
            for a in self.prometheus("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"
        ]

    # Containers and networks ---------------------------------------------------------------

    def container(self, service: str) -> str:
        """Id of the service's container (running or not)."""
        cid = self.compose_run("ps", "-q", service).stdout.strip()
        if not cid:  # v2 lists only running containers without --all
            cid = self.compose_run("ps", "-a", "-q", service, check=False).stdout.strip()
        assert cid, f"no container for service {service}"
        return cid

    def running(self, service: str) -> bool:
        out = run(["docker", "inspect", "-f", "{{.State.Running}}", self.container(service)], check=False).stdout
        return out.strip() == "true"

    def health(self, service: str) -> str:
        return run(["docker", "inspect", "-f", "{{.State.Health.Status}}", self.container(service)]).stdout.strip()

    def health_report(self) -> str:
        """Each container's state and its last health-check outputs (why one is unhealthy)."""
        lines = []
        for cid in self.labelled("ps -a"):
            out = run(
                [
                    "docker",
                    "inspect",
                    "-f",
                    "{{.Name}} {{.State.Status}} exit={{.State.ExitCode}} "
                    "{{if .State.Health}}{{.State.Health.Status}}{{range .State.Health.Log}} | {{.ExitCode}}: "
                    "{{.Output}}{{end}}{{end}}",
                    cid,
                ],
                check=False,
            ).stdout.strip()
            lines.append(out)
        return "\n".join(lines)

    def network(self, name: str) -> str:
        return f"{self.project}_{name}"

    def isolate_networks(self) -> list[list[str]]:
        """Drop forwarding between the project's control and data bridges, as dockerd itself does
        (its DOCKER-ISOLATION chains) when it manages iptables. dockerd here runs with
        --iptables=false: without these rules a node cut off `control` still reaches the
        controller, routed by the host from the `data` bridge (docker then gives the container a
        default route through `data`). Returns the rules, for remove_rules()."""
        if run(["iptables", "-S", "DOCKER-ISOLATION-STAGE-1"], check=False).returncode == 0:
            return []  # dockerd isolates its networks already
        bridges = [
            "br-" + run(["docker", "network", "inspect", "-f", "{{.Id}}", self.network(name)]).stdout.strip()[:12]
            for name in ("control", "data", "router", "clients")
        ]
        rules = [["FORWARD", "-i", a, "-o", b, "-j", "DROP"] for a in bridges for b in bridges if a != b]
        for rule in rules:
            run(["iptables", "-I", *rule])
        return rules

    @staticmethod
    def remove_rules(rules: list[list[str]]) -> None:
        for rule in rules:
            run(["iptables", "-D", *rule], check=False)

    def door(self, path: str, body: dict | None = None, key: str | None = "") -> tuple[int, dict]:
        """A request to the front door's published port over TLS (trusting the pki volume's CA),
        with the development API key (key="", the default), another key, or none (key=None)."""
        key = self.development_key() if key == "" else key
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"https://127.0.0.1:{self.router_port}{path}", data=data, headers=headers)
        context = ssl.create_default_context(cafile=self.pki("ca.crt"))
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as refused:
            return refused.code, json.loads(refused.read() or b"{}")

    def development_key(self) -> str:
        with open(self.pki("api-key")) as held:
            return held.read().strip()

    @property
    def router_api(self) -> str:
        """The router's API: it listens on its `router` network address alone."""
        return f"http://{self.router_net}.21:8081"

    def router_workers(self) -> set[str]:
        """The router's workers, asked inside its container (its port is published nowhere, and
        the keyed front door passes no admin read)."""
        ask = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1] + '/list_workers').read().decode())"
        out = run(["docker", "exec", self.container("router"), "python", "-c", ask, self.router_api]).stdout
        return set(json.loads(out)["urls"])

    def labelled(self, kind: str) -> list[str]:
        """Ids of this project's containers (kind 'ps -a') or networks (kind 'network ls')."""
        argv = ["docker", *kind.split(), "-q", "--filter", f"label=com.docker.compose.project={self.project}"]
        return run(argv).stdout.split()

    def logs(self, tail: int = 40) -> str:
        return self.compose_run("logs", "--no-color", "--tail", str(tail), timeout=60, check=False).stdout

    def host_processes(self) -> list[tuple[int, str]]:
        """(host pid, command) of every process in the project's running containers."""
        processes = []
        for cid in run(
            ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"]
        ).stdout.split():
            # docker top runs ps on the host: the pids are the host's.
            for line in run(["docker", "top", cid, "-eo", "pid,args"]).stdout.splitlines()[1:]:
                pid, _, args = line.strip().partition(" ")
                processes.append((int(pid), args.strip()))
        return processes

    def engine_processes(self) -> dict[str, list[str]]:
        """Engine id -> services whose container runs an engine server process for it."""
        found: dict[str, list[str]] = {}
        for (engine_id, service), _pid in self.engine_pids().items():
            found.setdefault(engine_id, []).append(service)
        return found

    def engine_pids(self) -> dict[tuple[str, str], int]:
        """(engine id, service) -> pid (in its container) of every engine server process."""
        found: dict[tuple[str, str], int] = {}
        for service in NODE_SERVICES:
            if not self.running(service):
                continue
            out = run(["docker", "exec", self.container(service), "python", "-c", _LIST_ENGINES], timeout=60).stdout
            for line in out.splitlines():
                engine_id, pid = line.split()
                found[(engine_id, service)] = int(pid)
        return found

    def controllers(self, address: str = "") -> controller_pb2.ListControllersResponse:
        with self.channel(address=address) as channel:
            return self.stub(channel).ListControllers(controller_pb2.ListControllersRequest(), timeout=10)

    # The controller, through the published port ------------------------------------------

    def stub(self, channel: grpc.Channel) -> controller_pb2_grpc.ControllerServiceStub:
        return controller_pb2_grpc.ControllerServiceStub(channel)

    def snapshot(self, address: str = "") -> tuple[list[controller_pb2.Node], list[controller_pb2.Instance]]:
        """Nodes and instances as the leading controller (or `address`) sees them."""
        with self.channel(address=address or self.leader()) as channel:
            stub = self.stub(channel)
            nodes = list(stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10).nodes)
            instances = list(stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=10).instances)
        return nodes, instances

    def events(self) -> list[controller_pb2.Event]:
        """The controller's recent events, oldest first (the snapshot that opens WatchEvents)."""
        with self.channel(address=self.leader()) as channel:
            stream = self.stub(channel).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=10)
            first = next(stream)
            stream.cancel()
        return list(first.snapshot.recent_events)


def ready_nodes(nodes: list[controller_pb2.Node]) -> set[str]:
    return {n.info.node_id for n in nodes if n.state == controller_pb2.NODE_STATE_READY}


def deployment_ready(instances: list[controller_pb2.Instance]) -> bool:
    """Every instance READY and every engine placed and NORMAL."""
    return bool(instances) and all(
        i.state == controller_pb2.INSTANCE_STATE_READY
        and i.engines
        and all(e.node_id and e.health == types_pb2.HEALTH_STATUS_NORMAL for e in i.engines)
        for i in instances
    )


def placement(instances: list[controller_pb2.Instance]) -> dict[str, str]:
    """Engine id -> node id."""
    return {e.engine_id: e.node_id for i in instances for e in i.engines}


def describe(nodes: list[controller_pb2.Node], instances: list[controller_pb2.Instance]) -> str:
    lines = [f"node {n.info.node_id}: {controller_pb2.NodeState.Name(n.state)} {n.state_reason}" for n in nodes]
    for i in instances:
        lines.append(f"instance {i.instance_id}: {controller_pb2.InstanceState.Name(i.state)} {i.state_reason}")
        for e in i.engines:
            lines.append(f"  {e.engine_id} on {e.node_id or '-'}: {types_pb2.HealthStatus.Name(e.health)}")
    return "\n".join(lines)


def wait(predicate, timeout: float, what: str, stack: ComposeStack | None = None, interval: float = 0.5):
    """Poll until predicate() is truthy; on timeout fail with the cluster's state and logs."""
    return wait_for(predicate, timeout, interval, what, detail=(lambda: stack_state(stack)) if stack else None)


def stack_state(stack: ComposeStack) -> str:
    try:
        state = describe(*stack.snapshot())
    except grpc.RpcError as exc:
        state = f"controller not answering: {exc.code().name}"
    return state + "\n--- compose logs ---\n" + stack.logs()


# The image the tests build from compose.yaml's build section. The base image: a local Debian
# image made by scripts/build-base-image.sh (this machine has no registry); set
# MOTOR_TEST_BASE_IMAGE=python:3.11-slim where a registry is reachable.
TEST_IMAGE = "motor-sim:test"


BASE_IMAGE = os.environ.get("MOTOR_TEST_BASE_IMAGE", "motor-base:bookworm")


# Prometheus: Debian's package in a local image (no registry here); MOTOR_TEST_PROMETHEUS_IMAGE=
# prom/prometheus:v2.53.0 where a registry is reachable.
PROMETHEUS_IMAGE = os.environ.get("MOTOR_TEST_PROMETHEUS_IMAGE", "motor-prometheus:bookworm")


# etcd: Debian's etcd-server (and etcdctl, for the health check) in a local image;
# MOTOR_TEST_ETCD_IMAGE=gcr.io/etcd-development/etcd:v3.4.23 where a registry is reachable.
ETCD_IMAGE = os.environ.get("MOTOR_TEST_ETCD_IMAGE", "motor-etcd:bookworm")


PROJECT_PREFIX = "motor-test-"


# Seconds each step took, printed at the end of the session (pytest -s) for docs/compose.md.
TIMINGS: dict[str, float] = {}


def _timed(name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    started = time.monotonic()
    result = run(argv, **kwargs)
    TIMINGS[name] = time.monotonic() - started
    return result


def _remove_leftover_projects() -> None:
    """Containers and networks of earlier test runs that died before their clean-up (same subnets)."""
    for kind, remove in (("ps -a", ["docker", "rm", "-f"]), ("network ls", ["docker", "network", "rm"])):
        listed = run(["docker", *kind.split(), "--format", '{{.ID}} {{.Label "com.docker.compose.project"}}']).stdout
        ids = [
            line.split()[0]
            for line in listed.splitlines()
            if len(line.split()) == 2 and line.split()[1].startswith(PROJECT_PREFIX)
        ]
        if ids:
            run([*remove, *ids], check=False)
