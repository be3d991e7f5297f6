"""The heartbeat rate budget with a real controller and real node managers: the node managers
heartbeat at the interval the controller announces (not at their configured one), and a node
whose node manager is killed is declared lost by the grace the controller announced, within
grace + 2 intervals + the re-check timeout. Waits are generous hang bounds; the only time bound
checked is the lower one (not lost before the announced grace), which load cannot break."""

from __future__ import annotations

import re
import signal
import time
import urllib.request

import pytest

from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.process_cluster import HEARTBEAT, make_cluster  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes

# Two nodes at most 1 heartbeat a second in all: the controller announces 2 s (not the 0.5 s
# configured) and a grace of 8 s (the configured 2 s is 4 intervals of 0.5 s).
RATE, ANNOUNCED, GRACE, RECHECK = 1.0, 2.0, 8.0, 0.5


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in {url}"
    return float(match.group(1))


def test_node_managers_follow_the_announced_interval_and_a_killed_one_is_lost_by_the_announced_grace(make_cluster):
    cluster = make_cluster(nodes=2, extra=["--max-heartbeats-per-second", str(RATE)])
    urls = cluster.metrics_urls()
    wait_for(
        lambda: metric(urls["controller"], "motor_controller_heartbeat_interval_seconds") == ANNOUNCED,
        timeout=30,
        interval=0.2,
        what="the controller announcing 2 s",
    )
    assert metric(urls["controller"], "motor_controller_node_grace_seconds") == GRACE
    beats = 'motor_node_manager_heartbeat_latency_seconds_count{node="node-a"}'
    time.sleep(ANNOUNCED + 1)  # every node heard it at its next answer
    before, began = metric(urls["node-a"], beats), time.monotonic()
    time.sleep(8)
    sent = metric(urls["node-a"], beats) - before
    window = time.monotonic() - began
    # At the configured 0.5 s about 16 beats, at the announced 2 s about 4: the bound lies halfway,
    # so a beat or two caught up after a stall on this loaded machine does not decide it.
    halfway = (window / ANNOUNCED + window / HEARTBEAT) / 2
    assert 1 <= sent < halfway, (
        f"{sent:g} heartbeats in {window:.1f}s (announced {ANNOUNCED:g}s, configured {HEARTBEAT:g}s)"
    )

    node_b = cluster.process("node-b").process
    node_b.send_signal(signal.SIGKILL)
    node_b.wait()
    killed_at = time.monotonic()
    stub = cluster.stub()

    def state() -> int:
        return {n.info.node_id: n.state for n in stub.ListNodes(C.ListNodesRequest(), timeout=5).nodes}["node-b"]

    bound = GRACE + 2 * ANNOUNCED + RECHECK
    wait_for(lambda: state() == C.NODE_STATE_LOST, timeout=bound + 60, interval=0.1, what="node-b LOST")
    lost_after = time.monotonic() - killed_at
    # Its last heartbeat came at most one interval before the kill: not lost before grace - interval.
    assert lost_after >= GRACE - ANNOUNCED, f"lost after {lost_after:.1f}s: judged by the configured grace?"
    suspect = [e.message for e in cluster.events() if e.type == C.EVENT_TYPE_NODE_SUSPECT and e.node_id == "node-b"]
    assert suspect and f"grace {GRACE:g}s, heartbeat interval {ANNOUNCED:g}s" in suspect[-1], suspect
