"""The front door's own death refuses no connection: `motorctl up` holds the published port's
listening socket and hands it to each door process it starts (`--listen-fd`), so while a
SIGKILLed door is started again new connections wait in the socket's backlog instead of being
refused. At most the requests the killed process held fail."""

from __future__ import annotations

import os
import signal
import time

import pytest

from motorctl.local_cluster import LocalCluster
from tests.support import wait_for, write_sim_deployment
from tests.support.door_load import FreshConnectionLoad


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("door-socket")
    local = LocalCluster(
        str(directory),
        nodes=1,
        deployment_path=write_sim_deployment(directory / "sim.yaml", count=1),
        heartbeat_interval=1.0,
        engine_port_base=36500,
        router_port=0,
    )
    try:
        local.start(timeout=60)
        yield local
    finally:
        problems = local.stop()
        assert not problems, problems


def serving(cluster) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(cluster.router_url + "/v1/models", timeout=2) as reply:
            return b"sim-tiny" in reply.read()
    except OSError:
        return False


def test_a_sigkilled_front_door_refuses_no_connection_under_load(cluster):
    wait_for(lambda: serving(cluster), timeout=60, interval=0.2, what="sim-tiny served through the door")
    with FreshConnectionLoad(cluster.router_port, "sim-tiny", period=0.05) as load:
        time.sleep(2)
        killed = cluster.process("front-door").process
        held = load.in_flight
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        wait_for(lambda: cluster.process("front-door").process.pid != killed.pid, timeout=15, what="the door restarted")
        wait_for(lambda: serving(cluster), timeout=15, interval=0.1, what="the door serving again")
        time.sleep(2)
    assert len(load.outcomes) > 60
    refused, failed = load.refused(), load.failed()
    summary = f"{len(failed)} of {len(load.outcomes)} failed, {len(refused)} refused, {held} in flight at the kill"
    print(summary)
    assert not refused, summary
    assert len(failed) <= held, summary
