"""Hostile reports and replacements against real processes (a real controller, real node
managers, sim engine servers): a heartbeat listing 20,000 made-up engines is refused naming
--max-engines-per-node and the cluster carries on (hostile F11)."""

from __future__ import annotations

import grpc
import pytest

from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.controller.test_real_processes import apply, make_cluster, sim_deployment  # noqa: F401 (fixture)
from tests.support import wait_for


def made_up(node_id: str, n: int) -> list[T.Engine]:
    return [T.Engine(engine_id=f"zz{i}-0/rank0", node_id=node_id, state=T.ENGINE_STATE_RUNNING,
                     spec=T.EngineSpec(instance_id=f"zz{i}-0", dp_rank=0, role=T.ROLE_UNION, generation=1, port=30000))
            for i in range(n)]


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
    assert streamed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-engines-per-node" in streamed.value.details()
    with pytest.raises(grpc.RpcError) as registered:
        cluster.stub().RegisterNode(C.RegisterNodeRequest(node=cluster.node_list().nodes[0].info, engines=flood.engines), timeout=30)
    assert registered.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Nothing of it was taken: no copy fenced, the real node and its engine carry on.
    assert not [e for e in cluster.events() if e.type == C.EVENT_TYPE_ENGINE_FENCED]
    node = cluster.node_list().nodes[0]
    assert node.state == C.NODE_STATE_READY and node.generation == generation
    assert {e.engine_id for e in node.engines} == {"u-0/rank0"}
    assert cluster.all_ready(1)
