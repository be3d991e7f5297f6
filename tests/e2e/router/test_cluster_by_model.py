"""`motorctl up`'s front door and router, started the default way (no flag), in front of two
deployments of different models on one local cluster: requests by model reach only that model's
engines, also after one deployment is deleted; OpenAI's model list; vLLM's 404 naming the served
models; a request without `model`."""

from __future__ import annotations

import json

import grpc
import pytest

from motor.v1 import controller_pb2 as C
from motor.v1 import controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.local_cluster import started
from tests.support.model_routing import answers
from tests.support.open_load import http
from tests.support.process_cluster import model_deployment
from tests.support.router_checks import router_workers


@pytest.fixture
def cluster(tmp_path):
    local = LocalCluster(str(tmp_path), nodes=1, heartbeat_interval=1.0, engine_port_base=34000, router_port=0)
    yield from started(local)


def test_requests_by_model_through_motorctl_ups_router(cluster):
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)

        def listed() -> set[str]:
            return {e.url for e in stub.ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints}

        def routed(count: int) -> bool:
            return len(listed()) == count and router_workers(cluster) == listed()

        for deployment in (model_deployment("chat", "sim-chat", 2), model_deployment("embed", "sim-embed", 1)):
            stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment), timeout=10)
        wait_for(lambda: routed(3), timeout=90, interval=0.2, what="three engines of two models in the router")
        assert answers(cluster.router_url, "sim-chat") == [(200, "sim-chat")] * 12
        assert answers(cluster.router_url, "sim-embed") == [(200, "sim-embed")] * 12
        assert set(answers(cluster.router_url, "no-such-model")) == {(404, "NotFoundError")}
        status, text = http("POST", cluster.router_url + "/v1/completions", {"model": "x", "prompt": "hi"})
        assert "Valid aliases: sim-chat, sim-embed." in json.loads(text)["error"]["message"]
        status, text = http("GET", cluster.router_url + "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == ["sim-chat", "sim-embed"]
        status, text = http("POST", cluster.router_url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 400 and "`model`" in json.loads(text)["error"]["message"]

        stub.DeleteDeployment(C.DeleteDeploymentRequest(name="embed"), timeout=10)
        wait_for(lambda: routed(2), timeout=60, interval=0.2, what="the embed engine out of the router")
        assert answers(cluster.router_url, "sim-chat") == [(200, "sim-chat")] * 12
        assert set(answers(cluster.router_url, "sim-embed")) == {(404, "NotFoundError")}
        status, text = http("POST", cluster.router_url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and json.loads(text)["model"] == "sim-chat"  # the one model left
