"""A local cluster on 127.0.0.1: a controller, node managers, optionally etcd and the front door,
each in its own process group. `motorctl up` is a command line over it; tests and benches start
theirs with it too."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor.ports import free_port, port_is_free
from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl import router as front
from motorctl.cluster_processes import (
    ManagedProcess,
    PortTaken,
    ProcessExited,
    check_answered_by,
    check_port_free,
    last_line,
    script_path,
    stop_node_engines,
)
from motorctl.connect import Credentials
from motorctl.door_access import DoorAccess
from motorctl.etcd_cluster import EtcdCluster
from motorctl.pki_command import DevPki, make_dev_pki
from motorctl.run_processes import run_tag, stop_run
from motorctl.supervise import Supervisor

logger = logging.getLogger(__name__)

FRONT = ("router", "front-door")  # names of the front door's processes: the router, its sync, the door


@dataclass
class LocalCluster:
    """A controller and `nodes` node managers on 127.0.0.1, each in its own process group."""

    run_dir: str
    nodes: int = 2
    deployment_path: str | None = None
    # 0: a free port (clusters of tests running side by side never share a controller);
    # `motorctl up` asks for 50051 when it is free.
    controller_port: int = 0
    # The port was not named (`motorctl up` without --controller-port, or 0): one taken while the
    # controller starts is replaced by a free one. A named port that is taken fails the start.
    any_free_controller_port: bool = False
    accelerators_per_node: int = 4
    accelerator_type: str = "sim"  # cpu: the accelerators are CPU cores, each engine bound to its own
    # The host's real accelerators (GPUs, CPU cores) shared among the node managers: node i gets
    # the i-th run of `accelerators_per_node` of them. Empty: node i has 0 .. accelerators_per_node - 1 (sim).
    host_accelerators: tuple[int, ...] = ()
    # Folders engines may read models from (every node manager's --model-roots).
    model_roots: list[str] = field(default_factory=list)
    heartbeat_interval: float = 1.0
    node_grace: float = 5.0
    abnormal_threshold: int = 5
    # Engines of node i get ports [engine_port_base + 500 i, + 499]; give two clusters on one
    # machine different bases.
    engine_port_base: int = 21000
    extra_controller_args: list[str] = field(default_factory=list)
    extra_node_args: list[str] = field(default_factory=list)
    # /metrics ports: the controller on `metrics_port`, node i on `metrics_port + 1 + i`, a port
    # already taken replaced by a free one. None: free ports only (tests running side by side);
    # 0: no /metrics at all.
    metrics_port: int | None = None
    # Where every /metrics (and the controller's /discovery/engines) listens: plaintext HTTP, so
    # loopback unless asked (`motorctl up --metrics-host`).
    metrics_host: str = "127.0.0.1"
    processes: list[ManagedProcess] = field(default_factory=list)
    node_ports: dict[str, int] = field(default_factory=dict)
    # Process name ("controller", "node-a"...) -> its /metrics port.
    metrics_ports: dict[str, int] = field(default_factory=dict)
    # High availability (docs/ha.md): one etcd member from PATH and `controllers` controllers
    # on it; node managers are given every controller's address.
    ha: bool = False
    controllers: int = 2
    etcd_members: int = 1
    # Node ids are <prefix>-a, <prefix>-b, ...: clusters sharing one host use different ones.
    node_id_prefix: str = "node"
    etcd: EtcdCluster | None = None
    controller_ports: list[int] = field(default_factory=list)
    _token_flags: list[str] = field(default_factory=list)
    # mTLS on every plane with a development PKI in <run_dir>/pki (docs/security.md)
    tls: bool = False
    token_port: int = 0
    # The front door on this port (0: a free one; its own process), in front of a vllm-router on a
    # private port, both kept by motor-router-sync; None: no router.
    router_port: int | None = None
    router_admin_port: int = 0  # the router itself (its admin API): loopback, not for clients
    router_pd: bool = False  # prefill and decode engines as the router's typed workers (its P/D flow)
    door_args: list[str] = field(default_factory=list)  # more flags of the front door (front_door/cli.py)
    door_access: DoorAccess = field(default_factory=DoorAccess)  # its keys and TLS (none: open on loopback)
    front_door: Supervisor = field(default_factory=Supervisor)  # restarts the router, its sync and the door
    door_socket: socket.socket | None = None  # the published port, held across the door's restarts

    @property
    def router_url(self) -> str:
        """Where clients send requests: the front door (front_door/policy.py)."""
        return f"{'https' if self.door_access.tls else 'http'}://127.0.0.1:{self.router_port}"

    @property
    def router_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.router_admin_port}"

    @property
    def pki(self) -> DevPki:
        return DevPki(os.path.join(self.run_dir, "pki"))

    def node_ids(self) -> list[str]:
        return [f"{self.node_id_prefix}-{chr(ord('a') + index)}" for index in range(self.nodes)]

    def credentials(self, identity: str = "operator") -> Credentials:
        """How this cluster's owner calls it: as `identity` (a certificate of the dev PKI) under TLS."""
        if not self.tls:
            return Credentials()
        return Credentials(ca=self.pki.ca, cert=self.pki.cert(identity), key=self.pki.key(identity))

    def tls_flags(self, identity: str) -> list[str]:
        if not self.tls:
            return []
        return ["--tls-cert", self.pki.cert(identity), "--tls-key", self.pki.key(identity), "--tls-ca", self.pki.ca]

    @property
    def controller_address(self) -> str:
        return f"127.0.0.1:{self.controller_port}"

    def _metrics_args(self, name: str, offset: int) -> list[str]:
        if self.metrics_port == 0:
            return ["--metrics-port", "0"]
        if name not in self.metrics_ports:
            wanted = None if self.metrics_port is None else self.metrics_port + offset
            taken = set(self.metrics_ports.values())
            self.metrics_ports[name] = (
                wanted if wanted and wanted not in taken and port_is_free(wanted) else free_port()
            )
        return ["--metrics-port", str(self.metrics_ports[name]), "--metrics-host", self.metrics_host]

    def metrics_urls(self) -> dict[str, str]:
        host = "127.0.0.1" if self.metrics_host in ("0.0.0.0", "::") else self.metrics_host
        return {name: f"http://{host}:{port}/metrics" for name, port in self.metrics_ports.items()}

    @property
    def controller_addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.controller_ports] or [self.controller_address]

    def controller_command(self, index: int) -> list[str]:
        """The command line of controller `index` (0: the one on the usual port)."""
        port = self.controller_ports[index] if self.ha else self.controller_port
        state = os.path.join(self.run_dir, "controller" if index == 0 else f"controller-{index + 1}")
        argv = [
            script_path("motor-controller"),
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            os.path.join(state, "controller.db") if self.ha else os.path.join(self.run_dir, "controller.db"),
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--node-grace",
            str(self.node_grace),
            *self._metrics_args(
                "controller" if index == 0 else f"controller-{index + 1}", 0 if index == 0 else 50 + index
            ),
            *self.tls_flags("controller"),
            *(self._token_flags if index == 0 else []),
            *self.extra_controller_args,
        ]
        if self.ha:
            assert self.etcd is not None
            argv += ["--store", self.etcd.url + "/motor", "--advertise", f"127.0.0.1:{port}"]
        if self.deployment_path:
            argv += ["--deployment", self.deployment_path]
        return argv

    def launch_controller(self, index: int) -> ManagedProcess:
        return self._launch("controller" if index == 0 else f"controller-{index + 1}", self.controller_command(index))

    def _launch(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()
    ) -> ManagedProcess:
        log_path = os.path.join(self.run_dir, "logs", f"{name}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=pass_fds,
                env=dict(
                    os.environ, **run_tag(self.run_dir), **self.door_access.engine_env(self.run_dir), **(env or {})
                ),
            )
        managed = ManagedProcess(name, process, log_path)
        self.processes.append(managed)
        logger.info("started %s (pid %d), log %s", name, process.pid, log_path)
        return managed

    def start(self, timeout: float = 60.0) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        if not self.controller_port:
            self.controller_port, self.any_free_controller_port = free_port(), True
        if self.tls:
            make_dev_pki(self.pki.directory, self.node_ids())
            self.token_port = self.token_port or free_port()
            self._token_flags = ["--tokens-file", self.pki.tokens, "--token-listen", f"127.0.0.1:{self.token_port}"]
        if self.ha:
            self.etcd = EtcdCluster(
                os.path.join(self.run_dir, "etcd"),
                size=self.etcd_members,
                env=dict(os.environ, **run_tag(self.run_dir)),
            ).start(timeout)
            self.controller_ports = [self.controller_port] + [free_port() for _ in range(self.controllers - 1)]
        self.start_controllers(timeout)
        for index, node_id in enumerate(self.node_ids()):
            self.start_node(node_id, index)
        self.wait_nodes_registered(self.nodes, timeout)
        if self.router_port is not None:
            self.start_router(timeout)

    def start_controllers(self, timeout: float, tries: int = 3) -> None:
        """Start the controllers and make sure each one answering is the process started. A port
        taken meanwhile (another cluster starting at the same moment took the same free port)
        is replaced by a free one when the port was not named (`any_free_controller_port`)."""
        for attempt in range(1, tries + 1):
            launched: list[ManagedProcess] = []
            try:
                for port in self.controller_ports or [self.controller_port]:
                    check_port_free(port)
                launched = [self.launch_controller(index) for index in range(self.controllers if self.ha else 1)]
                for address, controller in zip(self.controller_addresses, launched):
                    self.wait_serving(address, timeout, self.credentials(), controller)
                    check_answered_by(controller, int(address.rsplit(":", 1)[1]))
                return
            except (PortTaken, ProcessExited) as exc:
                taken = [port for port in self.controller_ports or [self.controller_port] if not port_is_free(port)]
                if not self.any_free_controller_port or self.ha or not taken or attempt == tries:
                    raise
                self._terminate(launched, timeout)
                self.processes = [p for p in self.processes if p not in launched]
                self.controller_port = free_port()
                logger.warning("%s; the controller takes port %d instead", exc, self.controller_port)

    def start_router(self, timeout: float) -> None:
        self.router_port = self.router_port or free_port()
        self.router_admin_port = self.router_admin_port or free_port()
        # The router's own /metrics is on its Prometheus port (its --port's /metrics is a worker's).
        self.metrics_ports["router"] = free_port()
        router_argv = front.router_command(self.router_admin_port, self.metrics_ports["router"])
        router_env = front.router_env(self.door_access.engine_env(self.run_dir))
        router = self._launch("router", router_argv, router_env)
        deadline = time.monotonic() + timeout
        while front.router_workers(self.router_admin_url) is None:
            if self.process("router").process.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"the router on port {self.router_admin_port} did not start; see its log")
            time.sleep(0.1)
        # The front door in its own process (a sync that dies touches no client connection), fed
        # by the sync on a private port of loopback.
        table = f"127.0.0.1:{free_port()}"
        self.door_socket = front.held_listener("127.0.0.1", self.router_port)  # outlives each door process
        fds = (self.door_socket.fileno(),)
        door_argv = front.door_command(
            f"127.0.0.1:{self.router_port}",
            self.router_admin_url,
            table,
            fds[0],
            self.door_args + self.door_access.args(),
        )
        door = self._launch("front-door", door_argv, pass_fds=fds)
        # its own series (what clients got, per model; with keys, per tenant: on its private table port)
        self.metrics_ports["front-door"] = (
            int(table.rpartition(":")[2]) if self.door_access.api_keys else self.router_port
        )
        sync_argv = front.sync_command(
            self.controller_addresses,
            self.router_admin_url,
            f"http://{table}",
            self.tls_flags("router-sync"),
            self.router_pd,
        )
        sync = self._launch("router-sync", sync_argv)
        while not front.door_has_table(table):  # the front door serves, with what the sync told it
            for started in (door, sync):
                if started.process.poll() is not None:
                    raise ProcessExited(f"the {started.name} exited at start: {last_line(started.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the front door on port {self.router_port} did not start; see front-door.log")
            time.sleep(0.1)
        # Each one exiting is started again, same command and ports (motorctl/supervise.py).
        self.front_door.watch("router", router.process, lambda: self._launch("router", router_argv, router_env).process)
        self.front_door.watch(
            "front-door", door.process, lambda: self._launch("front-door", door_argv, None, fds).process
        )
        self.front_door.watch("router-sync", sync.process, lambda: self._launch("router-sync", sync_argv).process)
        self.front_door.start()

    def front_door_state(self) -> str:
        """What the screen says keeps the router: its sync, or what happened to either of them."""
        said = [self.front_door.describe(name) for name in ("router-sync", "router", "front-door")]
        if not self.front_door.running("router-sync"):
            return "NOT kept: " + "; ".join(part for part in said if part)
        return "; ".join(["kept by motor-router-sync", *(part for part in said if part)])

    def start_node(self, node_id: str, index: int) -> ManagedProcess:
        port = self.node_ports.get(node_id) or free_port()
        self.node_ports[node_id] = port
        managed = self._launch(node_id, self.node_command(node_id, index, port))
        self.wait_serving(f"127.0.0.1:{port}", 30, self.credentials(), managed)
        return managed

    def node_command(self, node_id: str, index: int, port: int) -> list[str]:
        """The command line of node manager `index` (`node_id`), serving on `port`."""
        first_engine_port = self.engine_port_base + index * 500
        return [
            script_path("motor-node-manager"),
            "--node-id",
            node_id,
            "--listen",
            f"127.0.0.1:{port}",
            "--controller",
            ",".join(self.controller_addresses),
            "--host",
            "127.0.0.1",
            "--accelerators",
            ",".join(str(i) for i in self.node_accelerators(index)),
            "--accelerator-type",
            self.accelerator_type,
            "--port-range",
            f"{first_engine_port}-{first_engine_port + 499}",
            "--state-dir",
            os.path.join(self.run_dir, node_id),
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--abnormal-threshold",
            str(self.abnormal_threshold),
            "--engine-command",
            script_path("engine_server"),
            *self._metrics_args(node_id, 1 + index),
            *self.tls_flags(node_id),
            *(["--model-roots", ",".join(self.model_roots)] if self.model_roots else []),
            *self.extra_node_args,
        ]

    def node_accelerators(self, index: int) -> list[int]:
        if not self.host_accelerators:
            return list(range(self.accelerators_per_node))
        first = index * self.accelerators_per_node
        return list(self.host_accelerators[first : first + self.accelerators_per_node])

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in reversed(self.processes) if p.name == name)

    @staticmethod
    def wait_serving(
        address: str, timeout: float, credentials: Credentials = Credentials(), process: ManagedProcess | None = None
    ) -> None:
        """Until `address` serves; a `process` that exits meanwhile is named at once, with its last log line."""
        deadline = time.monotonic() + timeout
        with credentials.channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if process is not None and process.process.poll() is not None:
                    raise ProcessExited(
                        f"the {process.name} exited with code {process.process.returncode} at start: "
                        f"{last_line(process.log_path)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{address} did not start serving within {timeout:.0f}s")
                time.sleep(0.1)

    def controller(self, channel: grpc.Channel) -> controller_pb2_grpc.ControllerServiceStub:
        return controller_pb2_grpc.ControllerServiceStub(channel)

    def wait_nodes_registered(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.credentials().channel(self.controller_address) as channel:
            stub = self.controller(channel)
            while True:
                nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
                if sum(n.state == controller_pb2.NODE_STATE_READY for n in nodes) >= count:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{count} nodes did not register within {timeout:.0f}s")
                time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> list[str]:
        """Stop the controller, then engines (through their node managers), then node managers.

        The controller goes first so that it cannot restart the engines being stopped; node
        managers leave engines running when they exit (a restart re-adopts them), so engines are
        stopped explicitly. Returns what had to be killed or was found left over."""
        self.front_door.stop()  # nothing is started again from here on
        problems: list[str] = self._terminate([p for p in self.processes if p.name.startswith(FRONT)], timeout)
        if self.door_socket is not None:
            self.door_socket.close()
        controllers = [p for p in self.processes if p.name.startswith("controller")]
        node_managers = [p for p in self.processes if not p.name.startswith(("controller", *FRONT))]
        problems += self._terminate(controllers, timeout)
        for node_id, port in self.node_ports.items():
            if all(p.process.poll() is not None for p in node_managers if p.name == node_id):
                continue
            try:
                stop_node_engines(f"127.0.0.1:{port}", timeout, self.credentials("controller"))
            except grpc.RpcError as exc:
                problems.append(f"{node_id}: could not stop its engines ({exc.code().name})")
        problems += self._terminate(node_managers, timeout)
        if self.etcd is not None:
            self.etcd.stop()
        # Whatever still carries this run's tag: engines of a node manager that died, anything
        # that escaped its parent (motorctl/run_processes.py).
        for leftover in stop_run(self.run_dir, timeout):
            problems.append(f"left-over process {leftover} of this cluster; stopped")
        return problems

    @staticmethod
    def _terminate(processes: list[ManagedProcess], timeout: float) -> list[str]:
        problems = []
        for managed in processes:
            if managed.process.poll() is None:
                os.killpg(managed.process.pid, signal.SIGTERM)
        for managed in processes:
            try:
                managed.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                problems.append(f"{managed.name} ignored SIGTERM; killed")
                os.killpg(managed.process.pid, signal.SIGKILL)
                managed.process.wait()
        return problems
