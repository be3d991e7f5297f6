"""A stream whose engine server is SIGKILLed mid-answer goes on with another engine through
`motorctl up`'s front door and the real vllm-router (front_door/continuation.py): the client reads one
uninterrupted stream, token for token the answer it would have had, with one id, the whole answer's
usage and `[DONE]`; the door counts and logs the continuation. (Cut with continuations off, the same
stream ends with an error event: tests/e2e/router/test_door_cut_stream.py.)

Two simulated engines of a deterministic model (each token a function of every id before it), a
token every 2 ms: the kill lands mid-way through a 1,500-token answer."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import grpc
import httpx
import pytest
import yaml

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2, controller_pb2_grpc, engine_pb2, engine_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.router_checks import apply
from tests.support.stream_faults import router_decisions

pytestmark = pytest.mark.processes
TOKENS = 1500


# A leaving engine (a scale-down, a rollout) is given half a second for its requests, then killed.
DEPLOYMENT = {
    "name": "sim",
    "model": "sim-tiny",
    "instance_groups": [{"name": "u", "role": "union", "count": 2, "accelerators_per_engine": 1}],
    "engine_config": {
        "motor_engine_union_config": {
            "engine_type": "sim",
            "engine_args": {"model": "sim-tiny", "decode_ms_per_token": 2.0},
            "drain_timeout": 0.5,
        }
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stream-continuation")
    (directory / "sim.yaml").write_text(yaml.safe_dump(DEPLOYMENT))
    local = LocalCluster(
        str(directory),
        nodes=2,
        deployment_path=str(directory / "sim.yaml"),
        heartbeat_interval=1.0,
        engine_port_base=36900,
        router_port=0,
    )
    try:
        local.start(timeout=60)
        yield local
    finally:
        local.stop()


def endpoints(cluster) -> list:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        return list(stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints)


def engines(cluster) -> list:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        listed = {e.engine_id for e in stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints}
        nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
    return [e for n in nodes for e in n.engines if e.engine_id in listed]


def in_flight(engine) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{engine.spec.mgmt_port}") as channel:
        status = engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    return status.status.in_flight_requests


def serving_two(cluster) -> bool:
    if len(engines(cluster)) != 2:
        return False
    body = {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}
    try:
        return httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def door_metric(cluster, name: str, **labels) -> float:
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    with urllib.request.urlopen(cluster.router_url + "/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(wanted):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def read_stream(cluster, path: str, body: dict, kill_after: int | None = None) -> tuple[list, bool]:
    """The stream's events (JSON, or "[DONE]"); with `kill_after`, the engine serving it is SIGKILLed
    after that many events."""
    events, killed = [], False
    with httpx.stream("POST", cluster.router_url + path, json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if kill_after is not None and len(events) == kill_after and not killed:
                busy = [e for e in engines(cluster) if in_flight(e) >= 1]
                assert len(busy) == 1, "one engine should be serving the stream"
                os.kill(busy[0].pid, signal.SIGKILL)
                killed = True
    return events, killed


def text(events: list, chat: bool) -> str:
    choices = [c for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    return "".join((c.get("delta") or {}).get("content") or "" if chat else c.get("text", "") for c in choices)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "a long answer, please"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a long answer, please"}]}),
    ],
    ids=["completion", "chat"],
)
def test_a_stream_whose_engine_is_sigkilled_goes_on_token_for_token_on_another(cluster, path, body):
    wait_for(lambda: serving_two(cluster), timeout=90, interval=0.3, what="two sim engines serving through the door")
    body = {**body, "model": "sim-tiny", "max_tokens": TOKENS, "stream": True, "temperature": 0}
    body["stream_options"] = {"include_usage": True}
    chat = path.endswith("chat/completions")
    reference, _ = read_stream(cluster, path, body)
    assert reference[-1] == "[DONE]" and reference[-2]["usage"]["completion_tokens"] == TOKENS
    before = door_metric(cluster, "motor_front_door_continuations_total", model="sim-tiny", reason="broken")

    events, killed = read_stream(cluster, path, body, kill_after=300)

    assert killed
    assert events[-1] == "[DONE]", events[-3:]
    answers = [e for e in events if isinstance(e, dict)]
    assert not [e for e in answers if "error" in e], [e for e in answers if "error" in e]
    assert text(events, chat) == text(reference, chat)  # no token missing or repeated
    assert len({e["id"] for e in answers}) == 1 and len({e["object"] for e in answers}) == 1
    assert answers[-1]["usage"] == [e for e in reference if isinstance(e, dict)][-1]["usage"]
    assert not any("token_ids" in c or "prompt_token_ids" in c for e in answers for c in e.get("choices", []))
    assert not any("prompt_token_ids" in e for e in answers)
    after = door_metric(cluster, "motor_front_door_continuations_total", model="sim-tiny", reason="broken")
    assert after == before + 1
    with open(os.path.join(cluster.run_dir, "logs", "front-door.log"), encoding="utf-8") as handle:
        log = handle.read()
    assert "stream continued: POST " + path in log


def test_streams_on_an_engine_scaled_down_past_its_drain_grace_go_on_on_the_other(cluster):
    wait_for(lambda: serving_two(cluster), timeout=90, interval=0.3, what="two sim engines serving through the door")
    body = {"model": "sim-tiny", "prompt": "scale me down", "max_tokens": TOKENS, "stream": True, "temperature": 0}
    reference, _ = read_stream(cluster, "/v1/completions", body)
    before = door_metric(cluster, "motor_front_door_continuations_total", model="sim-tiny", reason="broken")
    before += door_metric(cluster, "motor_front_door_continuations_total", model="sim-tiny", reason="ended")
    decided = router_decisions(cluster)
    got: list = [None] * 6

    def one(i: int) -> None:
        got[i] = read_stream(cluster, "/v1/completions", body)[0]

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # begun (3 s of tokens each): the leaving engine's are still under way at its grace's end
    try:
        apply(
            cluster,
            deployment_from_dict({**DEPLOYMENT, "instance_groups": [{**DEPLOYMENT["instance_groups"][0], "count": 1}]}),
        )
        for thread in threads:
            thread.join(timeout=60)
        staying = {e.url.rstrip("/") for e in endpoints(cluster)}
        moved = {url.rstrip("/"): n - decided.get(url, 0.0) for url, n in router_decisions(cluster).items()}
        on_leaving = sum(n for url, n in moved.items() if url not in staying and n > 0)
        assert on_leaving >= 1, f"no stream went to the engine that left: {moved}, staying {staying}"
        for events in got:
            assert events is not None and events[-1] == "[DONE]", events and events[-2:]
            assert text(events, chat=False) == text(reference, chat=False)
        after = door_metric(cluster, "motor_front_door_continuations_total", model="sim-tiny", reason="broken")
        after += door_metric(cluster, "motor_front_door_continuations_total", model="sim-tiny", reason="ended")
        assert after - before >= on_leaving
    finally:
        apply(cluster, deployment_from_dict(DEPLOYMENT))
