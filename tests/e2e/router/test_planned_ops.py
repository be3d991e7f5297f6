"""Planned stops through the router lose no request: the engine leaves the router, drains (new
requests 503 with Retry-After, which the router retries elsewhere), then stops."""

from __future__ import annotations

import time

import grpc
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc, engine_pb2, engine_pb2_grpc
from tests.support import wait_for
from tests.support.open_load import OpenLoad
from tests.support.router_checks import apply, union, workers
from tests.support.router_process import routed_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from routed_cluster(tmp_path_factory, "planned", engine_port_base=35000)


def test_scale_down_under_load_fails_no_request(cluster):
    apply(cluster, union(3))
    wait_for(lambda: len(workers(cluster)) == 3, timeout=90, interval=0.2, what="three engines in the router")
    with OpenLoad(cluster.router_url) as load:
        time.sleep(1.5)
        apply(cluster, union(2))
        wait_for(lambda: len(workers(cluster)) == 2, timeout=30, interval=0.05, what="one engine out of the router")
        time.sleep(3)  # the removed engine drains and stops meanwhile
    assert len(load.results) > 50
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"


def test_an_operators_drain_of_one_engine_under_load_fails_no_request(cluster):
    """Drain on an engine's management plane (grpcurl or any client): the engine says it drains,
    Motor takes it out of the router at once, and the requests it was given meanwhile are
    answered 503 with Retry-After, which the router retries elsewhere."""
    apply(cluster, union(3))
    wait_for(lambda: len(workers(cluster)) == 3, timeout=90, interval=0.2, what="three engines in the router")
    with cluster.credentials().channel(cluster.controller_address) as channel:
        instances = controller_pb2_grpc.ControllerServiceStub(channel).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=10
        )
    target = instances.instances[0].engines[0]
    with OpenLoad(cluster.router_url) as load:
        time.sleep(1.5)
        with grpc.insecure_channel(f"{target.host}:{target.mgmt_port}") as channel:
            engine_pb2_grpc.EngineServiceStub(channel).Drain(engine_pb2.DrainRequest(), timeout=30)
        wait_for(
            lambda: f"http://{target.host}:{target.port}" not in workers(cluster),
            timeout=10,
            interval=0.05,
            what="the drained engine out of the router",
        )
        assert len(workers(cluster)) == 2
        time.sleep(2)
    assert len(load.results) > 50
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"
