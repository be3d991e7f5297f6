"""`motorctl up`'s router: the real vllm-router and motor-router-sync in front of a local cluster
(the example deployment on simulated engine servers), requests sent through it."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc
from motorctl.run_processes import run_processes
from tests.support import REPO_ROOT, wait_for
from tests.support.open_load import OpenLoad, http
from tests.support.router_checks import all_three_routed, router_workers
from tests.support.router_process import routed_cluster

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from routed_cluster(
        tmp_path_factory, "routed", deployment_path=DEPLOYMENT, abnormal_threshold=5, engine_port_base=33000
    )


def test_requests_through_the_router_reach_every_engine(cluster):
    all_three_routed(cluster)
    status, text = http(
        "POST", cluster.router_url + "/v1/completions", {"model": "sim-tiny", "prompt": "hello", "max_tokens": 4}
    )
    assert status == 200 and json.loads(text)["choices"][0]["text"], text
    status, text = http(
        "POST",
        cluster.router_url + "/v1/chat/completions",
        {"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"], text
    status, text = http(
        "POST",
        cluster.router_url + "/v1/completions",
        {"model": "sim-tiny", "prompt": "hello", "max_tokens": 4, "stream": True},
    )
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text


def engine_pid(cluster, engine_id: str) -> tuple[int, str]:
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        instances = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
        engine = next(e for i in instances for e in i.engines if e.engine_id == engine_id)
    with grpc.insecure_channel(f"127.0.0.1:{cluster.node_ports[engine.node_id]}") as channel:
        node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        got = node.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=engine_id), timeout=5).engine
    return got.pid, f"http://{got.spec.host}:{got.spec.port}"


def test_a_hung_engine_server_leaves_the_router_within_3s_long_before_the_kill(cluster):
    all_three_routed(cluster)
    pid, url = engine_pid(cluster, "decode-0/rank0")
    assert url in router_workers(cluster)
    # Open-loop load: requests already sent to the hung engine wait, the ones sent after its removal must not.
    with OpenLoad(cluster.router_url) as load:
        time.sleep(1)
        hang = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(
                lambda: url not in router_workers(cluster), timeout=10, interval=0.02, what="the hung engine removed"
            )
            withdrawn = time.monotonic() - hang
            # The kill comes at the 5th missed heartbeat (about 5 s): the router let it go well before.
            assert withdrawn < 3.0, f"removed from the router {withdrawn:.2f}s after the hang"
            time.sleep(2)
            after = [r for r in load.results if hang + withdrawn + 0.1 < r[0] < time.monotonic() - 1]
            assert len(after) > 10 and all(
                status == 200 and answered - sent < 1.0 for sent, status, answered in after
            ), after
        finally:
            os.kill(pid, signal.SIGCONT)
    # Killed and restarted by Motor, then added back.
    wait_for(lambda: len(router_workers(cluster)) == 3, timeout=90, interval=0.2, what="the replacement added back")


def test_the_router_and_its_sync_carry_the_run_tag_that_motorctl_down_and_the_guardian_find(cluster):
    tagged = {p.pid for p in run_processes(cluster.run_dir)}
    for name in ("router", "router-sync", "front-door"):
        assert cluster.process(name).process.pid in tagged, f"{name} would outlive `motorctl down`"
