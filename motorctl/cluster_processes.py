"""The processes of a local cluster, one at a time: a console script found, a started process and
its log, a port checked free before and answered by it after, a node manager's engines stopped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from motor.ports import port_is_free
from motor.v1 import node_manager_pb2, node_manager_pb2_grpc
from motorctl.connect import Credentials
from motorctl.port_holder import describe_holder, listening_pids

DEFAULT_CONTROLLER_PORT = 50051


def script_path(name: str) -> str:
    """A console script of this installation (next to the running interpreter), else from PATH."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    return local if os.path.exists(local) else (shutil.which(name) or name)


@dataclass
class ManagedProcess:
    name: str
    process: subprocess.Popen
    log_path: str


class ProcessExited(RuntimeError):
    """A process of the cluster ended while it was being started."""


class PortTaken(RuntimeError):
    """A port this cluster's controller needs is held by another process."""


def check_port_free(port: int) -> None:
    """Before the controller starts: its port must be free, or its health check would be answered
    by whatever holds it (another cluster's controller) and this cluster would join that one."""
    if not port_is_free(port, "127.0.0.1"):
        raise PortTaken(
            f"controller port {port} is taken by {describe_holder(port)}: give another --controller-port, "
            f"or leave it out to take {DEFAULT_CONTROLLER_PORT} or a free port"
        )


def check_answered_by(managed: ManagedProcess, port: int) -> None:
    """The controller that answered on `port` is the process this cluster started (the port may
    have been taken between the check and the controller's bind)."""
    if managed.process.pid not in listening_pids(port):
        raise PortTaken(
            f"controller port {port} is answered by {describe_holder(port)}, not by this cluster's "
            f"{managed.name} (pid {managed.process.pid}: {last_line(managed.log_path)}); give another --controller-port"
        )


def last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as log:
        lines = [line.strip() for line in log if line.strip()]
    return lines[-1] if lines else "(nothing in its log)"


def stop_node_engines(address: str, timeout: float = 30.0, credentials: Credentials = Credentials()) -> None:
    """Stop every engine of the node manager at `address` (engines outlive their node manager);
    under TLS as the controller, the only caller a node manager lets stop engines."""
    with credentials.channel(address) as channel:
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        for engine in stub.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5).engines:
            stub.StopEngine(node_manager_pb2.StopEngineRequest(engine_id=engine.engine_id), timeout=timeout)
