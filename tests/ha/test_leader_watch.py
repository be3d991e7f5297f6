"""A standby's fast path when the leader's process is gone (controller/ha/leader_watch.py), against
real etcd and real gRPC servers: a leader whose address starts refusing connections after the
standby was connected loses its lease at once (and its old guard is refused by etcd); an
address that never answered, or one that still accepts, costs the lease as before."""

from __future__ import annotations

import asyncio

import pytest

from controller.ha.election import LeaderElection, Role
from controller.ha.leader_watch import LeaderDeathWatch, refuses_connections
from controller.store.etcd import EtcdStore, Fenced
from controller.store.etcd_client import connect
from motor.ports import free_port
from motor.service.grpc_server import MotorServer, aio_channel
from tests.support import async_wait_for
from tests.support.etcd_members import target_of

TTL = 2


async def _serving() -> tuple[MotorServer, str]:
    server = MotorServer("127.0.0.1:0")  # health and reflection: enough to hold a connection to
    return server, f"127.0.0.1:{await server.start()}"


async def _pair(etcd1, clients, prefix, leader_address: str):
    target = target_of(etcd1, prefix)
    first = LeaderElection(
        clients(etcd1, prefix), prefix, leader_address, ttl=TTL, renew_client=lambda: connect(target)
    )
    first.start()
    await async_wait_for(first.is_leader, timeout=10, what="the first controller to lead")
    second = LeaderElection(
        clients(etcd1, prefix), prefix, "127.0.0.1:1", ttl=TTL, renew_client=lambda: connect(target)
    )
    second.start()
    await async_wait_for(lambda: second.role is Role.STANDBY, timeout=10, what="the second to see the leader")
    watch = LeaderDeathWatch(second, lambda address: aio_channel(address))
    watch.start()
    return first, second, watch


async def test_refused_only_when_nothing_listens():
    server, address = await _serving()
    try:
        assert not await refuses_connections(address, 1.0)
    finally:
        await server.stop(0)
    assert await refuses_connections(address, 1.0)


async def test_a_leader_whose_port_refuses_loses_its_lease_at_once(etcd1, clients, prefix):
    """The leader's server goes away while its process still renews (the worst case for the
    guess): the standby revokes the lease and leads; the old leader's guard is refused by etcd
    and its next renewal steps it down."""
    server, address = await _serving()
    first, second, watch = await _pair(etcd1, clients, prefix, address)
    try:
        old_fence = first.fence()
        await asyncio.sleep(0.5)  # the standby connects to the leader
        await server.stop(0)
        # The old leader still renews: without the revocation the standby would never lead.
        await async_wait_for(second.is_leader, timeout=10, interval=0.01, what="the standby to lead")
        assert second.epoch == 2
        assert f"the leader {address} (epoch 1) refused connections" in second.reason
        store = EtcdStore(clients(etcd1, prefix), prefix, fence=lambda: old_fence)
        await store.open()
        store.save_instance("from-the-old-leader", {"n": 1})
        with pytest.raises(Fenced):
            await store.flush()
        store.close()
        await async_wait_for(
            lambda: not first.is_leader() and first.role is not Role.LEADER,
            timeout=TTL * 2,
            what="the old leader to step down",
        )
    finally:
        await watch.stop()
        await second.stop()
        await first.stop()


async def test_an_address_never_reached_is_no_evidence(etcd1, clients, prefix):
    """A leader advertising an address where nothing ever answered (a wrong --advertise) keeps
    leading: the standby never held a connection to it, so a refusal proves nothing."""
    first, second, watch = await _pair(etcd1, clients, prefix, f"127.0.0.1:{free_port()}")
    try:
        await asyncio.sleep(TTL * 2)
        assert first.is_leader() and first.epoch == 1 and second.role is Role.STANDBY
    finally:
        await watch.stop()
        await second.stop()
        await first.stop()


class _BehindView:
    """A standby's election that has not yet read the leader's resignation (on a loaded machine
    the deletion of the leader key can reach it after the leader's port has closed): what its
    death watch reads."""

    def __init__(self, election: LeaderElection):
        self.client, self.leader_key = election.client, election.leader_key
        self.ttl, self.renew_period = election.ttl, election.renew_period
        self.role, self.leader, self.vacancy_reason = election.role, election.leader, ""

    async def wait_for(self, predicate) -> None:
        while not predicate(self):
            await asyncio.sleep(0.05)


async def test_a_leader_that_resigned_before_its_port_closed_is_not_called_dead(etcd1, clients, prefix):
    """SIGTERM: the leader revokes its lease, then closes its port. A standby whose watch sees
    the port refuse before it has read the resignation must not call the leader dead: the
    election's reason stays the resignation (the key's deletion), not a refused connection."""
    server, address = await _serving()
    first, second, watch = await _pair(etcd1, clients, prefix, address)
    await watch.stop()
    await second.stop()
    behind = _BehindView(second)
    assert behind.role is Role.STANDBY and behind.leader is not None and behind.leader.address == address
    watch = LeaderDeathWatch(behind, lambda address: aio_channel(address))  # type: ignore[arg-type]
    watch.start()
    try:
        await asyncio.sleep(0.5)  # the standby connects to the leader
        await first.stop()  # resigns: the leader key is deleted
        await server.stop(0)  # then the port closes
        await asyncio.sleep(1.5)  # the watch sees the port refuse, and looks
        assert behind.vacancy_reason == ""
    finally:
        await watch.stop()
        await first.stop()
