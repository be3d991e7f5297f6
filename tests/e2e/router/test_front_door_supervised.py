"""The front door of `motorctl up` is supervised: a router, motor-router-sync or the front door's
own process killed with SIGKILL is started again by `motorctl up` (LocalCluster), the router's
workers are right again, and the controller says so (events of type FRONT_DOOR,
`motor_front_door_*` metrics), while the sync's reports tell it what the router routes to. The
sync's death touches no client connection: under load, not one request fails."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import grpc
import httpx
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc
from tests.support import REPO_ROOT, wait_for
from tests.support.open_load import OpenLoad, http
from tests.support.router_checks import all_three_routed, listed_urls, router_workers
from tests.support.router_process import routed_cluster

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from routed_cluster(tmp_path_factory, "front-door", deployment_path=DEPLOYMENT, engine_port_base=35000)


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


class KeptAlive:
    """A client that keeps its connection to the front door and sends completions back to back
    (what an OpenAI client does): `answers` counts them, `failures` lists what went wrong."""

    def __init__(self, url: str):
        self.url, self.answers, self.failures = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def __enter__(self) -> KeptAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=40)

    def _send(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    reply = client.post("/v1/completions", json={"model": "sim-tiny", "prompt": "x", "max_tokens": 2})
                    if reply.status_code != 200:
                        self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.answers += 1
                time.sleep(0.05)


def test_a_sigkilled_sync_under_client_load_fails_no_request(cluster):
    """kill -9 of motor-router-sync under 10 requests/s through the front door, plus one client
    on a kept-alive connection: every request answered 200 while the sync is down and restarts
    (the front door is its own process and keeps the last table the sync gave it)."""
    all_three_routed(cluster)
    door = cluster.process("front-door").process.pid
    with OpenLoad(cluster.router_url, period=0.1) as load, KeptAlive(cluster.router_url) as kept:
        time.sleep(2)
        killed = cluster.process("router-sync").process
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        restarted = lambda: cluster.process("router-sync").process.pid != killed.pid  # noqa: E731
        wait_for(restarted, timeout=15, what="the sync restarted")
        time.sleep(4)  # the new sync follows the controller and pushes its table meanwhile
    assert len(load.results) > 40 and kept.answers > 40, (len(load.results), kept.answers)
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed: {load.failed()[:3]}"
    assert kept.failures == [], kept.failures[:3]
    assert cluster.process("front-door").process.pid == door, "the front door itself was restarted"


def test_a_sigkilled_front_door_is_started_again_and_given_the_table_again(cluster):
    all_three_routed(cluster)
    killed = cluster.process("front-door").process
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    wait_for(lambda: cluster.process("front-door").process.pid != killed.pid, timeout=15, what="the door restarted")

    def models() -> list[str]:
        status, text = http("GET", cluster.router_url + "/v1/models")
        return [m["id"] for m in json.loads(text)["data"]] if status == 200 else []

    # A new door has no table until the sync's next push (every second).
    wait_for(lambda: models() == ["sim-tiny"], timeout=15, interval=0.1, what="the sync's table in the new door")
    completion = {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}
    status, _ = http("POST", cluster.router_url + "/v1/completions", completion)
    assert status == 200
    assert "front-door restarted 1 time(s), last killed by SIGKILL" in cluster.front_door_state()


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
