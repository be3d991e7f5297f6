"""Only the controller sends generations, in plaintext mode (no identities: anyone reaching a node manager's port
may call StartEngine): a huge generation or controller epoch is refused naming the field and
leaves nothing behind; a bogus generation within the controller's limit is learned by the
controller, which issues above it. Either way the controller's next real start succeeds.
Real controller, node manager and sim engine processes."""

from __future__ import annotations

import grpc
import pytest

from motor.v1 import controller_pb2 as C
from motor.v1 import node_manager_pb2, node_manager_pb2_grpc
from motor.v1 import types_pb2 as T
from tests.support import wait_for
from tests.support.process_cluster import apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


def test_bogus_generations_and_epochs_cannot_poison_a_node_manager(make_cluster):
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment(count=1))
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="READY")
    with grpc.insecure_channel(f"127.0.0.1:{cluster.node_ports['node-a']}") as channel:
        attacker = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        running = attacker.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5).engines[0]

        def bogus(generation: int, epoch: int = 0) -> node_manager_pb2.StartEngineRequest:
            spec = T.EngineSpec(
                instance_id="u-1",
                dp_rank=0,
                role=running.spec.role,
                config_json=running.spec.config_json,
                generation=generation,
            )
            return node_manager_pb2.StartEngineRequest(spec=spec, controller_epoch=epoch)

        for request, code, field in (
            (bogus(2**63), grpc.StatusCode.UNAVAILABLE, "spec.generation"),
            (bogus(1, epoch=2**63), grpc.StatusCode.UNAVAILABLE, "controller_epoch"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                attacker.StartEngine(request, timeout=10)
            assert refused.value.code() == code and refused.value.details().startswith(field), refused.value.details()
        assert [
            e.engine_id for e in attacker.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5).engines
        ] == ["u-0/rank0"]
        # Within the limit the controller announced, a start is obeyed (in plaintext anyone may),
        # but the controller stops the copy and issues its own generations above it.
        planted = attacker.StartEngine(bogus(1 << 20), timeout=10).engine
        assert planted.spec.generation == 1 << 20
    wait_for(
        lambda: any(e.type == C.EVENT_TYPE_ENGINE_FENCED and e.engine_id == "u-1/rank0" for e in cluster.events()),
        timeout=30,
        interval=0.2,
        what="the planted copy fenced",
        detail=cluster.describe,
    )
    apply(cluster, sim_deployment(count=2))
    wait_for(
        lambda: cluster.all_ready(2), timeout=60, interval=0.2, what="both instances READY", detail=cluster.describe
    )
    instances = cluster.instances()
    assert instances["u-1"].restarts == 0 and instances["u-1"].engines[0].generation > 1 << 20, cluster.describe()
    assert not [e for e in cluster.events() if e.type == C.EVENT_TYPE_ENGINE_FAILED], cluster.describe()
