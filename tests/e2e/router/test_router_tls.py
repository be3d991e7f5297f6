"""The router under `motorctl up --tls`: the sync reads endpoints and reports its router's
workers with its own identity, and nothing else; the router's admin API listens on loopback only."""

from __future__ import annotations

import json
import os

import grpc
import psutil
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import REPO_ROOT, wait_for
from tests.support.local_cluster import started
from tests.support.open_load import http

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(
        str(tmp_path_factory.mktemp("routed-tls")),
        nodes=1,
        deployment_path=DEPLOYMENT,
        tls=True,
        heartbeat_interval=1.0,
        engine_port_base=34000,
        router_port=0,
    )
    yield from started(local)


def test_the_sync_follows_the_controller_under_tls_with_an_identity_that_reads_endpoints_only(cluster):
    def routed():
        status, text = http("GET", cluster.router_url + "/list_workers")
        return status == 200 and len(json.loads(text)["urls"]) == 3

    wait_for(routed, timeout=90, interval=0.3, what="three engines in the router")
    with cluster.credentials("router-sync").channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        assert len(stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints) == 3
        for call, request in (
            (stub.ListNodes, controller_pb2.ListNodesRequest()),
            (stub.ListInstances, controller_pb2.ListInstancesRequest()),
            (stub.DeleteDeployment, controller_pb2.DeleteDeploymentRequest()),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
            assert "router-sync" in refused.value.details()
    # ... and reports which engines its router holds, which the controller takes from it.
    with cluster.credentials("viewer").channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)

        def reported() -> list[str]:
            stream = stub.WatchEvents(controller_pb2.WatchEventsRequest(), timeout=5)
            events = next(stream).snapshot.recent_events
            stream.cancel()
            return [e.message for e in events if e.type == controller_pb2.EVENT_TYPE_FRONT_DOOR]

        wait_for(lambda: any("holds" in m for m in reported()), timeout=30, what="the sync's report taken")
    log = open(cluster.process("router-sync").log_path).read()
    assert "did not take this router's report" not in log, log[-2000:]


def test_the_router_listens_on_loopback_only(cluster):
    router = psutil.Process(cluster.process("router").process.pid)
    listening = [
        c.laddr
        for p in (router, *router.children(recursive=True))
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(address.ip == "127.0.0.1" for address in listening), listening
