"""Node manager faults: SIGKILL and restart (engines outlive it and are adopted), SIGSTOP 3 s
(within grace: nothing happens), SIGSTOP 20 s (declared lost, engines placed elsewhere, the stale
copies fenced when it returns) and two of the three node managers silent at once (the alarm holds
them back from being declared lost: nothing moves)."""

from __future__ import annotations

import signal
import time

from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.chaos_rows import Fault, run_row


def node_manager(cluster, node_id: str):
    return cluster.process(node_id).process


def test_node_manager_sigkill_and_restart(cluster):
    victim = cluster.busiest_node()

    def inject(fault: Fault) -> float:
        process = node_manager(cluster, victim)
        process.send_signal(signal.SIGKILL)  # the node manager alone: its engines keep running
        process.wait()
        cluster.start_node(victim, cluster.node_ids().index(victim))
        fault.notes.append(f"{victim} restarted at once")
        return time.monotonic()

    run_row(cluster, Fault("node manager SIGKILL and restart", inject))


def paused_node(cluster, node_id: str, seconds: float) -> float:
    process = node_manager(cluster, node_id)
    process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the fault itself
    finally:
        process.send_signal(signal.SIGCONT)
    return time.monotonic()


def test_node_manager_sigstop_3s(cluster):
    victim = cluster.busiest_node()
    run_row(cluster, Fault("node manager SIGSTOP 3 s", lambda fault: paused_node(cluster, victim, 3.0)))


def test_node_manager_sigstop_20s(cluster):
    victim = cluster.busiest_node()
    moved = {i for (i, _), node in cluster.where().items() if node == victim}

    def inject(fault: Fault) -> float:
        process = node_manager(cluster, victim)
        process.send_signal(signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            state = lambda: {n.info.node_id: n.state for n in cluster.node_list().nodes}[victim]  # noqa: E731
            wait_for(lambda: state() == C.NODE_STATE_LOST, timeout=20, interval=0.2, what=f"{victim} declared LOST")
            fault.notes.append(
                f"{victim} LOST after {time.monotonic() - paused_at:.1f}s, {len(moved)} instances moved, "
                "stale copies fenced on return"
            )
            time.sleep(max(0.0, paused_at + 20.0 - time.monotonic()))  # the rest of the 20 s pause
        finally:
            process.send_signal(signal.SIGCONT)
        return time.monotonic()

    run_row(
        cluster,
        Fault("node manager SIGSTOP 20 s", inject, justified=moved, must_replace=moved, stale_copies_expected=True),
    )


def test_many_nodes_silent_at_once(cluster):
    silent = cluster.node_ids()[:2]  # two of three: over the silent-share alarm (half)

    def inject(fault: Fault) -> float:
        processes = [node_manager(cluster, n) for n in silent]
        for process in processes:
            process.send_signal(signal.SIGSTOP)
        try:
            held = "not declared lost while the silent-nodes alarm is on"
            wait_for(
                lambda: all(held in n.state_reason for n in cluster.node_list().nodes if n.info.node_id in silent),
                timeout=60,
                interval=0.2,
                what="both silent nodes held back by the alarm",
                detail=cluster.describe,
            )
            fault.notes.append(f"alarm: {cluster.node_list().alarms[0]}; nothing moved")
        finally:
            for process in processes:
                process.send_signal(signal.SIGCONT)
        return time.monotonic()

    run_row(cluster, Fault("many nodes silent at once (2 of 3 paused)", inject))
