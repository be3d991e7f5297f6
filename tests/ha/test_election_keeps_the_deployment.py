"""An election never changes the desired state: every controller of `motorctl up --ha` is given
the same `--deployment FILE`, which seeds a new store once; a later `motorctl apply` is the
operator's newer word and must survive any number of elections (real etcd, two controllers, two
node managers, sim engines)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from motor.ports import free_port
from motor.v1 import controller_pb2
from motorctl.cluster_processes import script_path
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for, write_sim_deployment
from tests.support.etcd_members import _require_etcd
from tests.support.ha_controllers import _controllers, _leader, _process_of, _stub

TTL = 2


def _write(path, count: int) -> str:
    return write_sim_deployment(path, count, name="seeded")


@pytest.fixture
def seeded(tmp_path):
    _require_etcd()
    local = LocalCluster(
        str(tmp_path / "run"),
        nodes=2,
        deployment_path=_write(tmp_path / "A.yaml", 1),
        heartbeat_interval=0.5,
        node_grace=2.0,
        engine_port_base=37000,
        controller_port=free_port(),
        ha=True,
        etcd_members=1,
        extra_controller_args=["--lease-ttl", str(TTL), "--startup-grace", "0"],
        node_id_prefix="seed-node",
    )
    try:
        local.start(timeout=60)
        yield local, tmp_path
    finally:
        problems = local.stop()
        assert not problems, problems


def _deployment(cluster) -> controller_pb2.GetDeploymentResponse:
    return _stub(_leader(cluster)).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5)


def _ready(cluster) -> set[str]:
    instances = _stub(_leader(cluster)).ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
    return {i.instance_id for i in instances if i.state == controller_pb2.INSTANCE_STATE_READY}


def test_a_new_leader_does_not_apply_its_deployment_file_over_an_operators_apply(seeded):
    cluster, tmp_path = seeded
    wait_for(lambda: _leader(cluster) and _ready(cluster) == {"u-0"}, timeout=60, what="A.yaml's one instance READY")
    assert _deployment(cluster).revision == 1
    applied = subprocess.run(
        [
            script_path("motorctl"),
            "--controller",
            ",".join(cluster.controller_addresses),
            "apply",
            "-f",
            _write(tmp_path / "B.yaml", 3),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert applied.returncode == 0, applied.stderr
    wait_for(lambda: _ready(cluster) == {"u-0", "u-1", "u-2"}, timeout=60, what="B.yaml's three instances READY")

    old = _leader(cluster)
    epoch = _controllers(cluster).epoch
    process, _ = _process_of(cluster, old)
    standby = cluster.process(
        next(p.name for p in cluster.processes if p.name.startswith("controller") and p is not process)
    )
    log_size = os.path.getsize(standby.log_path)
    os.kill(process.process.pid, signal.SIGSTOP)  # past its lease: the standby is elected
    try:
        new = wait_for(lambda: _leader(cluster, exclude=old), timeout=TTL * 3 + 10, interval=0.05, what="a new leader")
        assert _controllers(cluster, exclude=old).epoch == epoch + 1
    finally:
        os.kill(process.process.pid, signal.SIGCONT)
    wait_for(lambda: _leader(cluster) == new, timeout=20, what="the resumed controller to stand by")

    stored = _deployment(cluster)
    assert stored.revision == 2 and stored.deployment.instance_groups[0].count == 3
    wait_for(lambda: _ready(cluster) == {"u-0", "u-1", "u-2"}, timeout=30, what="B.yaml's three instances still READY")
    with open(standby.log_path, encoding="utf-8", errors="replace") as log:
        log.seek(log_size)
        elected = log.read()
    assert "applied" not in elected.replace("not applied", ""), elected
    assert "not applied: the store holds revision 2" in elected, elected


def test_reads_on_a_standby_say_they_are_a_standbys_view_and_name_the_leader(seeded):
    """Either controller of `motorctl up --ha` may lead; one read on the standby must not look
    like a cluster whose engines are gone (no state, no health, every node waiting to report)."""
    cluster, _ = seeded
    wait_for(lambda: _leader(cluster) and _ready(cluster) == {"u-0"}, timeout=60, what="A.yaml's one instance READY")
    leader = _leader(cluster)
    standby = next(a for a in cluster.controller_addresses if a != leader)
    for address, expected in ((leader, ""), (standby, leader)):
        stub = _stub(address)
        views = [
            stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).standby_view,
            stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).standby_view,
            stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).standby_view,
        ]
        if not expected:
            assert views == ["", "", ""], views
        else:
            assert all(f"ask the leader {leader}" in v and "standby" in v for v in views), views
    for command in ("nodes", "instances", "endpoints"):
        shown = subprocess.run(
            [script_path("motorctl"), "--controller", standby, command], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("STANDBY VIEW: ") and leader in shown.stdout.splitlines()[0], shown.stdout
    on_leader = subprocess.run(
        [script_path("motorctl"), "--controller", leader, "nodes"], capture_output=True, text=True, timeout=60
    )
    assert "STANDBY" not in on_leader.stdout, on_leader.stdout
