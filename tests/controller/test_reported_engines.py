"""What a node reports about its engines is checked like any other request (issue 11 "ids with
fullmatch", issue 12 defects 6 and 8): an engine id not of the form '<instance_id>/rank<n>' or a
text field with a control character is INVALID_ARGUMENT naming the field (`engines[1].engine_id`),
on Heartbeat, StreamHeartbeats and RegisterNode alike, and nothing of it is stored or fenced; a
node id is checked before it is looked up. Against a real controller, node manager and engine."""

from __future__ import annotations

import os

import grpc
import psutil
import pytest

from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.controller.test_real_processes import apply, make_cluster, sim_deployment  # noqa: F401 (fixture)
from tests.support import wait_for


def reported(engine_id: str, host: str = "127.0.0.1", **spec) -> T.Engine:
    return T.Engine(engine_id=engine_id, node_id="node-a", state=T.ENGINE_STATE_RUNNING,
                    spec=T.EngineSpec(**{"instance_id": "zz-0", "role": T.ROLE_UNION, "generation": 1, "port": 30000,
                                         "host": host, **spec}))


# (the bad engine, the field the refusal must start with)
BAD_ENGINES = [
    (reported("bogus\n/rank0"), "engines[1].engine_id"),
    (reported("x" * 100_000 + "/rank0"), "engines[1].engine_id"),
    (reported("zz-0/rank0\n"), "engines[1].engine_id"),
    (reported("zz-0/rank0", host="10.0.0.1\x00evil"), "engines[1].spec.host"),
    (reported("zz-0/rank0", master_dp_ip="10.0.0.1\nx"), "engines[1].spec.master_dp_ip"),
]


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_reported_engines_with_a_bad_id_or_a_control_character_are_refused_and_nothing_is_kept(make_cluster):
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment())
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    node = cluster.node_list().nodes[0]
    real = next(e for e in node.engines if e.engine_id == "u-0/rank0")
    for bad, field in BAD_ENGINES:
        beat = C.HeartbeatRequest(node_id="node-a", generation=node.generation, engines=[real, bad])
        for name, call in [
            ("Heartbeat", lambda: cluster.stub().Heartbeat(beat, timeout=10)),
            ("delta Heartbeat", lambda: cluster.stub().Heartbeat(
                C.HeartbeatRequest(node_id="node-a", generation=node.generation, engines=[real, bad], delta=True), timeout=10)),
            ("StreamHeartbeats", lambda: list(cluster.stub().StreamHeartbeats(
                iter([C.StreamHeartbeatsRequest(heartbeat=beat)]), timeout=10))),
            ("RegisterNode", lambda: cluster.stub().RegisterNode(
                C.RegisterNodeRequest(node=node.info, engines=[real, bad]), timeout=10)),
        ]:
            error = refusal(call)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, field, error.details()[:300])
            path = f"heartbeat.{field}" if name == "StreamHeartbeats" else field  # the stream message's field
            assert error.details().startswith(path + " "), (name, error.details()[:300])
            assert len(error.details()) < 500, (name, len(error.details()))
    # Nothing of it was kept: no copy fenced, the node's generation and engines as before.
    events = cluster.events()
    assert not [e for e in events if e.type == C.EVENT_TYPE_ENGINE_FENCED], cluster.describe()
    assert all(len(e.message) < 1000 and "\n" not in e.message and "\x00" not in e.message for e in events)
    after = cluster.node_list().nodes[0]
    assert after.state == C.NODE_STATE_READY and after.generation == node.generation
    assert {e.engine_id for e in after.engines} == {"u-0/rank0"}
    assert all(e.spec.host == real.spec.host for e in after.engines)
    assert cluster.all_ready(1)
    with open(os.path.join(cluster.run_dir, "logs", "controller.log"), errors="replace") as log:
        text = log.read()
    assert "bogus\n" not in text and "x" * 1000 not in text and "\x00" not in text


def test_a_heartbeat_from_a_bad_node_id_is_invalid_argument_not_not_found(make_cluster):
    """The id rule before the lookup: a node id no node can have is a bad request, not an
    unknown node (a node manager told NOT_FOUND registers again, forever)."""
    cluster = make_cluster(nodes=1)
    for node_id in ["node-a\n", "n" * (1 << 20), "Node-A"]:
        refused_everywhere(cluster, node_id)


def refused_everywhere(cluster, node_id: str) -> None:
    beat = C.HeartbeatRequest(node_id=node_id, generation=1)
    for path, call in (
        ("node_id", lambda: cluster.stub().Heartbeat(beat, timeout=10)),
        ("heartbeat.node_id", lambda: list(cluster.stub().StreamHeartbeats(iter([C.StreamHeartbeatsRequest(heartbeat=beat)]), timeout=10))),
        ("node_id", lambda: cluster.stub().ReportEngineEvent(C.ReportEngineEventRequest(
            node_id=node_id, generation=1, engine=T.Engine(engine_id="u-0/rank0")), timeout=10)),
    ):
        error = refusal(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()[:300]
        assert error.details().startswith(path + " "), error.details()[:300]
        assert len(error.details()) < 500


def test_the_check_names_the_first_bad_engine_and_passes_good_ones():
    """The plain rule (controller/validation.py) beside the real-process tests above."""
    from motor.errors import InvalidArgument

    from controller.validation import check_reported_engines

    good = [reported(f"zz-{i}/rank{i}") for i in range(4)]
    check_reported_engines(good)
    check_reported_engines([])
    for bad, field in BAD_ENGINES:
        with pytest.raises(InvalidArgument) as refused:
            check_reported_engines([good[0], bad, reported("also\nbad/rank0")])
        assert str(refused.value).startswith(field + " ") and len(str(refused.value)) < 500
    for field in ("node_id", "log_path"):
        with pytest.raises(InvalidArgument, match=rf"^engines\[0\]\.{field} "):
            check_reported_engines([T.Engine(engine_id="zz-0/rank0", **{field: "a\x1bb"})])
    for field in ("instance_id", "config_path"):
        with pytest.raises(InvalidArgument, match=rf"^reported\[0\]\.spec\.{field} "):
            check_reported_engines([reported("zz-0/rank0", **{field: "a\x7fb"})], where="reported")


def test_a_node_reporting_another_nodes_engine_under_its_own_id_leaves_that_engine_alone(make_cluster):
    """The NodeRestriction rule's other half (issue 11): node-b may speak only for itself, and
    what it says about node-a's engine (FAILED, or running elsewhere) does not touch node-a's copy:
    same pid, same endpoint, no failure counted, no restart."""
    cluster = make_cluster(nodes=2)
    apply(cluster, sim_deployment())
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    [(owner, engine_id)] = cluster.engine_copies()
    real = cluster.engine_copies()[(owner, engine_id)]
    other = next(n for n in cluster.node_list().nodes if n.info.node_id != owner)
    endpoints = cluster.stub().ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints
    claimed = T.Engine()
    claimed.CopyFrom(real)
    claimed.node_id, claimed.state, claimed.pid, claimed.exit_signal = other.info.node_id, T.ENGINE_STATE_FAILED, 4242, 9
    cluster.stub().ReportEngineEvent(C.ReportEngineEventRequest(
        node_id=other.info.node_id, generation=other.generation, engine=claimed, reason="killed by SIGKILL"), timeout=10)
    elsewhere = T.Engine()
    elsewhere.CopyFrom(real)
    elsewhere.node_id, elsewhere.spec.host, elsewhere.pid = other.info.node_id, "6.6.6.6", 4242
    cluster.stub().Heartbeat(C.HeartbeatRequest(node_id=other.info.node_id, generation=other.generation,
                                                engines=[elsewhere], delta=True), timeout=10)
    wait_for(lambda: any(e.type == C.EVENT_TYPE_ENGINE_FENCED for e in cluster.events()), timeout=30, interval=0.2,
             what="the claimed copy fenced on the node that claimed it", detail=cluster.describe)
    assert cluster.engine_copies()[(owner, engine_id)].pid == real.pid
    assert cluster.stub().ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints == endpoints
    [instance] = cluster.instances().values()
    assert instance.state == C.INSTANCE_STATE_READY and instance.restarts == 0, cluster.describe()
    assert not [e for e in cluster.events() if e.type == C.EVENT_TYPE_ENGINE_FAILED], cluster.describe()
    assert psutil.pid_exists(real.pid)
