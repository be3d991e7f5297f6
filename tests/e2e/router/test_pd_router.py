"""`motorctl up --router-pd`: the real vllm-router in its prefill/decode flow in front of the
example deployment (one prefill instance of two data-parallel ranks, one decode instance, on the
simulated engine): the sync files prefill and decode engines as the router's prefill and decode
workers, and each request is prefilled on a prefill engine, then decoded on the decode engine."""

from __future__ import annotations

import json
import os
import re

import grpc
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from tests.support import REPO_ROOT, wait_for
from tests.support.open_load import http
from tests.support.router_process import routed_cluster

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from routed_cluster(
        tmp_path_factory, "pd", deployment_path=DEPLOYMENT, engine_port_base=37000, router_pd=True
    )


def typed_workers(cluster) -> dict[str, str]:
    """The router's workers: url -> worker type."""
    status, text = http("GET", cluster.router_url + "/workers")
    assert status == 200, text
    return {w["url"]: w["worker_type"] for w in json.loads(text)["workers"]}


def engine_urls(cluster) -> dict[int, list[str]]:
    with grpc.insecure_channel(cluster.controller_address) as channel:
        listed = controller_pb2_grpc.ControllerServiceStub(channel).ListEndpoints(
            controller_pb2.ListEndpointsRequest(), timeout=5
        )
    urls: dict[int, list[str]] = {}
    for e in listed.endpoints:
        urls.setdefault(e.role, []).append(e.url)
    return urls


def legs(url: str) -> dict[str, float]:
    """What one simulated engine served of each leg of the P/D flow (its /metrics)."""
    status, text = http("GET", url + "/metrics")
    assert status == 200
    found = {"prefill": 0.0, "decode": 0.0}
    for leg, value in re.findall(r'^sim:kv_transfer_legs_total\{leg="(\w+)",model="sim-tiny"\} (\S+)$', text, re.M):
        found[leg] = float(value)
    return found


def test_each_request_is_prefilled_on_a_prefill_engine_and_decoded_on_the_decode_engine(cluster):
    urls = {}

    def listed() -> bool:
        urls.update(engine_urls(cluster))
        want = {u: "prefill" for u in urls.get(types_pb2.ROLE_PREFILL, [])}
        want.update({u: "decode" for u in urls.get(types_pb2.ROLE_DECODE, [])})
        return len(want) == 3 and typed_workers(cluster) == want

    wait_for(listed, timeout=90, interval=0.3, what="two prefill workers and one decode worker in the router")
    prefill, decode = urls[types_pb2.ROLE_PREFILL], urls[types_pb2.ROLE_DECODE]
    before = {u: legs(u) for u in prefill + decode}

    status, text = http("POST", cluster.router_url + "/v1/completions", {"model": "sim-tiny", "prompt": "a b c"})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["text"]
    status, text = http(
        "POST",
        cluster.router_url + "/v1/chat/completions",
        {"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"]
    status, text = http(
        "POST", cluster.router_url + "/v1/completions", {"model": "sim-tiny", "prompt": "go", "stream": True}
    )
    assert status == 200, text
    assert text.rstrip().endswith("data: [DONE]")

    after = {u: legs(u) for u in prefill + decode}
    served = {u: {leg: after[u][leg] - before[u][leg] for leg in after[u]} for u in after}
    assert sum(served[u]["prefill"] for u in prefill) == 3, served
    assert all(served[u]["decode"] == 0 for u in prefill), served
    assert served[decode[0]] == {"prefill": 0, "decode": 3}, served
