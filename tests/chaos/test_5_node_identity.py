"""Two node managers claiming one node id: a second process while the holder lives
(refused, starts nothing), the holder killed -9 while the second waits (it takes over; the
engines the first left are adopted or stopped, never doubled), and a paused holder that comes
back after the takeover (fenced: refused, its copies gone)."""

from __future__ import annotations

import itertools
import signal
import time

from motor.v1 import controller_pb2 as C
from motorctl.cluster_processes import ManagedProcess
from tests.support import wait_for
from tests.support.chaos_rows import Fault, run_row
from tests.support.second_node_manager import REFUSED, log_of, refused_so_far, start_second

_claimants = itertools.count()


def start_claimant(cluster, node_id: str) -> tuple[ManagedProcess, int]:
    """Another `motor-node-manager --node-id <node_id>` with its own --listen, --state-dir and
    engine ports, pointed at the same controller (as an operator starts one by hand); refused."""
    number = next(_claimants)
    managed, port = start_second(
        cluster, node_id, name=f"claimant-{number}", engine_ports_from=cluster.engine_port_base + 2000 + 500 * number
    )
    wait_for(lambda: REFUSED in log_of(managed), timeout=30, interval=0.2, what="the second node manager refused")
    return managed, port


def node(cluster, node_id: str) -> C.Node:
    return {n.info.node_id: n for n in cluster.node_list().nodes}[node_id]


def wait_taken_over(cluster, node_id: str, port: int) -> None:
    wait_for(
        lambda: node(cluster, node_id).info.address == f"127.0.0.1:{port}",
        timeout=60,
        interval=0.2,
        what=f"the second node manager holding {node_id}",
        detail=cluster.describe,
    )


def hand_over(cluster, node_id: str, holder: ManagedProcess, claimant: ManagedProcess, port: int) -> None:
    """The claimant is the node id's process from now on (for the next rows and the final stop)."""
    holder.name, claimant.name = f"{node_id}-replaced", node_id
    cluster.node_ports[node_id] = port


def stop(managed: ManagedProcess) -> None:
    managed.process.send_signal(signal.SIGTERM)
    managed.process.wait(timeout=30)


def test_node_id_claimed_by_a_second_live_node_manager(cluster):
    victim = cluster.busiest_node()

    def inject(fault: Fault) -> float:
        before = node(cluster, victim)
        claimant, _ = start_claimant(cluster, victim)
        try:
            wait_for(lambda: refused_so_far(cluster) >= 3, timeout=30, interval=0.2, what="three refused registrations")
            after = node(cluster, victim)
            assert (after.generation, after.info.address) == (before.generation, before.info.address)
            conflicts = [e for e in cluster.events() if e.type == C.EVENT_TYPE_NODE_CONFLICT and e.node_id == victim]
            fault.notes.append(
                f"refused {refused_so_far(cluster)} times, {len(conflicts)} NODE_CONFLICT event, generation unchanged"
            )
        finally:
            stop(claimant)
        return time.monotonic()

    run_row(cluster, Fault("node id claimed twice (holder alive)", inject))


def test_node_id_holder_killed_the_second_takes_over(cluster):
    victim = cluster.busiest_node()
    on_it = {i for (i, _), n in cluster.where().items() if n == victim}

    def inject(fault: Fault) -> float:
        holder = cluster.process(victim)
        claimant, port = start_claimant(cluster, victim)
        holder.process.send_signal(signal.SIGKILL)  # the node manager alone: its engines stay, unsupervised
        holder.process.wait()
        killed_at = time.monotonic()
        wait_taken_over(cluster, victim, port)
        hand_over(cluster, victim, holder, claimant, port)
        fault.notes.append(f"taken over {time.monotonic() - killed_at:.1f}s after the kill")
        return killed_at

    run_row(cluster, Fault("node id: holder SIGKILL, the second takes over", inject, justified=on_it))


def test_node_id_paused_holder_returns_after_a_takeover(cluster):
    victim = cluster.busiest_node()
    on_it = {i for (i, _), n in cluster.where().items() if n == victim}

    def inject(fault: Fault) -> float:
        holder = cluster.process(victim)
        claimant, port = start_claimant(cluster, victim)
        holder.process.send_signal(signal.SIGSTOP)  # silent, and deaf to the re-check
        try:
            wait_taken_over(cluster, victim, port)
        finally:
            holder.process.send_signal(signal.SIGCONT)
        back_at = time.monotonic()
        hand_over(cluster, victim, holder, claimant, port)
        # Back, its registration is refused (the log says so again) and it starts nothing.
        refused = log_of(holder).count(REFUSED)
        wait_for(
            lambda: log_of(holder).count(REFUSED) > refused,
            timeout=30,
            interval=0.2,
            what="the returning holder refused",
        )
        fault.notes.append("the returning holder refused, its copies stopped")
        stop(holder)
        return back_at

    run_row(cluster, Fault("node id: paused holder returns after a takeover", inject, justified=on_it))
