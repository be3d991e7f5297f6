"""Real etcd members on loopback for the high-availability tests (etcd from Debian's etcd-server:
scripts/etcd-server.sh). Each fixture stops its members and checks none is left running."""

from __future__ import annotations

import shutil
import uuid

import pytest

from controller.store.etcd_client import EtcdTarget, connect
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


@pytest.fixture(scope="module")
def etcd1(tmp_path_factory):
    """One member shared by a module's tests; each test works under its own prefix."""
    yield from _started(tmp_path_factory, 1)


@pytest.fixture
def etcd3(tmp_path_factory):
    """Three members, fresh for each test (tests kill and restart members)."""
    yield from _started(tmp_path_factory, 3)


@pytest.fixture
def prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:8]}"


def unguarded() -> list:
    """The fence of an etcd store tested alone: no election runs, so its writes carry no guard."""
    return []


def target_of(cluster: EtcdCluster, prefix: str, timeout: float = 2.0) -> EtcdTarget:
    return EtcdTarget(tuple((m.host, m.client_port) for m in cluster.members), prefix, request_timeout=timeout)


@pytest.fixture
async def clients():
    """Makes etcd clients and closes them after the test."""
    made = []

    def make(cluster: EtcdCluster, prefix: str, timeout: float = 2.0):
        client = connect(target_of(cluster, prefix, timeout))
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()
