"""Client certificates rotated on a running mutual-TLS cluster are used without a restart.

A `motorctl up --tls` cluster (controller, two node managers, the example deployment) gets a new
CA and new certificates for every identity, written over the old files the way a rotation does
(the bundle holds both CAs while the leaves are re-issued, then only the new CA: every old
certificate is invalid). Then every established connection between the cluster's processes is
cut (`ss -K`, a network glitch), so each client must handshake again. Node managers must keep
heartbeating, engines must keep being polled and must not be killed, and the controller must
still start engines on the nodes. A bad rotation (a certificate of a CA the cluster does not
trust, an expired one, a deleted file) keeps the node heartbeating on its last good files.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor.ports import free_port
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority, write_atomically
from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from motorctl.connect import Credentials
from motorctl.local_cluster import LocalCluster
from motorctl.pki_command import DEV_HOSTS
from tests.support import require, wait_for
from tests.support.local_cluster import example_cluster

pytestmark = pytest.mark.processes

NORMAL = types_pb2.HEALTH_STATUS_NORMAL


def _cut_works() -> bool:
    """`ss -K` can destroy a TCP socket here (root and a kernel with INET_DIAG_DESTROY)."""
    if shutil.which("ss") is None:
        return False
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                subprocess.run(
                    ["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)], capture_output=True, timeout=10
                )
                try:
                    client.send(b"x")
                    return client.recv(1) == b""
                except OSError:
                    return True


def cut_connections(ports: list[int]) -> int:
    """Destroy every TCP connection to or from `ports` on this host; returns how many sockets went."""
    ends = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
    out = subprocess.run(
        ["ss", "-K", "-H", "-t", "state", "established", f"( {ends} )"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return len(out.splitlines())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require(_cut_works(), "`ss -K` (iproute2, run as root) to cut the cluster's connections")
    cluster = example_cluster(
        tmp_path_factory, "rotation", controller_port=free_port(), engine_port_base=26000, tls=True
    )
    try:
        cluster.start(timeout=90)
        wait_for(
            lambda: len(_normal_engines(cluster)) == 3, timeout=120, interval=0.5, what="the example deployment NORMAL"
        )
        yield cluster
    finally:
        problems = cluster.stop()
        assert not problems, problems


def _controller(cluster: LocalCluster, identity: str = "viewer") -> controller_pb2_grpc.ControllerServiceStub:
    return controller_pb2_grpc.ControllerServiceStub(cluster.credentials(identity).channel(cluster.controller_address))


def _nodes(cluster: LocalCluster) -> list[controller_pb2.Node]:
    return list(_controller(cluster).ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes)


def _normal_engines(cluster: LocalCluster) -> dict[str, types_pb2.Engine]:
    return {e.engine_id: e for n in _nodes(cluster) for e in n.engines if e.health == NORMAL}


def _status_checks_answered(engine: types_pb2.Engine) -> float:
    """GetStatus calls the engine server answered OK (its own /metrics): its node manager's polls."""
    with urllib.request.urlopen(f"http://127.0.0.1:{engine.spec.port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "grpc_server_handled_total"
        and sample.labels.get("grpc_method") == "GetStatus"
        and sample.labels.get("grpc_code") == "OK"
    )


def rotate_to_a_new_ca(cluster: LocalCluster) -> None:
    """A new CA; the bundle trusts both while every leaf is re-issued from it; then only the new one."""
    pki = cluster.pki
    old_ca = open(pki.ca, "rb").read()
    ca = CertificateAuthority.create("Motor rotated CA")
    write_atomically(pki.ca, old_ca + ca.cert_pem)
    for name in ["controller", *cluster.node_ids()]:
        identity = Identity("controller") if name == "controller" else Identity("node", name)
        ca.issue(identity, DEV_HOSTS).save(pki.directory, name)
    for kind in ("operator", "viewer"):
        ca.issue(Identity(kind, kind), []).save(pki.directory, kind)
    ca.save(pki.directory)  # ca.crt now holds the new CA only: the old certificates are invalid


def test_rotated_client_certificates_are_used_without_a_restart(cluster, tmp_path):
    before = _normal_engines(cluster)
    old = {
        name: shutil.copy(path, tmp_path)
        for name, path in [
            ("ca", cluster.pki.ca),
            ("cert", cluster.pki.cert("viewer")),
            ("key", cluster.pki.key("viewer")),
        ]
    }
    rotate_to_a_new_ca(cluster)
    engine_ports = [e.spec.mgmt_port for e in before.values()]
    polls = {engine_id: _status_checks_answered(e) for engine_id, e in before.items()}
    cut_at = time.time()
    cut = cut_connections([cluster.controller_port, *cluster.node_ports.values(), *engine_ports])
    assert cut >= len(cluster.node_ports) + len(engine_ports), f"only {cut} connections were cut"

    def heartbeating() -> bool:
        nodes = _nodes(cluster)
        return len(nodes) == 2 and all(
            n.state == controller_pb2.NODE_STATE_READY and n.last_heartbeat.ToNanoseconds() / 1e9 > cut_at + 1
            for n in nodes
        )

    wait_for(heartbeating, timeout=60, interval=0.5, what="both node managers heartbeating with their new certificates")
    wait_for(
        lambda: all(_status_checks_answered(e) > polls[i] for i, e in before.items()),
        timeout=60,
        interval=0.5,
        what="every engine polled by its node manager again",
    )
    # Five abnormal polls (2.5 s here) would have killed an engine its node manager cannot reach.
    time.sleep(4)
    after = _normal_engines(cluster)
    assert {i: (e.node_id, e.pid, e.spec.generation) for i, e in after.items()} == {
        i: (e.node_id, e.pid, e.spec.generation) for i, e in before.items()
    }
    assert all(e.consecutive_abnormal == 0 for e in after.values())

    # The controller reaches the node managers too: a second prefill/decode pair starts.
    operator = _controller(cluster, "operator")
    deployment = operator.GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).deployment
    for group in deployment.instance_groups:
        group.count = 2
    operator.ApplyDeployment(controller_pb2.ApplyDeploymentRequest(deployment=deployment), timeout=30)
    wait_for(
        lambda: {"prefill-1/rank0", "prefill-1/rank1", "decode-1/rank0"} <= set(_normal_engines(cluster)),
        timeout=90,
        interval=0.5,
        what="prefill-1 and decode-1 started by the controller with its new certificate",
    )

    # The old certificates are invalid now: a client still holding them is refused.
    with Credentials(ca=old["ca"], cert=old["cert"], key=old["key"]).channel(cluster.controller_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            controller_pb2_grpc.ControllerServiceStub(channel).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("bad", ["another CA", "expired", "deleted"])
def test_a_bad_rotation_keeps_the_node_heartbeating_on_its_last_good_certificate(cluster, bad):
    """node-a's files replaced by a certificate of a CA the cluster does not trust, an expired
    one, or removed; then every connection cut (so the next heartbeat needs a new handshake)."""
    node_id, pki = "node-a", cluster.pki
    cert, key = pki.cert(node_id), pki.key(node_id)
    good = {path: open(path, "rb").read() for path in (cert, key)}
    log = cluster.process(node_id).log_path
    logged_before = open(log, errors="replace").read().count("TLS files changed but cannot be used")
    if bad == "another CA":
        CertificateAuthority.create("stranger").issue(Identity("node", node_id), DEV_HOSTS).save(pki.directory, node_id)
    elif bad == "expired":
        long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
        CertificateAuthority.load(pki.directory).issue(
            Identity("node", node_id), DEV_HOSTS, days=1, not_before=long_ago
        ).save(pki.directory, node_id)
    else:
        os.remove(cert)
    try:
        cut_at = time.time()
        cut_connections([cluster.controller_port, *cluster.node_ports.values()])

        def beat_since_cut() -> bool:
            [node] = [n for n in _nodes(cluster) if n.info.node_id == node_id]
            return (
                node.state == controller_pb2.NODE_STATE_READY and node.last_heartbeat.ToNanoseconds() / 1e9 > cut_at + 2
            )

        wait_for(beat_since_cut, timeout=60, interval=0.5, what=f"{node_id} heartbeating on its last good certificate")
        lines = [
            line
            for line in open(log, errors="replace").read().splitlines()
            if "TLS files changed but cannot be used" in line
        ][logged_before:]
        # Said once per change of the files (the key lands first, then the certificate) by each of
        # the node manager's two watches (its channels', its server's), naming the file and why.
        why = {"another CA": "is not issued by a CA of", "expired": "expired on", "deleted": "No such file"}[bad]
        assert 1 <= len(lines) <= 4 and any(
            "cert: " in line and repr(cert) in line and why in line for line in lines
        ), lines
    finally:
        for path, content in good.items():
            write_atomically(path, content, private=path == key)
