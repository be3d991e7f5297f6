"""Two node manager processes claiming one node id, with real processes: a cluster as
`motorctl up` starts it, then a second `motor-node-manager --node-id node-a` with its own
--listen and --state-dir. Engines are counted as processes, by instance and rank."""

from __future__ import annotations

import collections
import os
import signal
import time
import uuid

import psutil
import pytest

from motor.v1 import controller_pb2 as C
from motorctl.cluster_processes import ManagedProcess
from tests.support import process_alive, wait_for
from tests.support.process_cluster import GRACE, HEARTBEAT, Cluster, apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)
from tests.support.second_node_manager import REFUSED, log_of, refused_so_far, start_second

pytestmark = pytest.mark.processes


def engine_processes(cluster: Cluster) -> collections.Counter:
    """(instance id, rank) -> live engine server processes of this cluster (by their directory)."""
    counts: collections.Counter = collections.Counter()
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        info = proc.info
        argv, cwd = info["cmdline"] or [], info["cwd"] or ""
        if info["status"] == psutil.STATUS_ZOMBIE or "--instance-id" not in argv or not cwd.startswith(cluster.run_dir):
            continue
        if any(os.path.basename(a) == "engine_server" for a in argv[:2]):
            counts[(argv[argv.index("--instance-id") + 1], argv[argv.index("--dp-rank") + 1])] += 1
    return counts


def node(cluster: Cluster, node_id: str = "node-a") -> C.Node:
    return {n.info.node_id: n for n in cluster.node_list().nodes}[node_id]


def running_with_a_second_claimant(make_cluster) -> tuple[Cluster, ManagedProcess, ManagedProcess, int]:
    cluster = make_cluster(nodes=2)
    apply(cluster, sim_deployment(count=2, dp=2))
    wait_for(lambda: cluster.all_ready(2), timeout=90, interval=0.2, what="READY")
    holder = cluster.process("node-a")
    second, port = start_second(cluster)
    wait_for(lambda: REFUSED in log_of(second), timeout=30, interval=0.2, what="the second node manager refused")
    return cluster, holder, second, port


def test_a_second_node_manager_for_a_live_node_id_is_refused_and_runs_nothing(make_cluster):
    cluster, holder, second, port = running_with_a_second_claimant(make_cluster)
    before = node(cluster)
    restarts = {i.instance_id: i.restarts for i in cluster.instances().values()}
    wait_for(lambda: refused_so_far(cluster) >= 5, timeout=30, interval=0.2, what="five refused registrations")
    after = node(cluster)
    assert after.generation == before.generation and after.info.address == before.info.address
    assert after.info.process.pid == holder.process.pid
    counts = engine_processes(cluster)
    assert counts == {(i, r): 1 for i in ("u-0", "u-1") for r in ("0", "1")}, counts
    line = next(line for line in log_of(second).splitlines() if REFUSED in line)
    assert f"127.0.0.1:{port}" in line and before.info.address in line and "holding it since 20" in line
    assert f"pid {holder.process.pid}" in line and f"pid {second.process.pid}" in line
    conflicts = [e for e in cluster.events() if e.type == C.EVENT_TYPE_NODE_CONFLICT]
    assert len(conflicts) == 1, [e.message for e in conflicts]
    assert second.process.poll() is None  # it waits, asking again every interval
    instances = cluster.instances().values()
    assert {i.instance_id: i.restarts for i in instances} == restarts, [i.engines for i in instances]


def test_the_second_takes_over_after_kill_9_of_the_holder_and_never_doubles_an_engine(make_cluster):
    cluster, holder, second, port = running_with_a_second_claimant(make_cluster)
    generation = node(cluster).generation
    left = [p.pid for p in psutil.Process(holder.process.pid).children(recursive=True)]
    os.kill(holder.process.pid, signal.SIGKILL)  # the node manager alone: its engines stay, unsupervised
    holder.process.wait()
    killed_at = time.monotonic()
    most: collections.Counter = collections.Counter()

    def taken_over() -> bool:
        for key, count in engine_processes(cluster).items():
            most[key] = max(most[key], count)
        current = node(cluster)
        return (
            current.info.address == f"127.0.0.1:{port}" and current.state == C.NODE_STATE_READY and cluster.all_ready(2)
        )

    wait_for(taken_over, timeout=90, interval=0.1, what="the second node manager holds node-a, every instance READY")
    print(f"kill -9 -> taken over and READY after {time.monotonic() - killed_at:.1f}s (grace {GRACE}s)")
    cluster.node_ports["node-a"] = port  # stop the engines through the new holder at the end
    assert most and max(most.values()) == 1, most
    assert engine_processes(cluster) == {(i, r): 1 for i in ("u-0", "u-1") for r in ("0", "1")}
    assert node(cluster).generation > generation
    assert "took node id node-a over from" in log_of(second)
    assert left and not [p for p in left if process_alive(p)]
    assert not [e for e in cluster.events() if e.type == C.EVENT_TYPE_NODE_LOST and e.node_id == "node-a"]


def test_a_paused_holder_that_returns_after_a_takeover_is_fenced_and_its_copies_stop(make_cluster):
    cluster, holder, second, port = running_with_a_second_claimant(make_cluster)
    old_pids = {p.pid for p in psutil.Process(holder.process.pid).children(recursive=True)}
    holder.process.send_signal(signal.SIGSTOP)  # a partition on one host: silent, and deaf to the re-check
    try:
        wait_for(
            lambda: node(cluster).info.address == f"127.0.0.1:{port}" and cluster.all_ready(2),
            timeout=90,
            interval=0.2,
            what="taken over while the holder is paused",
        )
    finally:
        holder.process.send_signal(signal.SIGCONT)
    cluster.node_ports["node-a"] = port
    assert not [p for p in old_pids if process_alive(p)]
    # Back: its heartbeats are stale, its registration is refused, and it starts nothing.
    wait_for(lambda: REFUSED in log_of(holder), timeout=30, interval=0.2, what="the returning holder refused")
    generation = node(cluster).generation
    time.sleep(4 * HEARTBEAT)  # it keeps asking; the holder keeps the node id and its generation
    assert node(cluster).generation == generation and node(cluster).info.address == f"127.0.0.1:{port}"
    assert engine_processes(cluster) == {(i, r): 1 for i in ("u-0", "u-1") for r in ("0", "1")}
    assert not psutil.Process(holder.process.pid).children(recursive=True)


class TlsCluster(Cluster):
    """Mutual TLS on every plane (`motorctl up --tls`), with node ids of its own: a takeover kills
    the engines a node id left on this host, and other runs on this machine use node-a."""

    prefix = f"tls{uuid.uuid4().hex[:8]}"

    def node_ids(self) -> list[str]:
        return [f"{self.prefix}-{chr(ord('a') + index)}" for index in range(self.nodes)]

    def stub(self):
        if not hasattr(self, "_channel"):
            self._channel = self.credentials("operator").channel(self.controller_address)
        return super().stub()


def test_under_mtls_a_second_process_with_the_same_node_certificate_is_refused(make_cluster):
    cluster = make_cluster(nodes=1, kind=TlsCluster, tls=True)
    node_a, node_b = cluster.node_ids()[0], f"{TlsCluster.prefix}-b"
    apply(cluster, sim_deployment(count=1, dp=2))
    wait_for(lambda: cluster.all_ready(1), timeout=90, interval=0.2, what="READY over mTLS")
    holder = cluster.process(node_a)
    before = node(cluster, node_a)
    engines = {("u-0", "0"): 1, ("u-0", "1"): 1}
    assert engine_processes(cluster) == engines

    # The same certificate, another process: the access rules let it speak for node_a; the claim refuses it.
    second, port = start_second(cluster, node_a)
    wait_for(lambda: REFUSED in log_of(second), timeout=30, interval=0.2, what="the second node manager refused")
    wait_for(lambda: refused_so_far(cluster) >= 3, timeout=30, interval=0.2, what="three refused registrations")
    line = next(line for line in log_of(second).splitlines() if REFUSED in line)
    assert "FAILED_PRECONDITION" in line and node_a in line and "holding it since 20" in line, line
    assert f"127.0.0.1:{port}" in line and before.info.address in line, line
    assert f"pid {holder.process.pid}" in line and f"pid {second.process.pid}" in line, line
    after = node(cluster, node_a)
    assert (after.generation, after.info.address, after.info.process.pid) == (
        before.generation,
        before.info.address,
        holder.process.pid,
    )
    assert engine_processes(cluster) == engines
    assert second.process.poll() is None and not psutil.Process(second.process.pid).children(recursive=True)

    # Another node id with node_a's certificate: the access rules refuse it before any claim is judged.
    impostor, _ = start_second(cluster, node_b, certificate=node_a)
    wait_for(lambda: "PERMISSION_DENIED" in log_of(impostor), timeout=30, interval=0.2, what="the impostor refused")
    line = next(line for line in log_of(impostor).splitlines() if "PERMISSION_DENIED" in line)
    assert f"spiffe://motor/node/{node_a}" in line and f"node:{node_b}" in line, line
    time.sleep(4 * HEARTBEAT)  # it keeps asking; nothing of it ever lands
    assert [n.info.node_id for n in cluster.node_list().nodes] == [node_a]
    assert node(cluster, node_a).generation == before.generation
    assert engine_processes(cluster) == engines
    assert impostor.process.poll() is None and not psutil.Process(impostor.process.pid).children(recursive=True)
