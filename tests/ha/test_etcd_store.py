"""The etcd store against real etcd members: the same contract as SQLite, batched guarded
writes, standbys following, a fenced store writing nothing, quorum lost and regained."""

from __future__ import annotations

import asyncio
import signal

import pytest

from controller.store.etcd import EtcdStore, Fenced
from controller.store.interface import StoreChange, StoredNode
from controller.store.sqlite import SqliteStore
from tests.support import async_wait_for
from tests.support.etcd_members import unguarded


def _fill(store) -> None:
    with store.transaction():
        store.save_deployment(b"\x0a\x03dep", 3)
        assert store.next_generation() == 1
        assert store.next_generation() == 2
        store.save_node(StoredNode("node-a", b"\x0a\x01a", 2, 1, "registered"))
        store.save_node(StoredNode("node-b", b"\x0a\x01b", 1, 2, "lost: silent"))
        store.save_assignment("e1", {"node_id": "node-a", "generation": 2})
        store.save_assignment("e2", {"node_id": "node-b", "generation": 1})
        store.save_instance("i1", {"restarts": 1, "window": [1.5]})
        store.save_rollout("dep", {"paused": True, "reason": "paused by an operator", "previous": None})
        store.save_rollout("gone", {"paused": False})
    store.save_rollout("gone", None)
    store.delete_assignment("e2")
    store.save_instance("i2", {"restarts": 0})
    store.delete_instance("i2")


def _check(state) -> None:
    assert state.deployment == b"\x0a\x03dep" and state.revision == 3
    assert state.generation == 2
    assert [(n.node_id, n.info, n.generation, n.state, n.reason) for n in state.nodes] == [
        ("node-a", b"\x0a\x01a", 2, 1, "registered"),
        ("node-b", b"\x0a\x01b", 1, 2, "lost: silent"),
    ]
    assert state.assignments == {"e1": {"node_id": "node-a", "generation": 2}}
    assert state.instances == {"i1": {"restarts": 1, "window": [1.5]}}
    assert state.rollouts == {"dep": {"paused": True, "reason": "paused by an operator", "previous": None}}


async def test_sqlite_and_etcd_keep_the_same_state(tmp_path, etcd1, clients, prefix):
    sqlite = SqliteStore(str(tmp_path / "c.db"))
    _fill(sqlite)
    await sqlite.flush()
    _check(SqliteStore(str(tmp_path / "c.db")).load())

    store = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await store.open()
    _fill(store)
    _check(store.load())  # the mirror answers at once
    await store.flush()
    fresh = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await fresh.open()
    _check(fresh.load())  # and etcd holds the same once flushed
    # A generation a node reports that this store never issued: the counter goes above it.
    assert fresh.last_generation() == 2 and fresh.next_generation(above=41) == 42 and fresh.last_generation() == 42
    assert fresh.next_generation(above=7) == 43
    store.close()
    fresh.close()


async def test_a_big_deployment_change_lands_the_same_in_sqlite_and_etcd_without_holding_the_loop(
    tmp_path, etcd1, clients, prefix
):
    """StoreChange (ApplyDeployment of thousands of instances): SQLite writes it in a thread,
    etcd stages it in slices; both hold the same rows after, the loop ran meanwhile."""
    first = StoreChange(
        b"\x0a\x03big",
        1,
        instances=[(f"u-{n}", {"n": n}) for n in range(3000)],
        assignments=[(f"u-{n}/rank{r}", {"r": r}) for n in range(3000) for r in range(4)],
    )
    second = StoreChange(
        b"\x0a\x04big2",
        2,
        deleted_instances=[f"u-{n}" for n in range(1000)],
        deleted_assignments=[f"u-{n}/rank{r}" for n in range(1000) for r in range(4)],
        instances=[("v-0", {"v": 0})],
    )
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    etcd = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await etcd.open()
    sqlite = SqliteStore(str(tmp_path / "c.db"))
    task = asyncio.create_task(ticker())
    for store in (sqlite, etcd):
        before = ticks
        await store.write_change_async(first)
        await store.write_change_async(second)
        await store.flush()
        assert ticks - before > 2, f"{type(store).__name__} held the loop for the whole write"
    task.cancel()
    fresh = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await fresh.open()
    for state in (SqliteStore(str(tmp_path / "c.db")).load(), fresh.load()):
        assert state.deployment == b"\x0a\x04big2" and state.revision == 2
        assert set(state.instances) == {f"u-{n}" for n in range(1000, 3000)} | {"v-0"}
        assert len(state.assignments) == 8000 and "u-0/rank0" not in state.assignments
    etcd.close()
    fresh.close()


async def test_a_transaction_is_one_etcd_write(etcd1, clients, prefix):
    client = clients(etcd1, prefix)
    store = EtcdStore(client, prefix, fence=unguarded)
    await store.open()
    before = (await client.get_prefix(b"/")).header.revision
    with store.transaction():
        for i in range(50):
            store.save_instance(f"i{i}", {"restarts": i})
    await store.flush()
    after = (await client.get_prefix(b"/")).header.revision
    assert after == before + 1, "the 50 writes of one transaction landed as one etcd revision"
    store.close()


async def test_a_standby_follows_the_leaders_writes(etcd1, clients, prefix):
    leader = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await leader.open()
    standby = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await standby.open()
    seen: list[str] = []
    standby.on_change(seen.append)
    follower = asyncio.create_task(standby.follow())
    try:
        _fill(leader)
        await leader.flush()
        await async_wait_for(
            lambda: standby.load().instances == {"i1": {"restarts": 1, "window": [1.5]}},
            timeout=10,
            what="the standby's mirror to catch up",
        )
        _check(standby.load())
        leader.delete_assignment("e1")
        await leader.flush()
        await async_wait_for(
            lambda: standby.load().assignments == {}, timeout=10, what="the deletion to reach the standby"
        )
        assert f"{standby.root}assignments/e1" in seen
    finally:
        follower.cancel()
        leader.close()
        standby.close()


async def test_a_fenced_store_writes_nothing(etcd1, clients, prefix):
    client = clients(etcd1, prefix)
    tx = client.transactions
    # The guard a deposed leader carries: a leader key at a create revision that is not there.
    store = EtcdStore(client, prefix, fence=lambda: [tx.create(f"{prefix}/election/leader".encode()) == 12345])
    await store.open()
    store.save_instance("i1", {"restarts": 1})
    with pytest.raises(Fenced):
        await store.flush()
    store.save_instance("i2", {"restarts": 2})
    with pytest.raises(Fenced):
        await store.flush()
    assert (await client.get_prefix(f"{prefix}/state/".encode())).count == 0
    store.close()


async def test_one_member_of_three_lost_changes_nothing(etcd3, clients, prefix):
    store = EtcdStore(clients(etcd3, prefix, timeout=1.0), prefix, fence=unguarded)
    await store.open()
    store.save_instance("before", {"n": 1})
    await store.flush()
    for index in range(3):  # whichever member the channel uses, one of them goes away
        etcd3.kill_member(index)
        store.save_instance(f"while-{index}-down", {"n": index})
        await asyncio.wait_for(store.flush(), 20)
        etcd3.start_member(index)
        etcd3.wait_healthy()
    fresh = EtcdStore(clients(etcd3, prefix), prefix, fence=unguarded)
    await fresh.open()
    assert set(fresh.load().instances) == {"before", "while-0-down", "while-1-down", "while-2-down"}
    store.close()
    fresh.close()


async def test_quorum_lost_holds_writes_until_it_returns(etcd3, clients, prefix):
    store = EtcdStore(clients(etcd3, prefix, timeout=1.0), prefix, fence=unguarded)
    await store.open()
    store.save_instance("before", {"n": 1})
    await store.flush()
    etcd3.signal_member(1, signal.SIGSTOP)
    etcd3.signal_member(2, signal.SIGSTOP)
    store.save_instance("during", {"n": 2})
    flushed = asyncio.create_task(store.flush())
    await asyncio.sleep(3)  # several request deadlines: the write cannot commit without quorum
    assert not flushed.done(), "a write committed without a quorum"
    etcd3.signal_member(1, signal.SIGCONT)
    etcd3.signal_member(2, signal.SIGCONT)
    await asyncio.wait_for(flushed, 30)
    fresh = EtcdStore(clients(etcd3, prefix), prefix, fence=unguarded)
    await fresh.open()
    assert set(fresh.load().instances) == {"before", "during"}
    store.close()
    fresh.close()


async def test_the_deployment_of_a_store_of_before_names_is_moved_under_its_name(tmp_path, etcd1, clients, prefix):
    """etcd written by a controller of before names (state/deployment, no state/applied): a new
    controller loads the deployment under its own name with its instances (nothing to restart:
    same ids) and, leading, moves it to state/deployments/<name>."""
    from controller.config import ControllerConfig
    from controller.core import Controller
    from controller.store.interface import LEGACY_DEPLOYMENT
    from motor.v1 import controller_pb2 as C
    from tests.support.controller_fakes import FakeNodeClient
    from tests.support.controller_harness import small_deployment

    config = ControllerConfig(db=str(tmp_path / "unused.db"), startup_grace=0)
    store = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await store.open()
    ctl = Controller(config, store, FakeNodeClient())
    await ctl.start()
    ctl.apply_deployment(small_deployment([{"name": "chat", "role": "union", "count": 2}], name="chat"))
    data, revision = store.load().deployments["chat"]
    await ctl.stop()
    with store.transaction():  # as the older controller left it
        store.save_deployment(None, 0, "chat")
        store._stage("applied", None)
        store.save_deployment(data, revision)
    await store.flush()
    store.close()

    older = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await older.open()
    assert set(older.load().deployments) == {LEGACY_DEPLOYMENT} and older.load().ever_applied
    ctl = Controller(config, older, FakeNodeClient())
    await ctl.start()
    assert ctl.get_deployment("chat") == (C.Deployment.FromString(data), revision)
    assert set(ctl.instances) == {"chat-0", "chat-1"} and not ctl.adoption.waiting
    await older.flush()
    await ctl.stop()
    older.close()
    moved = EtcdStore(clients(etcd1, prefix), prefix, fence=unguarded)
    await moved.open()
    assert moved.load().deployments == {"chat": (data, revision)}
    moved.close()
