"""Hostile reports and replacements against real processes (a real controller, real node
managers, sim engine servers): a heartbeat listing 20,000 made-up engines is refused naming
--max-engines-per-node and the cluster carries on; a replaced deployment waits for
the accelerators its old engines hold while they drain."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request

import grpc
import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.controller_harness import made_up
from tests.support.process_cluster import apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


def test_a_heartbeat_listing_20000_made_up_engines_is_refused_and_nothing_is_fenced(make_cluster):
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment())
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    generation = cluster.node_list().nodes[0].generation
    flood = C.HeartbeatRequest(node_id="node-a", generation=generation, engines=made_up("node-a", 20_000))
    with pytest.raises(grpc.RpcError) as unary:
        cluster.stub().Heartbeat(flood, timeout=30)
    assert unary.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reports 20000 engines" in unary.value.details() and "max_engines_per_node=1024" in unary.value.details()
    stream = cluster.stub().StreamHeartbeats(iter([C.StreamHeartbeatsRequest(heartbeat=flood)]), timeout=30)
    with pytest.raises(grpc.RpcError) as streamed:
        list(stream)
    assert (
        streamed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "--max-engines-per-node" in streamed.value.details()
    )
    with pytest.raises(grpc.RpcError) as registered:
        cluster.stub().RegisterNode(
            C.RegisterNodeRequest(node=cluster.node_list().nodes[0].info, engines=flood.engines), timeout=30
        )
    assert registered.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Nothing of it was taken: no copy fenced, the real node and its engine carry on.
    assert not [e for e in cluster.events() if e.type == C.EVENT_TYPE_ENGINE_FENCED]
    node = cluster.node_list().nodes[0]
    assert node.state == C.NODE_STATE_READY and node.generation == generation
    assert {e.engine_id for e in node.engines} == {"u-0/rank0"}
    assert cluster.all_ready(1)


def sim_group(
    name: str, count: int, drain_timeout: float = 0, latency_ms: float = 1, strategy: str = "rolling", **policy
) -> C.Deployment:
    section = {
        "engine_type": "sim",
        "engine_args": {"model": "sim-tiny", "latency_ms": latency_ms},
        "health_check_config": {"enable_virtual_inference": False},
    }
    if drain_timeout:
        section["drain_timeout"] = drain_timeout
    return deployment_from_dict(
        {
            # One deployment whatever the group: applying another group replaces the first.
            "name": "hostile",
            "model": "sim-tiny",
            "engine_config": {"motor_engine_union_config": section},
            "instance_groups": [{"name": name, "role": "union", "count": count, "accelerators_per_engine": 1}],
            "restart_policy": {"initial_backoff": "1s", "max_backoff": "4s", **policy},
            "strategy": {"type": strategy},
        }
    )


def complete(url: str) -> None:
    body = json.dumps({"model": "sim-tiny", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    with contextlib.suppress(OSError):
        urllib.request.urlopen(request, timeout=60).read()


def test_a_replacement_waits_for_the_draining_engines_accelerators_instead_of_failing(make_cluster):
    """Hostile F7: deployment a (4 engines, a request in flight on each, so each stop drains for
    seconds) replaced by b, whose 4 engines need the same 4 accelerators, with a crash-loop budget
    of 3: b is not placed on accelerators a's copies still hold, a start refused for them is a
    wait, not a failure, and b ends READY with no restart. Replaced at once (`recreate`): a rolling
    update keeps a renamed group serving until the new one serves, which a full node never allows."""
    cluster = make_cluster(nodes=1, accelerators=4)
    apply(cluster, sim_group("a", 4, drain_timeout=30, latency_ms=6000))
    wait_for(lambda: cluster.all_ready(4), timeout=90, interval=0.2, what="a's 4 instances READY")
    urls = [f"http://{e.spec.host}:{e.spec.port}/v1/completions" for e in cluster.engine_copies().values()]
    requests = [threading.Thread(target=complete, args=(u,), daemon=True) for u in urls]
    for thread in requests:
        thread.start()
    time.sleep(1)  # the requests are in flight: each of a's stops drains them first
    apply(cluster, sim_group("b", 4, strategy="recreate", max_failures=3))
    wait_for(
        lambda: cluster.all_ready(4) and set(cluster.instances()) == {f"b-{i}" for i in range(4)},
        timeout=120,
        interval=0.2,
        what="b's 4 instances READY",
        detail=cluster.describe,
    )
    events = cluster.events()
    assert all(i.restarts == 0 for i in cluster.instances().values()), cluster.describe()
    assert not [e for e in events if e.type == C.EVENT_TYPE_ENGINE_FAILED and e.instance_id.startswith("b-")], (
        cluster.describe()
    )
    # b waited for placement while node-a still reported a's copies (or, when a report lagged, its
    # start was refused and tried again: one RETRYING event per engine, its count growing).
    waited = [e for e in events if e.type == C.EVENT_TYPE_RETRYING and e.instance_id.startswith("b-")]
    assert all("in use by" in e.message for e in waited), cluster.describe()
    assert len({e.engine_id for e in waited}) == len(waited)
    for thread in requests:
        thread.join(timeout=60)


def test_an_instance_placed_on_a_node_registered_at_another_nodes_address_runs_elsewhere(make_cluster):
    """Hostile F9 (what 1dbcd44 left): node-c registers with node-a's node-manager address and
    keeps heartbeating; the instance placed on it is refused there by node-a's node manager (not
    node-c's). node-c is set aside (its state reason says why, an event names
    --advertise-address) and the instance runs on a healthy node, with no restart spent."""
    cluster = make_cluster(nodes=2, accelerators=4)
    apply(cluster, sim_group("u", 1))
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="u-0 READY")
    first = {k: e.pid for k, e in cluster.engine_copies().items()}
    victim = cluster.node_list().nodes[0].info
    registered = cluster.stub().RegisterNode(
        C.RegisterNodeRequest(
            node=C.NodeInfo(
                node_id="node-c", address=victim.address, host="127.0.0.1", accelerator_ids=[3], accelerator_type="sim"
            )
        ),
        timeout=10,
    )
    stop = threading.Event()

    def heartbeat_as_node_c():
        while not stop.wait(0.3):
            with contextlib.suppress(grpc.RpcError):
                cluster.stub().Heartbeat(
                    C.HeartbeatRequest(node_id="node-c", generation=registered.generation), timeout=5
                )

    beating = threading.Thread(target=heartbeat_as_node_c, daemon=True)
    beating.start()
    try:
        apply(cluster, sim_group("u", 2))  # u-1 fits node-c best (its one free accelerator)
        wait_for(
            lambda: cluster.all_ready(2), timeout=90, interval=0.2, what="u-0 and u-1 READY", detail=cluster.describe
        )
        nodes = {n.info.node_id: n for n in cluster.node_list().nodes}
        assert nodes["node-c"].state == C.NODE_STATE_READY, (
            cluster.describe()
        )  # still heartbeating: set aside, not lost
    finally:
        stop.set()
        beating.join()
    assert (
        "answers as another node" in nodes["node-c"].state_reason
        and "--advertise-address" in nodes["node-c"].state_reason
    )
    u1 = cluster.instances()["u-1"]
    assert u1.restarts == 0 and u1.engines[0].node_id != "node-c", cluster.describe()
    events = cluster.events()
    told = [e for e in events if e.type == C.EVENT_TYPE_NODE_CONFLICT and e.node_id == "node-c"]
    assert (
        told and "--advertise-address" in told[0].message and f"node {victim.node_id}'s node manager" in told[0].message
    )
    assert not [e for e in events if e.type == C.EVENT_TYPE_ENGINE_FAILED], cluster.describe()
    assert {k: e.pid for k, e in cluster.engine_copies().items() if k[1] == "u-0/rank0"} == first  # u-0 untouched
