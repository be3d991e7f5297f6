"""KV routing wired through a whole cluster, as `motorctl up --kv-routing` starts it: the controller
with --kv-events (every engine gets a KV-events port from its node manager, listed with its
endpoint), motor-router-sync pushing the engines to the front door, the door with --kv-routing
subscribing to each engine's events. No hand wiring: requests that share a long prefix land on
the engine that cached it."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
import yaml

from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.up import KV_ROUTING_CONTROLLER, KV_ROUTING_DOOR
from tests.support import wait_for
from tests.support.router_process import routed_cluster
from tests.support.scraped import kv_decisions, metric

pytestmark = pytest.mark.processes

MODEL = "sim-tiny"
SYSTEM = " ".join(f"rule{n}" for n in range(320))  # 20 blocks of 16 tokens
DEPLOYMENT = {
    "name": "sim",
    "model": MODEL,
    "instance_groups": [{"name": "u", "role": "union", "count": 2, "accelerators_per_engine": 1}],
    "engine_config": {
        "motor_engine_union_config": {
            "engine_type": "sim",
            "engine_args": {"model": MODEL, "kv_cache_blocks": 64, "prefill_ms_per_token": 1},
            # No probes: their prompts would be cache hits of their own.
            "health_check_config": {"enable_virtual_inference": False},
        }
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    deployment = tmp_path_factory.mktemp("kv-routing-deployment") / "sim.yaml"
    deployment.write_text(yaml.safe_dump(DEPLOYMENT))
    yield from routed_cluster(
        tmp_path_factory,
        "kv-routing-cluster",
        deployment_path=str(deployment),
        engine_port_base=37300,
        extra_controller_args=list(KV_ROUTING_CONTROLLER),
        door_args=list(KV_ROUTING_DOOR),
    )


def endpoints(cluster) -> list:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        return list(stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints)


def decisions(cluster, reason: str) -> float:
    return kv_decisions(cluster.router_url, reason)


def ask(cluster, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    reply = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text


def test_a_shared_prefix_lands_on_the_engine_that_cached_it(cluster):
    wait_for(lambda: len(endpoints(cluster)) == 2, timeout=60, interval=0.2, what="two engines listed")
    listed = endpoints(cluster)
    for endpoint in listed:  # each engine's KV events travel with its endpoint
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", endpoint.kv_events), endpoint
        assert endpoint.tokenizer == "sim" and endpoint.generation >= 1, endpoint
    assert len({e.kv_events for e in listed}) == 2

    # The sync pushes the engines to the door: its KV routing chooses an engine (short prompts:
    # no full block, so the least loaded), where without them it leaves every request to the router.
    def door_chooses() -> bool:
        ask(cluster, "hello")
        return decisions(cluster, "balanced") > 0

    wait_for(door_chooses, timeout=30, interval=0.2, what="the door's KV routing learns the engines")
    time.sleep(0.5)  # (a ZMQ subscription joins a moment after it connects: events before it are lost)

    urls = [e.url for e in listed]
    hits_before = {url: metric(url, "vllm:prefix_cache_hits_total") for url in urls}
    served_before = {url: metric(url, "vllm:request_success_total") for url in urls}
    ask(cluster, f"{SYSTEM} first")
    holder = max(urls, key=lambda url: metric(url, "vllm:request_success_total") - served_before[url])
    wait_for(
        lambda: metric(cluster.router_url, "motor_front_door_kv_indexed_blocks") >= 20,
        timeout=10,
        interval=0.1,
        what="the holder's BlockStored events in the door's index",
    )
    for n in range(6):
        ask(cluster, f"{SYSTEM} question {n}")
    served = {url: metric(url, "vllm:request_success_total") - served_before[url] for url in urls}
    assert served == {url: 7 if url == holder else 0 for url in urls}, served
    hits = metric(holder, "vllm:prefix_cache_hits_total") - hits_before[holder]
    assert hits == 6 * 320, hits  # each repeat found the 20 blocks cached
    assert decisions(cluster, "cached") == 6


def test_an_engine_killed_and_restarted_comes_back_with_an_empty_index(cluster):
    """The controller restarts a SIGKILLed engine as a new copy: Motor stops listing the old one
    (the door drops its index) and lists the new generation, whose cache is empty: a prefix the
    old copy held is not `cached` there."""
    ask(cluster, f"{SYSTEM} warm")  # whichever engine holds the prefix (the first test's, or this one's)
    listed = {e.url: e for e in endpoints(cluster)}
    holder = max(listed, key=lambda url: metric(url, "vllm:prefix_cache_hits_total"))
    old = listed[holder]
    with cluster.credentials().channel(cluster.controller_address) as channel:
        nodes = controller_pb2_grpc.ControllerServiceStub(channel).ListNodes(
            controller_pb2.ListNodesRequest(), timeout=5
        )
    pid = next(e.pid for n in nodes.nodes for e in n.engines if e.engine_id == old.engine_id)
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        now = {e.engine_id: e for e in endpoints(cluster)}
        return len(now) == 2 and now[old.engine_id].generation > old.generation

    wait_for(restarted, timeout=90, interval=0.2, what=f"{old.engine_id} restarted as a new copy")
    time.sleep(1.5)  # the sync's push, then the door's subscription to the new copy
    cached, balanced = decisions(cluster, "cached"), decisions(cluster, "balanced")
    ask(cluster, f"{SYSTEM} after the restart")
    assert (decisions(cluster, "cached"), decisions(cluster, "balanced")) == (cached, balanced + 1)
    time.sleep(0.5)  # (its BlockStored events reach the door)
    for n in range(3):
        ask(cluster, f"{SYSTEM} again {n}")
    assert decisions(cluster, "cached") == cached + 3
