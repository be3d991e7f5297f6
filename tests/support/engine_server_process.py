"""A real engine_server process (the simulated engine by default): its config, start, status watch, and
the fixture that starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest

from motor.ports import free_port
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from tests.support import wait_for

ENGINE_SERVER = os.path.join(os.path.dirname(sys.executable), "engine_server")  # this interpreter's console script


# Short intervals so that a test sees many probe rounds in a few seconds.
FAST_HEALTH_CHECK = {
    "enable_virtual_inference": True,
    "probe_interval": 0.3,
    "busy_probe_interval": 1.5,
    "utilization_window": 0.1,
    "utilization_sample_period": 0.05,
    "probe_timeout": 1.0,
    "max_failure_count": 3,
    "health_poll_interval": 0.1,
}


def sim_config(
    role: str = "prefill", engine_args: dict | None = None, health: dict | None = None, **section: Any
) -> dict:
    return {
        f"motor_engine_{role}_config": {
            "engine_type": "sim",
            "engine_args": engine_args or {},
            "health_check_config": {**FAST_HEALTH_CHECK, **(health or {})},
            **section,
        }
    }


class EngineServerProcess:
    """One `engine_server` child in its own process group, with helpers to reach both planes."""

    def __init__(
        self, tmp_path, config: dict, role: str = "prefill", instance_id: str = "prefill-0", extra_args=(),
        port: int | None = None, mgmt_port: int | None = None,
    ):  # fmt: skip
        self.tmp_path = tmp_path
        self._started = (config, role, instance_id, tuple(extra_args))
        # Ports picked here may be taken by another listener before the child binds them (free_port
        # is racy by nature): such a start is made once more on new ports (`wait_status`).
        self._repick = port is None and mgmt_port is None
        self._launch(port or free_port(), mgmt_port or free_port())
        self._channel: grpc.Channel | None = None

    def _launch(self, port: int, mgmt_port: int) -> None:
        config, role, instance_id, extra_args = self._started
        self.port, self.mgmt_port = port, mgmt_port
        self.config_path = self.tmp_path / f"user_config_{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = self.tmp_path / f"engine_server_{self.port}.out"
        self.args = [
            ENGINE_SERVER, "--dp-rank", "0", "--instance-id", instance_id, "--role", role,
            "--host", "127.0.0.1", "--port", str(self.port), "--mgmt-port", str(self.mgmt_port),
            "--master-dp-ip", "127.0.0.1", "--config-path", str(self.config_path),
            "--log-dir", str(self.tmp_path / "logs"), *extra_args,
        ]  # fmt: skip
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stub(self) -> engine_pb2_grpc.EngineServiceStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.mgmt_port}")
        return engine_pb2_grpc.EngineServiceStub(self._channel)

    def status(self) -> types_pb2.EngineStatus:
        return self.stub().GetStatus(engine_pb2.GetStatusRequest(), timeout=5).status

    def wait_status(self, health: int, timeout: float = 30.0) -> types_pb2.EngineStatus:
        def reached():
            if self.process.poll() is not None and self._repick and "in use" in self.output:
                self._repick = False  # its port taken meanwhile: once more, on new ports
                self._log.close()
                self._launch(free_port(), free_port())
                self._channel = None
                return None
            assert self.process.poll() is None, f"engine_server exited with {self.process.returncode}:\n{self.output}"
            status = self.status()
            return status if status.status == health else None

        return wait_for(reached, timeout=timeout, interval=0.1, what=f"status {types_pb2.HealthStatus.Name(health)}")

    def http(self, method: str, path: str, body: Any = None, headers: dict | None = None, timeout: float = 10.0):
        """(status, parsed JSON or text) of one request to the inference plane."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def set_faults(self, **faults: Any) -> dict:
        status, answer = self.http("POST", "/sim/faults", faults)
        assert status == 200, answer
        return answer

    def metrics(self) -> dict[str, float]:
        status, text = self.http("GET", "/metrics")
        assert status == 200
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture
def engine_server(tmp_path):
    """Factory: engine_server(config, role=...) starts a real process, killed at the test's end."""
    started: list[EngineServerProcess] = []

    def start(config: dict, **kwargs: Any) -> EngineServerProcess:
        process = EngineServerProcess(tmp_path, config, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def watch(process: EngineServerProcess, timeout: float = 30.0):
    """A WatchProbes stream (an iterator of messages) that is cancelled after `timeout`."""
    return process.stub().WatchProbes(engine_pb2.WatchProbesRequest(), timeout=timeout)


def elapsed_since(start: float) -> float:
    return time.monotonic() - start
