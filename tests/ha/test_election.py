"""Leader election against real etcd: one leader, a rising epoch, resignation and lease expiry
hand over to a standby, a leader past its deadline stops at once, and a real leader process
paused with SIGSTOP past its lease steps down on SIGCONT with none of its writes landing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aetcd
import pytest

from controller.ha.election import LeaderElection, NotLeader, Role
from controller.store.etcd import EtcdStore, Fenced
from controller.store.etcd_client import EtcdTarget, connect
from tests.support import REPO_ROOT, async_wait_for, wait_for
from tests.support.etcd_members import target_of, unguarded

TTL = 2  # etcd's smallest lease with its default timing


def _election(etcd1, clients, prefix, address, **kwargs) -> LeaderElection:
    target = target_of(etcd1, prefix)
    return LeaderElection(
        clients(etcd1, prefix), prefix, address, ttl=TTL, renew_client=lambda: connect(target), **kwargs
    )


async def _pair(etcd1, clients, prefix, **kwargs):
    first = _election(etcd1, clients, prefix, "10.0.0.1:50051", **kwargs)
    first.start()
    await async_wait_for(first.is_leader, timeout=10, what="the first controller to lead")
    second = _election(etcd1, clients, prefix, "10.0.0.2:50051")
    second.start()
    await async_wait_for(lambda: second.role is Role.STANDBY, timeout=10, what="the second to see a leader")
    return first, second


async def test_one_leader_and_a_standby_that_knows_it(etcd1, clients, prefix):
    first, second = await _pair(etcd1, clients, prefix)
    try:
        assert first.epoch == 1 and first.leader.address == "10.0.0.1:50051"
        assert not second.is_leader() and second.epoch == 0
        assert second.leader.address == "10.0.0.1:50051" and second.leader.epoch == 1
        with pytest.raises(NotLeader, match="leader is 10.0.0.1:50051"):
            second.fence()
        await asyncio.sleep(TTL * 2)  # several renewals: the leader keeps leading
        assert first.is_leader() and second.role is Role.STANDBY
    finally:
        await second.stop()
        await first.stop()


async def test_resigning_hands_over_with_a_higher_epoch(etcd1, clients, prefix):
    first, second = await _pair(etcd1, clients, prefix)
    changes = []
    second.on_change(lambda role, leader, reason: changes.append((role, reason)))
    await first.stop()
    await async_wait_for(second.is_leader, timeout=TTL, what="the standby to lead after a resignation")
    assert second.epoch == 2
    assert changes[-1][0] is Role.LEADER and "elected" in changes[-1][1]
    await second.stop()


async def test_a_silent_leader_is_replaced_and_its_writes_are_refused(etcd1, clients, prefix):
    """The leader stops renewing without resigning (its process frozen): once the lease has
    expired, the standby leads, and the old leadership's guard fails in etcd itself."""
    first, second = await _pair(etcd1, clients, prefix)
    old_fence = first.fence()
    first._task.cancel()  # frozen: no renewals, no resignation
    await async_wait_for(second.is_leader, timeout=TTL * 3 + 2, what="the standby to lead after the lease expired")
    assert second.epoch == 2
    assert not first.is_leader(), "the frozen leader's own deadline has passed"
    with pytest.raises(NotLeader):
        first.fence()
    store = EtcdStore(clients(etcd1, prefix), prefix, fence=lambda: old_fence)  # a guard kept from before
    await store.open()
    store.save_instance("from-the-old-leader", {"n": 1})
    with pytest.raises(Fenced):
        await store.flush()
    assert "from-the-old-leader" not in (await _reopened(clients(etcd1, prefix), prefix)).instances
    store.close()
    await second.stop()


async def test_a_busy_event_loop_keeps_the_leadership(etcd1, clients, prefix):
    """A loop held longer than the lease (one huge reconcile pass): the renewal thread keeps
    the lease, so nobody else is elected and the leader goes on when its loop runs again."""
    first, second = await _pair(etcd1, clients, prefix)
    try:
        time.sleep(TTL * 1.5)  # blocks this loop, which both elections run on
        assert first.is_leader() and first.epoch == 1
        await asyncio.sleep(TTL)
        assert first.is_leader() and first.epoch == 1 and second.role is Role.STANDBY
    finally:
        await second.stop()
        await first.stop()


async def test_a_hung_event_loop_loses_the_leadership(etcd1, clients, prefix):
    """A loop that has not run for max_stall: the renewals stop, the lease expires, the standby
    leads; the old leader knows it is not leading the moment its loop runs again."""
    first, second = await _pair(etcd1, clients, prefix, max_stall=0.5)
    try:
        time.sleep(TTL * 2 + 1)
        assert not first.is_leader(), "renewals went on although the loop was stuck"
        with pytest.raises(NotLeader):
            first.fence()
        await async_wait_for(second.is_leader, timeout=TTL * 3, what="the standby to lead")
        assert second.epoch == 2
        await async_wait_for(lambda: first.role is Role.STANDBY, timeout=TTL * 3, what="the old leader to stand by")
    finally:
        await second.stop()
        await first.stop()


class _FailingFirst:
    """A renewal client whose first lease renewals fail as a lost etcd member's do."""

    def __init__(self, client, failures: int):
        self.client, self.failures, self.calls = client, failures, []

    async def refresh_lease(self, lease_id):
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise aetcd.exceptions.ConnectionFailedError("the member went away")
        return await self.client.refresh_lease(lease_id)

    async def close(self):
        await self.client.close()


async def test_a_failed_renewal_is_tried_again_soon_and_keeps_the_leadership(etcd1, clients, prefix):
    """Two renewals fail (the client moving to another member): tried again within a fraction
    of the renewal period, the leader renews before its deadline and does not step down."""
    target = target_of(etcd1, prefix)
    renewals: list[_FailingFirst] = []

    def renew_client():
        renewals.append(_FailingFirst(connect(target), failures=2))
        return renewals[-1]

    leader = LeaderElection(clients(etcd1, prefix), prefix, "10.0.0.1:50051", ttl=TTL, renew_client=renew_client)
    leader.start()
    try:
        await async_wait_for(leader.is_leader, timeout=10, what="the controller to lead")
        await asyncio.sleep(TTL * 1.5)
        calls = renewals[0].calls
        assert len(calls) >= 4, calls
        assert calls[2] - calls[0] < leader.renew_period, "failed renewals waited a whole period each"
        assert leader.is_leader() and leader.epoch == 1 and len(renewals) == 1, "stepped down over two failures"
    finally:
        await leader.stop()


async def _reopened(client, prefix):
    store = EtcdStore(client, prefix, fence=unguarded)
    await store.reload()
    return store.load()


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.startswith("{")]


def test_sigstop_past_the_lease_then_sigcont_steps_down_and_writes_nothing(etcd1, prefix, tmp_path):
    endpoint = etcd1.members[0].endpoint
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    procs, logs = {}, {}
    for name in ("a", "b"):
        logs[name] = str(tmp_path / f"{name}.log")
        with open(logs[name], "w") as out:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.ha.elector", endpoint, prefix, name, str(TTL)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
            )
    try:

        def leader_name():
            for name, path in logs.items():
                roles = [line for line in _lines(path) if "role" in line]
                if roles and roles[-1]["role"] == "leader":
                    return name
            return None

        paused = wait_for(leader_name, timeout=20, what="a leader among the two processes")
        other = "b" if paused == "a" else "a"
        wait_for(
            lambda: any(line.get("write") == "ok" for line in _lines(logs[paused])), timeout=10, what="a first write"
        )
        procs[paused].send_signal(signal.SIGSTOP)
        wait_for(
            lambda: any(line.get("role") == "leader" for line in _lines(logs[other])),
            timeout=TTL * 3 + 5,
            what="the other process to lead while the leader is stopped",
        )
        wait_for(
            lambda: any(line.get("write") == "ok" for line in _lines(logs[other])),
            timeout=10,
            what="the new leader's write",
        )
        stopped_at = len(_lines(logs[paused]))
        procs[paused].send_signal(signal.SIGCONT)
        wait_for(
            lambda: any(line.get("role") in ("standby", "candidate") for line in _lines(logs[paused])[stopped_at:]),
            timeout=10,
            what="the resumed process to step down",
        )
        leader_revision, ticks = asyncio.run(_read_ticks(etcd1, prefix))
        assert ticks[paused] < leader_revision, "a write of the deposed leader landed after the new leader was elected"
        assert ticks[other] > leader_revision
        wait_for(
            lambda: _lines(logs[other])[-1].get("write") == "ok", timeout=10, what="the new leader to keep writing"
        )
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)


async def _read_ticks(cluster, prefix):
    """The leader key's create revision and each process's last tick's mod revision in etcd."""
    client = connect(EtcdTarget(((cluster.members[0].host, cluster.members[0].client_port),), prefix))
    try:
        leader = await client.get(f"{prefix}/election/leader".encode())
        ticks = {
            name: (await client.get(f"{prefix}/state/instances/tick-{name}".encode())).mod_revision
            for name in ("a", "b")
        }
        return leader.create_revision, ticks
    finally:
        await client.close()
