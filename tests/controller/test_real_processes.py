"""The controller with real node managers and sim engine servers, faults injected with real
signals: engine SIGKILL, crash loops, node-manager SIGKILL and return, controller kill -9,
SIGSTOP of most node managers at once. Short intervals; waits are generous hang bounds."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.process_cluster import (
    HEARTBEAT,
    apply,
    make_cluster,  # noqa: F401 (fixture)
    sim_deployment,
)

pytestmark = pytest.mark.processes


def test_killed_engine_is_restarted_then_backs_off(make_cluster):
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment())
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    first = cluster.engine_copies()[("node-a", "u-0/rank0")]
    killed_at = time.monotonic()
    os.kill(first.pid, signal.SIGKILL)
    second = wait_for(
        lambda: next(
            (e for k, e in cluster.engine_copies().items() if k[1] == "u-0/rank0" and e.pid != first.pid), None
        ),
        timeout=30,
        interval=0.05,
        what="a replacement engine process",
    )
    print(f"kill -9 -> replacement process reported after {time.monotonic() - killed_at:.3f}s (includes polling)")
    assert second.spec.generation > first.spec.generation
    inst = cluster.instances()["u-0"]
    assert inst.restarts >= 1 and inst.engines[0].restarts >= 1  # more if a port race on this busy host
    assert "signal 9" in inst.engines[0].last_failure_reason or "-9" in inst.engines[0].last_failure_reason
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="READY after the restart")
    # A second failure is not restarted at once: the backoff applies. Each failure so far was
    # followed by one restart; the n-th failure in a row waits 1 s * 2^(n-2), capped at 4 s
    # (1 s here, more if a port race on this busy host added failures).
    failures = cluster.instances()["u-0"].restarts
    os.kill(second.pid, signal.SIGKILL)
    backing_off = wait_for(
        lambda: cluster.instances()["u-0"].state == C.INSTANCE_STATE_RESTARTING and cluster.instances()["u-0"],
        timeout=30,
        interval=0.05,
        what="RESTARTING with a backoff",
    )
    assert f"in {min(2 ** (failures - 1), 4):g}s" in backing_off.state_reason and backing_off.HasField(
        "next_restart_time"
    )
    wait_for(
        lambda: cluster.instances()["u-0"].restarts >= 2 and cluster.all_ready(1),
        timeout=60,
        interval=0.2,
        what="READY after the backoff",
    )
    messages = [e.message for e in cluster.events()]
    assert any(m.startswith("engine u-0/rank0 on node-a ") for m in messages if "signal" in m or "exited" in m)


def test_crash_looping_engine_ends_failed_and_is_left_alone(make_cluster):
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment(faults={"crash_after_s": 0.5}, max_failures=3, initial_backoff="0.2s"))
    failed = wait_for(
        lambda: cluster.instances()["u-0"].state == C.INSTANCE_STATE_FAILED and cluster.instances()["u-0"],
        timeout=90,
        interval=0.2,
        what="instance FAILED",
    )
    assert "crash-loop budget spent: 3 failures" in failed.state_reason
    restarts = failed.restarts
    time.sleep(3)
    again = cluster.instances()["u-0"]
    assert again.state == C.INSTANCE_STATE_FAILED and again.restarts == restarts == 2
    assert not cluster.engine_copies()


def test_lost_node_manager_engines_move_and_stale_copies_are_fenced(make_cluster):
    cluster = make_cluster(nodes=2, accelerators=1)
    apply(cluster, sim_deployment(count=1))
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="READY")
    (victim, _), old = next(iter(cluster.engine_copies().items()))
    survivor = "node-b" if victim == "node-a" else "node-a"
    # SIGKILL the node manager alone: its engine keeps running, unseen (a stale copy to be).
    nm = cluster.process(victim).process
    nm.send_signal(signal.SIGKILL)
    nm.wait()
    assert psutil.pid_exists(old.pid)
    wait_for(
        lambda: cluster.instances()["u-0"].engines[0].node_id == survivor and cluster.all_ready(1),
        timeout=60,
        interval=0.2,
        what="engine moved to the other node and READY",
    )
    lost = {n.info.node_id: n for n in cluster.node_list().nodes}[victim]
    assert lost.state == C.NODE_STATE_LOST and "direct re-check failed" in lost.state_reason
    kinds = [(e.type, e.node_id) for e in cluster.events()]
    assert kinds.index((C.EVENT_TYPE_NODE_SUSPECT, victim)) < kinds.index((C.EVENT_TYPE_NODE_LOST, victim))
    # The node manager comes back, re-adopts its old engine and registers: the copy is fenced.
    cluster.start_node(victim, 0 if victim == "node-a" else 1)
    wait_for(
        lambda: not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() == psutil.STATUS_ZOMBIE,
        timeout=60,
        interval=0.2,
        what="stale engine copy stopped",
    )
    wait_for(
        lambda: {n.info.node_id: n.state for n in cluster.node_list().nodes}[victim] == C.NODE_STATE_READY, timeout=30
    )
    # One copy, on the survivor (the node's next heartbeat reports the fenced copy STOPPED).
    wait_for(
        lambda: [k for k in cluster.engine_copies() if k[1] == "u-0/rank0"] == [(survivor, "u-0/rank0")],
        timeout=30,
        interval=0.2,
        what="a single live copy",
    )
    assert any(
        e.type in (C.EVENT_TYPE_ENGINE_FENCED, C.EVENT_TYPE_NODE_RECOVERED) and e.node_id == victim
        for e in cluster.events()
    )


def test_controller_kill9_restart_restarts_no_engine(make_cluster):
    # Node managers back off (with jitter, up to 10 s) while the controller is away, so their
    # first heartbeat to the new process may come seconds later. A node grace (and so start-up
    # grace) longer than that lets the test see adoption, not the grace running out (StartEngine
    # sent again) nor a node turned SUSPECT whose re-check times out on this loaded machine
    # (declared lost: its engines placed again).
    cluster = make_cluster(nodes=2, extra=["--node-grace", "15"])
    apply(cluster, sim_deployment(count=2, dp=2))
    wait_for(lambda: cluster.all_ready(2), timeout=90, interval=0.2, what="READY")
    before = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    # Counted before the kill: a port race on this busy host may have restarted an engine during bring-up.
    restarts = {i.instance_id: i.restarts for i in cluster.instances().values()}
    revision = cluster.stub().GetDeployment(C.GetDeploymentRequest(), timeout=5).revision
    cluster.kill_controller()
    cluster.start_controller()
    # Every node reported to the new process (which ends the start-up grace), then a reconcile
    # pass (every 0.5 s at most) had the chance to start something.
    wait_for(
        lambda: all(n.HasField("last_heartbeat") for n in cluster.node_list().nodes),
        timeout=30,
        interval=0.2,
        what="both nodes reporting to the restarted controller",
    )
    wait_for(
        lambda: cluster.all_ready(2),
        timeout=60,
        interval=0.2,
        what="READY after the controller restart",
        detail=cluster.describe,
    )
    time.sleep(2 * HEARTBEAT)
    after = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    assert after == before, cluster.describe()
    instances = cluster.instances()
    assert {i.instance_id: i.restarts for i in instances.values()} == restarts, cluster.describe()
    assert all(i.state == C.INSTANCE_STATE_READY for i in instances.values())
    assert cluster.stub().GetDeployment(C.GetDeploymentRequest(), timeout=5).revision == revision
    assert not [e for e in cluster.events() if e.type == C.EVENT_TYPE_ENGINE_STARTED]


def test_many_silent_nodes_raise_an_alarm_and_nothing_is_rescheduled(make_cluster):
    # The SIGSTOPped nodes' last heartbeats may be up to an interval (plus a loaded machine's
    # delay) apart; the controller waits two intervals after SUSPECT before declaring a node
    # lost, and a 2 s re-check adds room, so node-b is SUSPECT before node-a could be lost.
    cluster = make_cluster(nodes=3, accelerators=1, extra=["--recheck-timeout", "2"])
    apply(cluster, sim_deployment(count=3))
    wait_for(lambda: cluster.all_ready(3), timeout=90, interval=0.2, what="READY")
    before = {k: e.pid for k, e in cluster.engine_copies().items()}
    assert len({k[0] for k in before}) == 3
    stopped = [cluster.process("node-a").process, cluster.process("node-b").process]
    for process in stopped:
        process.send_signal(signal.SIGSTOP)
    try:
        reply = wait_for(
            lambda: cluster.node_list().alarms and cluster.node_list(), timeout=30, interval=0.2, what="alarm"
        )
        assert "2 of 3 nodes silent at once" in reply.alarms[0]
        # Both re-checks failed, and the alarm holds both back from being declared lost.
        held = "not declared lost while the silent-nodes alarm is on"
        wait_for(
            lambda: all(held in n.state_reason for n in cluster.node_list().nodes if n.info.node_id != "node-c"),
            timeout=30,
            interval=0.2,
            what="both silent nodes held back by the alarm",
        )
        nodes = {n.info.node_id: n for n in cluster.node_list().nodes}
        assert nodes["node-a"].state == nodes["node-b"].state == C.NODE_STATE_SUSPECT
        placed = {i.engines[0].node_id for i in cluster.instances().values()}
        assert placed == {"node-a", "node-b", "node-c"}  # nothing moved
    finally:
        for process in stopped:
            process.send_signal(signal.SIGCONT)
    wait_for(
        lambda: not cluster.node_list().alarms and cluster.all_ready(3), timeout=60, interval=0.2, what="alarm cleared"
    )
    assert {k: e.pid for k, e in cluster.engine_copies().items()} == before
    assert all(i.restarts == 0 for i in cluster.instances().values())
