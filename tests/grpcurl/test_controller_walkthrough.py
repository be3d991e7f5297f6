"""docs/clients.md, controller section: each documented grpcurl command against the cluster
`make run` starts (a controller, two node managers, the example deployment on sim engines)."""

from __future__ import annotations

import grpc
import pytest

from motor.ports import free_port
from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from tests.support import wait_for
from tests.support.grpcurl_walkthrough import load_steps, run_step
from tests.support.local_cluster import example_cluster

STEPS = [step for step in load_steps() if step.section == "controller"]
EXPECTED_ENGINES = {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}


def _all_normal(stub) -> bool:
    instances = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
    engines = {e.engine_id: e for i in instances for e in i.engines}
    return (
        set(engines) == EXPECTED_ENGINES
        and all(e.health == types_pb2.HEALTH_STATUS_NORMAL for e in engines.values())
        and all(i.state == controller_pb2.INSTANCE_STATE_READY for i in instances)
    )


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    cluster = example_cluster(tmp_path_factory, "cluster", controller_port=free_port())
    try:
        cluster.start(timeout=90)
        with grpc.insecure_channel(cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            wait_for(lambda: _all_normal(stub), timeout=120, interval=0.5, what="the example deployment NORMAL")
        yield {"controller": cluster.controller_address}
    finally:
        problems = cluster.stop()
        assert not problems, problems


@pytest.mark.parametrize("step", STEPS, ids=[step.id for step in STEPS])
def test_documented_controller_command(controller, step):
    run_step(step, controller)
