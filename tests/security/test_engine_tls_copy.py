"""Engines get the TLS files their node manager is using, not the node's own paths: a bad node
certificate file (garbage, deleted, a symlink loop) must not crash-loop every engine started on
that node while the node manager keeps its last good files; a good rotation still reaches them."""

from __future__ import annotations

import os

import pytest

from motor.ports import free_port
from motor.security.pki import write_atomically
from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from motorctl.local_cluster import LocalCluster
from motorctl.pki_command import DevPki, make_dev_pki
from node_manager.engine_tls import EngineTlsCopy, engine_tls_paths
from tests.support import wait_for, write_sim_deployment
from tests.support.local_cluster import started


def _contents(paths: dict[str, str]) -> dict[str, bytes]:
    return {field: open(path, "rb").read() for field, path in paths.items()}


def test_the_copy_holds_the_last_good_files_and_follows_a_good_rotation(tmp_path):
    pki = DevPki(str(tmp_path / "pki"))
    make_dev_pki(pki.directory, ["node-a", "node-b"])
    cert, key = pki.cert("node-a"), pki.key("node-a")
    good = {"cert": open(cert, "rb").read(), "key": open(key, "rb").read(), "ca": open(pki.ca, "rb").read()}
    copy = EngineTlsCopy(str(tmp_path / "state"), cert, key, pki.ca)
    assert copy.refresh()
    paths = engine_tls_paths(str(tmp_path / "state"))
    assert _contents(paths) == good
    assert os.stat(paths["key"]).st_mode & 0o077 == 0  # the key stays private

    for bad in ("garbage", "deleted", "symlink loop"):
        os.remove(cert)
        if bad == "garbage":
            write_atomically(cert, b"not a certificate\n")
        elif bad == "symlink loop":
            os.symlink(cert, cert)
        assert not copy.refresh()
        assert _contents(paths) == good, bad
        if os.path.lexists(cert):
            os.remove(cert)
        write_atomically(cert, good["cert"])

    # A good rotation (node-b's pair stands in for a re-issued one) reaches the copy.
    write_atomically(key, open(pki.key("node-b"), "rb").read(), private=True)
    write_atomically(cert, open(pki.cert("node-b"), "rb").read())
    assert copy.refresh()
    assert _contents(paths)["cert"] == open(pki.cert("node-b"), "rb").read()
    assert len(os.listdir(os.path.dirname(os.path.realpath(paths["cert"])) + "/..")) <= 3  # old versions pruned


@pytest.fixture
def tls_cluster(tmp_path):
    deployment = write_sim_deployment(tmp_path / "deployment.yaml", 1)
    cluster = LocalCluster(
        str(tmp_path / "run"),
        nodes=1,
        controller_port=free_port(),
        heartbeat_interval=0.5,
        engine_port_base=39000,
        deployment_path=deployment,
        tls=True,
        extra_controller_args=["--startup-grace", "0"],
    )
    yield from started(cluster, timeout=90)


def _instances(cluster: LocalCluster) -> dict[str, controller_pb2.Instance]:
    with cluster.credentials("operator").channel(cluster.controller_address) as channel:
        reply = controller_pb2_grpc.ControllerServiceStub(channel).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=5
        )
    return {i.instance_id: i for i in reply.instances}


def _serving(instance: controller_pb2.Instance | None) -> bool:
    return (
        instance is not None
        and instance.state == controller_pb2.INSTANCE_STATE_READY
        and all(e.health == types_pb2.HEALTH_STATUS_NORMAL for e in instance.engines)
    )


@pytest.mark.processes
def test_an_engine_started_while_the_node_certificate_file_is_garbage_serves(tls_cluster):
    cluster = tls_cluster
    wait_for(lambda: _serving(_instances(cluster).get("u-0")), timeout=90, interval=0.5, what="u-0 serving")
    cert = cluster.pki.cert("node-a")
    good = open(cert, "rb").read()
    write_atomically(cert, b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    try:
        with cluster.credentials("operator").channel(cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            deployment = stub.GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).deployment
            deployment.instance_groups[0].count = 2
            stub.ApplyDeployment(controller_pb2.ApplyDeploymentRequest(deployment=deployment), timeout=30)
        wait_for(
            lambda: _serving(_instances(cluster).get("u-1")),
            timeout=60,
            interval=0.5,
            what="u-1 started on node-a with the node manager's last good certificate",
        )
        assert _instances(cluster)["u-1"].restarts == 0
    finally:
        write_atomically(cert, good)
