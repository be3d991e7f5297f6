"""Real etcd members on loopback for the high-availability tests (etcd from Debian's etcd-server:
scripts/etcd-server.sh). Each fixture stops its members and checks none is left running."""

from __future__ import annotations

import uuid

import pytest

from controller.store.etcd_client import connect
from motorctl.etcd_cluster import EtcdCluster
from tests.support.etcd_members import _started, target_of


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
