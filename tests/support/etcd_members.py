"""Real etcd members for the high-availability tests: started, guarded, and a store target on them."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from controller.store.etcd_client import EtcdTarget
from motorctl.etcd_cluster import EtcdCluster
from tests.support import require


def _require_etcd() -> None:
    require(shutil.which("etcd") is not None, "etcd (Debian's etcd-server: run scripts/etcd-server.sh)")


def _started(tmp_path_factory: pytest.TempPathFactory, size: int):
    _require_etcd()
    cluster = EtcdCluster(str(tmp_path_factory.mktemp(f"etcd{size}")), size=size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = [m.name for m in cluster.members if m.running()]
        assert not left, f"etcd members still running after stop: {left}"


def unguarded() -> list:
    """The fence of an etcd store tested alone: no election runs, so its writes carry no guard."""
    return []


def target_of(cluster: EtcdCluster, prefix: str, timeout: float = 2.0) -> EtcdTarget:
    return EtcdTarget(tuple((m.host, m.client_port) for m in cluster.members), prefix, request_timeout=timeout)


def raft_leadership_moved_off(cluster: EtcdCluster, index: int) -> None:
    """Makes sure member `index` is not etcd's raft leader (etcdctl move-leader), so that losing
    it tests the clients' move to another member, not etcd's own election."""
    assert cluster.tls is None, "plaintext members only"
    endpoints = ",".join(m.endpoint for m in cluster.members)

    def etcdctl(*args: str, at: str = endpoints) -> str:
        done = subprocess.run(["etcdctl", "--endpoints", at, *args], capture_output=True, text=True, timeout=20)
        assert done.returncode == 0, done.stderr
        return done.stdout

    statuses = json.loads(etcdctl("endpoint", "status", "-w", "json"))
    ids = {s["Endpoint"]: s["Status"]["header"]["member_id"] for s in statuses}
    leader = statuses[0]["Status"]["leader"]
    avoided = ids[cluster.members[index].endpoint]
    if leader == avoided:
        to = next(i for e, i in ids.items() if i != avoided)
        etcdctl("move-leader", format(to, "x"), at=cluster.members[index].endpoint)
