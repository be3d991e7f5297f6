"""Real service processes for the grpcurl and client tests, started as a user starts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor.ports import free_port
from tests.support import REPO_ROOT

BIN = os.path.dirname(sys.executable)


class Service:
    """A command in its own process group, its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])

    def wait_serving(self, address: str, timeout: float = 60) -> None:
        """Until grpc.health.v1 says SERVING; fails with the log when the process dies or hangs."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if (
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise AssertionError(f"{self.name} not serving on {address} after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (e.g. engines of a node manager that hung)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def start_engine_server(log_dir: str, config_path: str = "examples/user_config.json") -> tuple[Service, str]:
    """A standalone sim engine server (prefill-0 rank 0) on free ports; returns it and its mgmt address."""
    port, mgmt_port = free_port(), free_port()
    argv = [
        os.path.join(BIN, "engine_server"),
        "--instance-id",
        "prefill-0",
        "--dp-rank",
        "0",
        "--role",
        "prefill",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--mgmt-port",
        str(mgmt_port),
        "--master-dp-ip",
        "127.0.0.1",
        "--config-path",
        config_path,
        "--log-dir",
        log_dir,
    ]
    service = Service("engine_server", argv, log_dir)
    address = f"127.0.0.1:{mgmt_port}"
    _serving_or_stopped(service, address)
    return service, address


def start_node_manager(
    log_dir: str, node_id: str = "node-a", controller: str | None = None, port_range: str = "30000-30999"
) -> tuple[Service, str]:
    """A node manager on a free port, standalone unless `controller` is given."""
    address = f"127.0.0.1:{free_port()}"
    argv = [
        os.path.join(BIN, "motor-node-manager"),
        "--node-id",
        node_id,
        "--listen",
        address,
        "--state-dir",
        os.path.join(log_dir, node_id),
        "--accelerators",
        "0,1,2,3",
        "--accelerator-type",
        "sim",
        "--port-range",
        port_range,
        "--engine-command",
        os.path.join(BIN, "engine_server"),
        "--metrics-port",
        "0",  # tests run side by side: no fixed metrics port
    ]
    if controller:
        argv += ["--controller", controller]
    service = Service(node_id, argv, log_dir)
    _serving_or_stopped(service, address)
    return service, address


def _serving_or_stopped(service: Service, address: str) -> None:
    """Wait until the service serves at `address`; stop it if it never does."""
    try:
        service.wait_serving(address)
    except BaseException:
        service.stop()
        raise
