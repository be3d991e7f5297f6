"""A stream cut by its engine's death is never silently truncated through `motorctl up`'s front
door (front_door/streams.py), where the door does not go on with it (here `--stream-continuations 0`;
also n > 1, stop strings, no engine left: tests/front_door/test_stream_continuation.py): the router
alone ends it without its terminating chunk and without `[DONE]` (tests/e2e/router/test_failover.py);
through the door, the client reads the events that came, then an OpenAI error event, then the
answer's proper end. (Gone on with, by default: tests/e2e/router/test_door_stream_continuation.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import httpx
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.e2e.router.test_failover import engine_pid
from tests.support import wait_for, write_sim_deployment


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cut-stream")
    local = LocalCluster(
        str(directory),
        nodes=1,
        deployment_path=write_sim_deployment(directory / "sim.yaml", count=1),
        heartbeat_interval=1.0,
        engine_port_base=36800,
        router_port=0,
        door_args=["--stream-continuations=0"],
    )
    try:
        local.start(timeout=60)
        yield local
    finally:
        local.stop()


def the_endpoint(cluster) -> controller_pb2.Endpoint | None:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        listed = controller_pb2_grpc.ControllerServiceStub(channel).ListEndpoints(
            controller_pb2.ListEndpointsRequest(), timeout=5
        )
    return listed.endpoints[0] if len(listed.endpoints) == 1 else None


def serving(cluster) -> bool:
    body = {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}
    try:
        return httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def cut_streams(cluster) -> float:
    with urllib.request.urlopen(cluster.router_url + "/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('motor_front_door_streams_cut_total{model="sim-tiny"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stream_whose_engine_server_is_sigkilled_ends_with_an_error_event(cluster):
    endpoint = wait_for(lambda: the_endpoint(cluster), timeout=60, interval=0.3, what="the engine serving")
    pid = engine_pid(cluster, endpoint)
    wait_for(lambda: serving(cluster), timeout=60, interval=0.3, what="sim-tiny answering through the door")
    # 100,000 tokens take the simulated engine seconds to stream: the kill lands mid-way (the router
    # refuses a million: "No available workers").
    body = {"model": "sim-tiny", "prompt": "x", "max_tokens": 100_000, "stream": True}
    lines, killed_at = [], None
    # (through the router alone, this read raises httpx.RemoteProtocolError: incomplete chunked read)
    with httpx.stream("POST", cluster.router_url + "/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            lines.append(line)
            if len(lines) == 400 and killed_at is None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
    ended_at = time.monotonic()
    assert killed_at is not None and ended_at - killed_at < 5.0, "the cut stream hung"
    events = [line for line in lines if line]
    assert "data: [DONE]" not in events, "the cut stream ended as if complete"
    assert all(json.loads(event[len("data: ") :])["choices"] for event in events[:-1])
    error = json.loads(events[-1][len("data: ") :])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", error
    assert cut_streams(cluster) == 1
