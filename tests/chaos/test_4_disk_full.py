"""Disk full, really: the controller's database and each node's state directory live on small
tmpfs mounts of their own (tests/chaos/conftest.py), filled to the last byte by a file while the
fault lasts. Where this machine refuses mounts the rows skip (fail under CI=true); the same rules
are then covered by the write-failure injections of tests/controller/store/test_store_full.py and
tests/node_manager/test_disk_full.py."""

from __future__ import annotations

import errno
import os
import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor.v1 import controller_pb2 as C
from tests.support import require, wait_for
from tests.support.chaos_cluster import deployment
from tests.support.chaos_rows import Fault, run_row

# How long the disk stays full after the engine is killed: the failure, the refused restart and
# the reconcile passes all happen on the full disk.
FULL_FOR = 3.0


@pytest.fixture(autouse=True)
def disks(cluster):
    require(cluster.disks_mounted, "tmpfs mounts (root) for the disk-full rows")


def fill(directory: str) -> str:
    """Writes a file into `directory` until its filesystem has no byte left; returns its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as handle:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return path


def counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def kill(cluster, instance_id: str) -> None:
    [pid] = cluster.engine_processes()[(instance_id, 0)]
    os.kill(pid, signal.SIGKILL)


def test_disk_full_controller(cluster):
    metric = "motor_controller_store_write_failures_total"

    def inject(fault: Fault) -> float:
        port = cluster.metrics_ports["controller"]
        refused_before = counter(port, metric)
        revision = cluster.stub().GetDeployment(C.GetDeploymentRequest(), timeout=5).revision
        filler = fill(cluster.db_dir)
        try:
            bigger = deployment(
                [{"name": "more", "role": "union", "count": 300, "accelerators_per_engine": 8}], union={}
            )
            with pytest.raises(grpc.RpcError) as refused:
                cluster.stub().ApplyDeployment(C.ApplyDeploymentRequest(deployment=bigger), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert cluster.stub().GetDeployment(C.GetDeploymentRequest(), timeout=5).revision == revision
            kill(cluster, "decode-0")
            time.sleep(FULL_FOR)  # the fault itself: the failure is handled on the full disk
            fault.notes.append(f"apply refused UNAVAILABLE; {counter(port, metric) - refused_before:g} writes refused")
        finally:
            os.remove(filler)
        return time.monotonic()

    run_row(cluster, Fault("disk full: controller (tmpfs)", inject, justified={"decode-0"}, must_replace={"decode-0"}))


def test_disk_full_node_manager(cluster):
    metric = "motor_node_manager_store_write_failures_total"
    full: list[str] = []  # the node whose disk was filled

    def inject(fault: Fault) -> float:
        node_id = cluster.where()[("decode-0", 0)]
        full.append(node_id)
        port = cluster.metrics_ports[node_id]
        refused_before = counter(port, metric)
        filler = fill(cluster.state_dir(node_id))
        try:
            kill(cluster, "decode-0")
            wait_for(
                lambda: counter(port, metric) > refused_before,
                timeout=30,
                interval=0.2,
                what=f"{node_id} refused a record write",
            )
            time.sleep(FULL_FOR)  # the fault itself: restarts are asked of a node with a full disk
            # The operator sees it: one ALARM naming the node and the cause, its count growing per heartbeat.
            raised = wait_for(
                lambda: store_alarms(cluster, node_id, "No space left on device"),
                timeout=30,
                interval=0.2,
                what=f"an ALARM event for {node_id}'s disk",
                detail=lambda: recent_events(cluster),
            )
            assert len(raised) == 1 and raised[0].count >= 1, raised
            fault.notes.append(
                f"{node_id}: {counter(port, metric) - refused_before:g} record writes refused, "
                f"alarm count {raised[0].count}"
            )
        finally:
            os.remove(filler)
        return time.monotonic()

    run_row(
        cluster, Fault("disk full: node manager (tmpfs)", inject, justified={"decode-0"}, must_replace={"decode-0"})
    )
    node_id = full[0]
    wait_for(
        lambda: store_alarms(cluster, node_id, "written again"),
        timeout=60,
        interval=0.3,
        what=f"the ALARM event saying {node_id}'s disk takes writes again",
    )
    assert (
        len(store_alarms(cluster, node_id, "No space left on device")) == 1
    )  # one event for the spell, not one per beat


def store_alarms(cluster, node_id: str, words: str) -> list[C.Event]:
    return [e for e in cluster.events() if e.type == C.EVENT_TYPE_ALARM and e.node_id == node_id and words in e.message]


def recent_events(cluster) -> str:
    return "\n".join(
        f"  {C.EventType.Name(e.type)} {e.node_id} x{e.count}: {e.message[:160]}" for e in cluster.events()[-25:]
    )
