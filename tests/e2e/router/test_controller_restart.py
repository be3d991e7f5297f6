"""A controller that restarts (kill -9, then started again on the same store), or a standby that
takes over from a killed leader, does not empty the router: until the nodes have reported to it,
it knows no engine's health, and a snapshot it gave then would take every worker out of the
router."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc
from tests.support import wait_for
from tests.support.background import EveryInterval
from tests.support.etcd_members import _require_etcd
from tests.support.open_load import OpenLoad
from tests.support.router_checks import apply, union, workers
from tests.support.router_process import routed_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from routed_cluster(tmp_path_factory, "restart", engine_port_base=35500)


class WorkerCounts(EveryInterval):
    """The router's worker count, read every 20 ms on a thread."""

    def __init__(self, cluster):
        super().__init__(0.02)
        self.cluster, self.counts = cluster, []

    def step(self) -> None:
        self.counts.append(len(workers(self.cluster)))


def restart_controller(cluster) -> None:
    old = cluster.process("controller")
    old.process.send_signal(signal.SIGKILL)
    old.process.wait(timeout=10)
    cluster.processes.remove(old)
    new = cluster.launch_controller(0)
    cluster.wait_serving(cluster.controller_address, timeout=30, process=new)


def test_a_controller_restart_keeps_every_worker_in_the_router(cluster):
    apply(cluster, union(2))
    wait_for(lambda: len(workers(cluster)) == 2, timeout=90, interval=0.2, what="two engines in the router")
    with OpenLoad(cluster.router_url) as load, WorkerCounts(cluster) as seen:
        time.sleep(1.5)
        restart_controller(cluster)
        time.sleep(8)  # the nodes report to the new process; the sync reconnects and re-lists
    assert min(seen.counts) == 2, f"the router lost workers during the restart: {sorted(set(seen.counts))}"
    assert len(load.results) > 100
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"


@pytest.fixture(scope="module")
def ha_cluster(tmp_path_factory):
    _require_etcd()
    yield from routed_cluster(
        tmp_path_factory,
        "failover",
        engine_port_base=36000,
        ha=True,
        extra_controller_args=["--lease-ttl", "2"],
        node_id_prefix="feed-node",
    )


def leader(cluster) -> str:
    for address in cluster.controller_addresses:
        try:
            with grpc.insecure_channel(address) as channel:
                reply = controller_pb2_grpc.ControllerServiceStub(channel).ListControllers(
                    controller_pb2.ListControllersRequest(), timeout=2
                )
            if reply.leader_address:
                return reply.leader_address
        except grpc.RpcError:
            continue
    return ""


def test_a_failover_keeps_every_worker_in_the_router(ha_cluster):
    cluster = ha_cluster
    wait_for(lambda: leader(cluster), timeout=30, interval=0.2, what="a leader")
    with grpc.insecure_channel(leader(cluster)) as channel:
        controller_pb2_grpc.ControllerServiceStub(channel).ApplyDeployment(
            controller_pb2.ApplyDeploymentRequest(deployment=union(2)), timeout=30
        )
    wait_for(lambda: len(workers(cluster)) == 2, timeout=90, interval=0.2, what="two engines in the router")
    old = leader(cluster)
    index = cluster.controller_addresses.index(old)
    process = cluster.process("controller" if index == 0 else f"controller-{index + 1}")
    with OpenLoad(cluster.router_url) as load, WorkerCounts(cluster) as seen:
        time.sleep(1.5)
        process.process.send_signal(signal.SIGKILL)
        wait_for(lambda: leader(cluster) not in ("", old), timeout=30, interval=0.1, what="a new leader")
        time.sleep(6)  # the nodes report to the new leader; the sync follows it and re-lists
    assert min(seen.counts) == 2, f"the router lost workers during the failover: {sorted(set(seen.counts))}"
    assert len(load.results) > 100
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"
