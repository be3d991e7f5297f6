"""The real vLLM CPU engine inside engine_server: its config, the server process and its engine core,
metrics parsing, a small cluster of them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import util as import_util
from typing import Any

import grpc
import psutil
import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.ports import free_port
from motor.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    types_pb2,
)
from motorctl.local_cluster import LocalCluster
from motorctl.tiny_model import LEAN_CPU_ARGS
from tests.support import wait_for

ENGINE_SERVER = os.path.join(os.path.dirname(sys.executable), "engine_server")  # this interpreter's console script


# A generous bound on vLLM's start-up (20 s measured alone; slower while other tests run).
START_TIMEOUT = 240.0


NORMAL = types_pb2.HEALTH_STATUS_NORMAL


ABNORMAL = types_pb2.HEALTH_STATUS_ABNORMAL


INIT = types_pb2.HEALTH_STATUS_INIT


SUCCESS = types_pb2.PROBE_OUTCOME_SUCCESS


FAILURE = types_pb2.PROBE_OUTCOME_FAILURE


def offline_vllm_env(cache: str) -> dict[str, str]:
    """The variables vLLM runs on the tiny model with here: offline, no usage reports, its caches
    under `cache` (for the tests and the benches alike)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    }


def vllm_installed() -> bool:
    return import_util.find_spec("vllm") is not None


@contextmanager
def vllm_cluster(
    tiny_model: str,
    vllm_env: dict[str, str],
    run_dir: str,
    section: dict[str, Any],
    serving: Callable[[LocalCluster, controller_pb2_grpc.ControllerServiceStub], object],
    *,
    node_id_prefix: str,
    engine_port_base: int,
    engines: int = 1,
    router: bool = False,
    env: dict[str, str] | None = None,
    controller_args: tuple[str, ...] = (),
    door_args: tuple[str, ...] = (),
) -> Iterator[tuple[LocalCluster, controller_pb2_grpc.ControllerServiceStub]]:
    """A LocalCluster of one node manager (its engines inherit its environment: `vllm_env`, and
    `env`) with a deployment "vllm" of `engines` prefill instances on the tiny model, each engine
    set as `section` (a vllm_config's motor_engine_prefill_config), `router`: behind the front
    door. Yields (cluster, controller stub) once `serving(cluster, stub)`; stopped at the end,
    nothing left to kill."""
    local = LocalCluster(
        run_dir,
        nodes=1,
        node_id_prefix=node_id_prefix,
        accelerators_per_node=engines,
        engine_port_base=engine_port_base,
        router_port=0 if router else None,
        extra_node_args=["--model-root", os.path.dirname(tiny_model)],
        extra_controller_args=list(controller_args),
        door_args=list(door_args),
    )
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**vllm_env, **(env or {})}.items():
            patch.setenv(name, value)
        try:
            local.start(timeout=60)
        except BaseException:
            local.stop()
            raise
    channel = grpc.insecure_channel(local.controller_address)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        stub.ApplyDeployment(controller_pb2.ApplyDeploymentRequest(deployment=deployment_from_dict({
            "name": "vllm", "model": served_name(section),
            "engine_config": {"motor_engine_prefill_config": section},
            "instance_groups": [{"name": "prefill", "role": "prefill", "count": engines}],
        })), timeout=10)  # fmt: skip
        serving(local, stub)
        yield local, stub
    finally:
        channel.close()
        problems = local.stop()
        assert not problems, problems


def served_name(section: dict[str, Any]) -> str:
    """The name a vLLM section's engines serve (vLLM's served_model_name, else its model), which a
    deployment must name as its model: the controller refuses a deployment whose engines would
    answer its model's requests 404."""
    args = section["engine_args"]
    served = args.get("served_model_name") or args["model"]
    return served[0] if isinstance(served, list) else served


def vllm_config(model: str, health: dict[str, Any] | None = None, role: str = "prefill", **engine_args: Any) -> dict:
    return {
        f"motor_engine_{role}_config": {
            "engine_type": "vllm",
            "engine_args": {"model": model, **LEAN_CPU_ARGS, **engine_args},
            "health_check_config": {"enable_virtual_inference": True, **(health or {})},
            "drain_timeout": 10,
        }
    }


class Watcher:
    """Reads a WatchProbes stream in a thread; `events` holds (receive time, message)."""

    def __init__(self, channel: grpc.Channel):
        self.events: list[tuple[float, engine_pb2.WatchProbesResponse]] = []
        self.ended = threading.Event()
        self._call = engine_pb2_grpc.EngineServiceStub(channel).WatchProbes(engine_pb2.WatchProbesRequest())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                self.events.append((time.monotonic(), message))
        except grpc.RpcError:
            pass
        finally:
            self.ended.set()

    def probes(self, since: float = 0.0) -> list[tuple[float, types_pb2.ProbeResult]]:
        return [(at, m.probe) for at, m in list(self.events) if at >= since and m.HasField("probe")]

    def statuses(self) -> list[types_pb2.EngineStatus]:
        return [m.status for _, m in list(self.events)]

    def cancel(self) -> None:
        self._call.cancel()


class VllmServer:
    """One `engine_server` child with the vLLM engine, in its own session."""

    def __init__(self, tmp_path, config: dict, env: dict[str, str], role: str = "prefill"):
        self.port, self.mgmt_port = free_port(), free_port()
        self.config_path = tmp_path / f"user_config_{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = tmp_path / f"engine_server_{self.port}.out"
        self.termination_path = tmp_path / f"termination_{self.port}"
        self._log = open(self.log_path, "wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [
                ENGINE_SERVER,
                "--dp-rank",
                "0",
                "--instance-id",
                f"{role}-0",
                "--role",
                role,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--mgmt-port",
                str(self.mgmt_port),
                "--master-dp-ip",
                "127.0.0.1",
                "--config-path",
                str(self.config_path),
                "--log-dir",
                str(tmp_path / "logs"),
                "--termination-message-path",
                str(self.termination_path),
            ],  # fmt: skip
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.mgmt_port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._known: dict[int, psutil.Process] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def status(self) -> types_pb2.EngineStatus:
        return self.stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=10).status

    def watch(self) -> Watcher:
        return Watcher(self.channel)

    def wait_mgmt_up(self) -> None:
        def up():
            assert self.process.poll() is None, (
                f"engine_server exited with {self.process.returncode}:\n{self.output[-3000:]}"
            )
            grpc.channel_ready_future(self.channel).result(timeout=1)
            return True

        wait_for(up, timeout=60, interval=0.2, what="the management plane")

    def wait_status(self, wanted: int, timeout: float = START_TIMEOUT) -> types_pb2.EngineStatus:
        def reached():
            assert self.process.poll() is None, (
                f"engine_server exited with {self.process.returncode}:\n{self.output[-3000:]}"
            )
            status = self.status()
            return status if status.status == wanted else None

        return wait_for(reached, timeout=timeout, interval=0.5, what=f"status {types_pb2.HealthStatus.Name(wanted)}")

    def tree(self) -> list[psutil.Process]:
        """The engine server's descendants (the engine core and its workers), remembered for cleanup."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            self._known[child.pid] = child
        return children

    def engine_core(self) -> psutil.Process:
        core = engine_core_of(self.process.pid)
        self._known[core.pid] = core
        return core

    def termination_message(self):
        from motor.contract.termination import read_termination_message

        return read_termination_message(str(self.termination_path))

    def http(self, path: str, body: dict | None = None, headers: dict | None = None, timeout: float = 30) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
        return json.loads(text) if body is not None else text

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.http("/metrics"))[0]

    def kill_all(self) -> None:
        """Kill the engine server's group and every descendant seen (the engine core's group too)."""
        self.tree()
        for sig_target in [self.process.pid] + list(self._known):
            try:
                os.killpg(sig_target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for process in self._known.values():
            try:
                process.kill()
            except psutil.Error:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.channel.close()
        self._log.close()


def engine_core_of(engine_server_pid: int) -> psutil.Process:
    """vLLM's engine-core process: the engine server's child that leads its own process group (the
    engine server moves it there) and that vLLM titles `VLLM::EngineCore`. Other children may lead
    groups of their own (after long prompts a SIGSTOP of the first such child once stopped a helper,
    not the core): the title decides, else the largest of them (the core holds the model)."""
    leaders = []
    for child in psutil.Process(engine_server_pid).children():
        try:
            if os.getpgid(child.pid) == child.pid:
                leaders.append((child, " ".join(child.cmdline()) + " " + child.name(), child.memory_info().rss))
        except (psutil.Error, ProcessLookupError):
            continue
    if not leaders:
        raise AssertionError(f"no engine-core process under the engine server (pid {engine_server_pid})")
    titled = [child for child, title, _ in leaders if "EngineCore" in title]
    return titled[0] if titled else max(leaders, key=lambda leader: leader[2])[0]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus text -> ({'name{labels}': value}, {family name: type})."""
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values, types


def start_server(tmp_path, config: dict, env: dict[str, str], request, role: str = "prefill") -> VllmServer:
    server = VllmServer(tmp_path, config, env, role=role)
    request.addfinalizer(server.kill_all)
    return server


ENGINE = "prefill-0/rank0"


def wait_listed(stub) -> None:
    def listed():
        instances = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
        assert all(i.state != controller_pb2.INSTANCE_STATE_FAILED for i in instances), instances
        return [
            e
            for e in stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints
            if e.engine_id == ENGINE
        ]

    def instances() -> str:
        return str(stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5))

    wait_for(listed, timeout=START_TIMEOUT, interval=0.5, what=f"{ENGINE} (vLLM) listed for routers", detail=instances)
