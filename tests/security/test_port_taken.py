"""A second controller, node manager or engine server given a gRPC port another one already holds
exits 2 naming the setting and the address, instead of sharing the port (gRPC binds with
SO_REUSEPORT by default, so two controllers once served one port and split its callers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor.contract.termination import PORT_TAKEN, read_termination_message
from motor.ports import free_port
from tests.support import REPO_ROOT, wait_for

pytestmark = pytest.mark.processes


def _controller(tmp_path, name: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "controller.cli",
        "--listen",
        f"127.0.0.1:{port}",
        "--db",
        str(tmp_path / f"{name}.db"),
        "--metrics-port",
        "0",
    ]


def _node_manager(tmp_path, name: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "node_manager.cli",
        "--node-id",
        name,
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(tmp_path / name),
        "--metrics-port",
        "0",
    ]


def _engine_server(tmp_path, name: str, port: int) -> list[str]:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({"motor_engine_prefill_config": {"engine_type": "sim", "engine_args": {}}}))
    return [
        sys.executable,
        "-m",
        "engine_server.cli",
        "--dp-rank",
        "0",
        "--instance-id",
        name,
        "--role",
        "prefill",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--mgmt-port",
        str(port),
        "--master-dp-ip",
        "127.0.0.1",
        "--config-path",
        str(config),
        "--log-dir",
        str(tmp_path / f"{name}-logs"),
        "--termination-message-path",
        str(tmp_path / f"{name}.termination"),
    ]


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "command, setting", [(_controller, "listen"), (_node_manager, "listen"), (_engine_server, "--mgmt-port")]
)
def test_a_second_server_on_a_taken_port_exits_2_naming_the_setting(tmp_path, command, setting):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    port = free_port()
    with open(tmp_path / "first.out", "wb") as first_out:
        first = subprocess.Popen(
            command(tmp_path, "first", port), env=env, cwd=REPO_ROOT, stdout=first_out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(
            lambda: _serving(port),
            timeout=60,
            what="the first server to serve",
            detail=lambda: (tmp_path / "first.out").read_text(),
        )
        second = subprocess.run(
            command(tmp_path, "second", port), env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
        output = second.stdout + second.stderr
        assert second.returncode == 2, output
        assert f"{setting}: cannot listen on 127.0.0.1:{port}: 127.0.0.1:{port} is in use" in output, output
        assert "Traceback" not in output and "Failed to add port" not in output, (
            output
        )  # one line, gRPC's own not added
        assert first.poll() is None and _serving(port)  # the first one keeps its port, alone
        if command is _engine_server:  # the moment's trouble, not a refusal of its spec (issue 61 #13)
            assert read_termination_message(str(tmp_path / "second.termination")).cause == PORT_TAKEN
        listeners = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert len(listeners.strip().splitlines()) == 1, listeners
    finally:
        first.terminate()
        first.wait(timeout=30)
