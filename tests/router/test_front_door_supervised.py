"""The front door of `motorctl up` is supervised: a router or motor-router-sync killed with
SIGKILL is started again by `motorctl up` (LocalCluster), the router's workers are right again,
and the controller says so (events of type FRONT_DOOR, `motor_front_door_*` metrics), while the
sync's reports tell it what the router routes to."""

from __future__ import annotations

import os
import signal
import urllib.request

import grpc
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.router.conftest import http, running
from tests.router.test_cluster_router import all_three_routed, listed_urls, router_workers
from tests.support import REPO_ROOT, wait_for

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running(
        LocalCluster(
            str(tmp_path_factory.mktemp("front-door")),
            nodes=2,
            deployment_path=DEPLOYMENT,
            heartbeat_interval=1.0,
            engine_port_base=35000,
            router_port=0,
        )
    )


def front_door_events(cluster) -> list[str]:
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stream = controller_pb2_grpc.ControllerServiceStub(channel).WatchEvents(
            controller_pb2.WatchEventsRequest(), timeout=5
        )
        first = next(stream)
        stream.cancel()
    return [e.message for e in first.snapshot.recent_events if e.type == controller_pb2.EVENT_TYPE_FRONT_DOOR]


def metric(cluster, name: str) -> float | None:
    # A front door is named by its router's own address (what its sync keeps), not the published port.
    with urllib.request.urlopen(cluster.metrics_urls()["controller"], timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f'{name}{{router="{cluster.router_admin_url}"}}'):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_the_sync_reports_what_the_router_holds(cluster):
    all_three_routed(cluster)
    wait_for(lambda: metric(cluster, "motor_front_door_workers") == 3, timeout=30, what="3 workers reported")
    assert metric(cluster, "motor_front_door_up") == 1
    assert any("motor-router-sync reports its router holds" in m for m in front_door_events(cluster))


def test_a_sigkilled_sync_is_started_again_and_the_router_put_right_and_the_restart_reported(cluster):
    all_three_routed(cluster)
    urls = listed_urls(cluster)
    killed = cluster.process("router-sync").process
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    # While it is down the router loses a worker Motor lists (as a change the sync would have made).
    gone = sorted(urls)[0]
    assert http("POST", f"{cluster.router_admin_url}/remove_worker?url={gone}")[0] == 200
    wait_for(lambda: cluster.process("router-sync").process.pid != killed.pid, timeout=15, what="the sync restarted")
    wait_for(lambda: router_workers(cluster) == urls, timeout=60, interval=0.2, what="the router's workers right again")
    wait_for(
        lambda: any("motor-router-sync was restarted" in m for m in front_door_events(cluster)),
        timeout=30,
        what="the restart in the controller's events",
    )
    assert metric(cluster, "motor_front_door_sync_restarts_total") == 1
    state = cluster.front_door_state()
    assert (
        state.startswith("kept by motor-router-sync")
        and "router-sync restarted 1 time(s), last killed by SIGKILL" in state
    )


def test_a_sigkilled_router_is_started_again_given_its_workers_and_the_restart_reported(cluster):
    all_three_routed(cluster)
    urls = listed_urls(cluster)
    killed = cluster.process("router").process
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    wait_for(lambda: cluster.process("router").process.pid != killed.pid, timeout=15, what="the router restarted")
    wait_for(
        lambda: router_workers(cluster) == urls, timeout=60, interval=0.2, what="the new router given every worker"
    )
    wait_for(
        lambda: any("its router was restarted" in m for m in front_door_events(cluster)),
        timeout=30,
        what="the router's restart in the controller's events",
    )
    wait_for(lambda: metric(cluster, "motor_front_door_router_restarts_total") == 1, timeout=10, what="the metric")
    assert "router restarted 1 time(s), last killed by SIGKILL" in cluster.front_door_state()


def test_a_sync_gone_for_good_turns_the_front_door_stale_an_event_and_a_metric(cluster):
    """Last in this module: the sync is left dead (as after too many exits)."""
    all_three_routed(cluster)
    wait_for(lambda: metric(cluster, "motor_front_door_up") == 1, timeout=30, what="the front door up")
    cluster.front_door.stop()  # no restart from here on
    killed = cluster.process("router-sync").process
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    wait_for(
        lambda: any("no report from motor-router-sync" in m for m in front_door_events(cluster)),
        timeout=30,
        what="the sync's silence in the controller's events",
    )
    assert metric(cluster, "motor_front_door_up") == 0
    assert metric(cluster, "motor_front_door_report_age_seconds") >= 6
