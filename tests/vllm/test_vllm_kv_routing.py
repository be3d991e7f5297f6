"""KV routing on real vLLM CPU engines, as `motorctl up --kv-routing` wires it: two engines of the
tiny model publishing their KV events, the door asking an engine's /tokenize for a text prompt's
ids (front_door/kv_tokenize.py) and cutting them at the engines' own block size (128 tokens on
vLLM's CPU backend). Requests that share a prefix of a full block land on the engine that cached
it, and vLLM itself reports the prefix-cache hits."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from front_door.kv_index import PENDING_S
from motor.v1 import controller_pb2
from motorctl.up import KV_ROUTING_CONTROLLER, KV_ROUTING_DOOR
from tests.support import wait_for
from tests.support.open_load import http
from tests.support.scraped import kv_decisions, metric
from tests.support.vllm_engines import START_TIMEOUT, vllm_cluster, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def routed(tiny_model, vllm_env, tmp_path_factory):
    model = os.path.basename(tiny_model)
    # No probes: their prompts would be cache hits of their own.
    section = vllm_config(tiny_model, health={"enable_virtual_inference": False}, served_model_name=model)
    with vllm_cluster(
        tiny_model,
        vllm_env,
        str(tmp_path_factory.mktemp("vllm-kv-routing")),
        section["motor_engine_prefill_config"],
        lambda local, stub: both_listed(stub),
        node_id_prefix="vkv",
        engine_port_base=37760,
        engines=2,
        router=True,
        controller_args=KV_ROUTING_CONTROLLER,
        door_args=KV_ROUTING_DOOR,
    ) as (local, stub):
        yield local, stub, model


def both_listed(stub) -> list[controller_pb2.Endpoint]:
    def listed():
        endpoints = list(stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints)
        return endpoints if len(endpoints) == 2 else None

    return wait_for(listed, timeout=START_TIMEOUT, interval=0.5, what="both vLLM engines listed")


def decisions(local, reason: str) -> float:
    return kv_decisions(local.router_url, reason)


def ask(local, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    status, text = http("POST", local.router_url + "/v1/completions", body=body, timeout=120)
    assert status == 200, text


def test_a_shared_prefix_lands_on_the_vllm_engine_that_cached_it(routed):
    local, stub, model = routed
    listed = both_listed(stub)
    for endpoint in listed:
        assert endpoint.kv_events.startswith("tcp://127.0.0.1:") and endpoint.tokenizer, endpoint
        # vLLM's publisher listens where its engine's HTTP does (loopback), not on every address.
        port = int(endpoint.kv_events.rsplit(":", 1)[1])
        listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, (endpoint.kv_events, listening)
    urls = [e.url for e in listed]
    body = {"model": model, "prompt": "the cat sat on the mat and "}
    status, text = http("POST", urls[0] + "/tokenize", body=body, timeout=30)
    assert status == 200, text
    per_phrase = len(json.loads(text)["tokens"]) - 1  # (its BOS once)
    system = "the cat sat on the mat and " * (150 // per_phrase)  # past one 128-token block, within 256

    def door_chooses() -> bool:  # a short prompt: tokenized by an engine, no full block: balanced
        ask(local, model, "hello")
        return decisions(local, "balanced") > 0

    wait_for(door_chooses, timeout=60, interval=0.5, what="the door's KV routing learns the engines")
    time.sleep(1.0)  # (a ZMQ subscription joins a moment after it connects: events before it are lost)

    served_before = {url: metric(url, "vllm:request_success_total") for url in urls}
    ask(local, model, system + "first")
    holder = max(urls, key=lambda url: metric(url, "vllm:request_success_total") - served_before[url])
    wait_for(
        lambda: metric(local.router_url, "motor_front_door_kv_indexed_blocks") >= 1,
        timeout=20,
        interval=0.2,
        what="the holder's BlockStored events (128-token blocks) in the door's index",
    )
    time.sleep(PENDING_S + 0.5)  # what the door sent counts as cached a while: past it, only the events do
    hits_before = metric(holder, "vllm:prefix_cache_hits_total")
    cached_before = decisions(local, "cached")
    for n in range(4):
        ask(local, model, system + f"question {n}")
    served = {url: metric(url, "vllm:request_success_total") - served_before[url] for url in urls}
    assert served == {url: 5 if url == holder else 0 for url in urls}, served
    assert decisions(local, "cached") - cached_before == 4
    hits = metric(holder, "vllm:prefix_cache_hits_total") - hits_before
    assert hits >= 4 * 128, f"vLLM found {hits} prompt tokens cached: the door's ids are not the engine's"
