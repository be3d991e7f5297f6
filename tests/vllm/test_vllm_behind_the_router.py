"""The real vLLM CPU engine behind `motorctl up`'s router (vllm-router and motor-router-sync):
completions, chat and a stream through the router, and the engine out of the router once its
deployment is deleted (before it has stopped)."""

from __future__ import annotations

import json
import os

import pytest

from motor.v1 import controller_pb2
from tests.support import wait_for
from tests.support.open_load import http
from tests.support.vllm_engines import vllm_cluster, vllm_config, wait_listed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def routed(tiny_model, vllm_env, tmp_path_factory):
    with vllm_cluster(
        tiny_model,
        vllm_env,
        str(tmp_path_factory.mktemp("vllm-routed")),
        # The deployment's model is the name the engine serves: the router files it under it.
        vllm_config(tiny_model, served_model_name=os.path.basename(tiny_model))["motor_engine_prefill_config"],
        lambda local, stub: wait_listed(stub),
        node_id_prefix="vllm",
        engine_port_base=38000,
        router=True,
    ) as (local, stub):
        yield local, stub


def workers(local) -> list[str]:
    status, text = http("GET", local.router_url + "/list_workers")
    assert status == 200, text
    return json.loads(text)["urls"]


def test_completions_chat_and_a_stream_through_the_router_then_delete_removes_the_engine(routed):
    local, stub = routed
    endpoint = stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints[0]
    url, model = endpoint.url, endpoint.models[0]
    wait_for(lambda: workers(local) == [url], timeout=30, interval=0.2, what="the vLLM engine in the router")
    status, text = http("GET", local.router_url + "/v1/models")
    # The front door (motorctl up's default) answers OpenAI's list of the models it routes.
    assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == [model], text
    status, text = http(
        "POST", local.router_url + "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 3}, timeout=60
    )
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
    status, text = http("POST", local.router_url + "/v1/completions", {"model": "gpt-x", "prompt": "Hello"})
    assert status == 404 and json.loads(text)["error"]["message"].endswith(f"Valid aliases: {model}."), text
    status, text = http(
        "POST",
        local.router_url + "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert status == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant", text
    status, text = http(
        "POST",
        local.router_url + "/v1/completions",
        {"model": model, "prompt": "Hello", "max_tokens": 3, "stream": True},
        timeout=60,
    )
    assert status == 200 and text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 3, text
    stub.DeleteDeployment(controller_pb2.DeleteDeploymentRequest(), timeout=10)
    wait_for(lambda: workers(local) == [], timeout=5, interval=0.05, what="the engine out of the router")
