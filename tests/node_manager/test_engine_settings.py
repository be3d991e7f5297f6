"""What a node manager's own settings hand down to the engine servers it launches (real node
manager, real engine server processes): reflection, the message and stream limits, and the
SGLang launcher. A request never sets any of them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import grpc
import psutil
import pytest

from motor.errors import ConfigError
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from node_manager.cli import load_config
from node_manager.engine import RUNNING
from tests.support import require
from tests.support.fake_sglang import SCRIPT as FAKE_SGLANG_SCRIPT

FAKE_SGLANG = FAKE_SGLANG_SCRIPT


def _grpcurl() -> str:
    path = shutil.which("grpcurl", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    require(path is not None, "grpcurl")
    return path


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(0x80 | value & 0x7F)
        value >>= 7
    return bytes(out + bytes([value]))


async def _list_services(mgmt_port: int) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(
        subprocess.run,
        [_grpcurl(), "-plaintext", f"127.0.0.1:{mgmt_port}", "list"],
        capture_output=True,
        text=True,
        timeout=30,
    )


async def _running(node, **kwargs) -> types_pb2.Engine:
    engine = await node.start(**kwargs)
    return await node.wait_state(engine.engine_id, RUNNING, timeout=60)


@pytest.mark.processes
async def test_engines_keep_reflection_and_default_limits_by_default(make_node):
    engine = await _running(await make_node())
    listed = await _list_services(engine.spec.mgmt_port)
    assert listed.returncode == 0 and "motor.v1.EngineService" in listed.stdout, listed.stderr


@pytest.mark.processes
async def test_engines_get_the_node_managers_reflection_and_limits(make_node):
    node = await make_node(reflection=False, max_message_bytes=65536, max_streams_per_caller=2)
    engine = await _running(node)
    address = f"127.0.0.1:{engine.spec.mgmt_port}"

    listed = await _list_services(engine.spec.mgmt_port)
    assert listed.returncode != 0 and "does not support the reflection API" in listed.stderr, (
        listed.stdout,
        listed.stderr,
    )

    async with grpc.aio.insecure_channel(address) as channel:
        # A GetStatus carrying 100 kB in field 1000 (unknown to it): over the node manager's 64 KiB limit.
        oversized = _varint(1000 << 3 | 2) + _varint(100_000) + bytes(100_000)
        get_status = channel.unary_unary(
            "/motor.v1.EngineService/GetStatus", response_deserializer=engine_pb2.GetStatusResponse.FromString
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await get_status(oversized, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "vs. 65536" in refused.value.details(), refused.value.details()

        # Three streams from this host (the node manager's own WatchProbes comes from it too): over 2.
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        streams = [stub.WatchProbes(engine_pb2.WatchProbesRequest(), timeout=10) for _ in range(3)]
        outcomes = []
        for stream in streams:
            try:
                await stream.read()
                outcomes.append("open")
            except grpc.aio.AioRpcError as exc:
                outcomes.append(f"{exc.code().name}: {exc.details()}")
        for stream in streams:
            stream.cancel()
    assert any("RESOURCE_EXHAUSTED" in o and "max_streams_per_caller=2" in o for o in outcomes), outcomes


@pytest.mark.processes
async def test_sglang_engines_run_the_node_managers_launcher(make_node, tmp_path, monkeypatch):
    state = tmp_path / "fake-sglang"
    state.mkdir()
    monkeypatch.setenv("FAKE_SGLANG_STATE", str(state))  # the engines inherit the node manager's environment
    node = await make_node(sglang_launcher=f"{sys.executable} {FAKE_SGLANG}")
    config = {"motor_engine_prefill_config": {"engine_type": "sglang", "engine_args": {"model_path": "sim-tiny"}}}
    engine = await _running(node, config_json=json.dumps(config))

    launch = json.loads((state / "launch.json").read_text())
    assert launch["argv"][:2] == ["--model-path", "sim-tiny"]
    assert launch["pid"] in {p.pid for p in psutil.Process(engine.pid).children(recursive=True)}
    ran = psutil.Process(launch["pid"]).cmdline()
    assert ran[:2] == [sys.executable, FAKE_SGLANG], ran


@pytest.mark.parametrize("launcher", ["python3 -m sglang.launch_server", "/no/such/launcher", "", "/etc/passwd"])
def test_an_sglang_launcher_must_be_an_executable_named_by_absolute_path(launcher):
    with pytest.raises(ConfigError) as refused:
        load_config(["--node-id", "node-a", "--sglang-launcher", launcher])
    assert "sglang_launcher" in str(refused.value) and "absolute path of an executable" in str(refused.value)
