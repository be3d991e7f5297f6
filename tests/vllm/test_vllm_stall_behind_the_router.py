"""vLLM #39863's shape behind `motorctl up`'s router: two real vLLM CPU engines, the real
vllm-router under a little load (non-streamed completions), and one engine's EngineCore process
SIGSTOPped (its API server and /health stay up). At Motor's default stall settings: the engine
leaves the router within seconds (2 s measured), the requests it held are failed back and answered by the other
engine (none fails), and it is killed and replaced."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest

from motor.v1 import controller_pb2, engine_pb2, engine_pb2_grpc
from tests.support import wait_for
from tests.support.open_load import OpenLoad, http
from tests.support.vllm_engines import START_TIMEOUT, engine_core_of, vllm_cluster, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# stall_timeout (2 s) and the way to the router (engine server, node manager, controller, router
# sync): 2.0 s measured alone, 3.9 s once in CI with both engines busy on 2 cores. A bound, not a figure.
OUT_OF_THE_ROUTER_S = 5.0
FAILED_BACK_WITHIN_S = 8.0  # the goal is 15 s; the kill comes after stall_kill_after (10 s)
# Long enough answers that each engine holds a request or two at any moment (the tiny model on
# 2 cores: roughly 0.3 to 1 s for 96 tokens).
COMPLETION = {"prompt": "tell me a long story", "max_tokens": 96, "ignore_eos": True}


@pytest.fixture(scope="module")
def routed(tiny_model, vllm_env, tmp_path_factory):
    model = os.path.basename(tiny_model)
    # Motor's defaults (stall_timeout, stall_kill_after, virtual inference off).
    section = vllm_config(tiny_model, health={"enable_virtual_inference": False}, served_model_name=model)
    with vllm_cluster(
        tiny_model,
        vllm_env,
        str(tmp_path_factory.mktemp("vllm-stall-routed")),
        section["motor_engine_prefill_config"],
        both_routed,
        node_id_prefix="vstall",
        engine_port_base=37700,
        engines=2,
        router=True,
    ) as (local, stub):
        yield local, stub, model


def workers(local) -> set[str]:
    status, text = http("GET", local.router_url + "/list_workers", timeout=5)
    assert status == 200, text
    return set(json.loads(text)["urls"])


def both_routed(local, stub, timeout: float = START_TIMEOUT) -> list[controller_pb2.Endpoint]:
    def ready():
        endpoints = list(stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints)
        return endpoints if len(endpoints) == 2 and workers(local) == {e.url for e in endpoints} else None

    return wait_for(ready, timeout=timeout, interval=0.5, what="both vLLM engines in the router")


def engine_of(stub, engine_id: str):
    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
    return next(e for n in nodes for e in n.engines if e.engine_id == engine_id)


def in_flight(engine) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{engine.spec.mgmt_port}") as channel:
        status = engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    return status.status.in_flight_requests


def test_sigstop_of_one_engine_core_behind_the_router_leaves_it_fails_back_and_loses_no_request(routed):
    local, stub, model = routed
    victim_endpoint = both_routed(local, stub)[0]
    victim = engine_of(stub, victim_endpoint.engine_id)
    core = engine_core_of(victim.pid)
    with OpenLoad(
        local.router_url, period=0.25, timeout=110, body={**COMPLETION, "model": model}, join_timeout=120
    ) as load:
        wait_for(lambda: in_flight(victim) >= 1, timeout=30, interval=0.02, what="a request in flight on the victim")
        os.kill(core.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: victim_endpoint.url not in workers(local), timeout=30, interval=0.05, what="out of the router")
        out_after = time.monotonic() - stopped_at
        status, _ = http("GET", victim_endpoint.url + "/health", timeout=5)
        time.sleep(6)  # load goes on with one engine
    try:
        assert status == 200  # the API server lived: /health could not see this hang
        print(f"out of the router {out_after:.2f} s after the SIGSTOP; {len(load.results)} requests")
        assert out_after <= OUT_OF_THE_ROUTER_S, f"still in the router {out_after:.2f} s after the SIGSTOP"
        failed = [r for r in load.results if r[1] != 200]
        assert failed == [], f"{len(failed)} of {len(load.results)} failed: {failed[:5]}"
        caught = [r for r in load.results if r[0] < stopped_at < r[2]]
        assert caught, "no request was in flight at the SIGSTOP"
        longest = max(answered - sent for sent, _, answered in caught)
        print(f"{len(caught)} requests caught by the SIGSTOP, the longest answered after {longest:.2f} s")
        # Failed back at the stall and retried by the router, well before the kill (stall_kill_after 10 s).
        assert longest <= FAILED_BACK_WITHIN_S, f"a caught request waited {longest:.1f} s"

        def replaced():
            engine = engine_of(stub, victim_endpoint.engine_id)
            return engine if engine.pid != victim.pid else None

        wait_for(replaced, timeout=60, interval=0.5, what="the stalled engine killed and replaced")
        assert not core.is_running() or core.status() == "zombie"
    finally:
        if core.is_running():
            try:
                os.kill(core.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    both_routed(local, stub)
