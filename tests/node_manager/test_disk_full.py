"""The node manager's disk full, replayed by a write-failure injection at
the record store boundary: every engine record write raises OSError(ENOSPC), as a full disk
does, through the store's one write path (`RecordStore.write`). (A real full tmpfs needs root
to mount; the chaos suite uses one where it can.)

Rules: StartEngine asks the disk first (UNAVAILABLE naming the cause and the fix, nothing
started); an exit is recorded in memory and reported whatever the disk says; StopEngine never
hangs on a refused write; refused records are written again with backoff once the disk takes
them; one log line per spell, and every refused write counted."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal

import grpc
import pytest

from motor.errors import Unavailable
from motor.processes import ExitStatus
from motor.v1 import node_manager_pb2, types_pb2
from node_manager.record_saver import RecordSaver
from tests.support import async_wait_for
from tests.support.node_manager_fakes import NORMAL, FakeNode, ended, settle, sim_spec
from tests.support.node_manager_harness import alive

RUNNING, FAILED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_FAILED
ENGINE = "prefill-0/rank0"


def fill_disk(store) -> list[str]:
    """Every record write fails as on a full disk; returns the paths it refused."""
    refused: list[str] = []

    def full(path: str, text: str) -> None:
        refused.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    store.real_write = store.write
    store.write = full
    return refused


def free_disk(store) -> None:
    store.write = store.real_write


def stored_state(store, engine_id: str = ENGINE) -> str:
    instance, rank = engine_id.split("/rank")
    with open(os.path.join(store.root, f"{instance}_rank{rank}", "record.json"), encoding="utf-8") as handle:
        return json.load(handle)["state"]


def refused_writes(manager) -> float:
    return manager.metrics.registry.get_sample_value(
        "motor_node_manager_store_write_failures_total", {"node": manager.node_id}
    )


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(RecordSaver, "RETRY_MIN_S", 0.05)
    monkeypatch.setattr(RecordSaver, "RETRY_MAX_S", 0.2)


@pytest.mark.processes
async def test_a_kill_on_a_full_disk_is_recorded_reported_and_stop_returns(make_node, fake_controller):
    # Real node manager, real sim engines, real SIGKILL.
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    engine = await node.start()
    await node.wait_state(ENGINE, RUNNING)
    store = node.manager.store
    fill_disk(store)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.start(instance_id="prefill-1")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert "No space left on device" in refused.value.details() and "free space" in refused.value.details()
    assert "prefill-1/rank0" not in node.manager.records and len(node.manager.active_engines()) == 1
    # Every heartbeat says why while the disk refuses (the controller raises an ALARM event from it).
    await async_wait_for(
        lambda: "No space left on device" in fake_controller.streamed[-1].store_failing,
        timeout=10,
        what="a heartbeat naming the full disk",
    )

    os.kill(engine.pid, signal.SIGKILL)
    failed = await node.wait_state(ENGINE, FAILED, timeout=10)
    assert failed.exit_signal == signal.SIGKILL
    report = await async_wait_for(lambda: [r for r in fake_controller.reports if r.engine.state == FAILED], timeout=10)
    assert report[0].engine.engine_id == ENGINE and "SIGKILL" in report[0].reason
    # The deadline only catches a hang (it hung until the client's deadline before).
    reply = await node.stub.StopEngine(node_manager_pb2.StopEngineRequest(engine_id=ENGINE), timeout=15)
    assert reply.engine.state == FAILED and not alive(engine.pid)
    assert stored_state(store) == "RUNNING" and refused_writes(node.manager) >= 2

    free_disk(store)
    await async_wait_for(lambda: stored_state(store) == "FAILED", timeout=10, what="the FAILED record written")
    await async_wait_for(
        lambda: fake_controller.streamed[-1].store_failing == "",
        timeout=10,
        what="a heartbeat saying the records are written again",
    )
    started = await node.start(instance_id="prefill-1")
    assert started.engine_id == "prefill-1/rank0"


async def test_start_on_a_full_disk_launches_nothing(tmp_path):
    node = FakeNode(str(tmp_path))
    await node.manager.start()
    fill_disk(node.manager.store)
    with pytest.raises(Unavailable, match=r"cannot be written in .*No space left on device.*nothing was started"):
        await node.manager.start_engine(sim_spec())
    assert node.ops.launched == [] and node.manager.records == {} and refused_writes(node.manager) == 1
    assert "No space left on device" in node.manager.saver.failing
    free_disk(node.manager.store)
    await async_wait_for(
        lambda: node.manager.saver.failing == "", timeout=10, what="the refused write check passing again"
    )
    record = await node.manager.start_engine(sim_spec())
    assert record.state == types_pb2.ENGINE_STATE_STARTING and node.ops.launched
    await node.manager.close()


async def test_exits_while_the_disk_refuses_are_kept_reported_logged_once_and_saved_later(tmp_path, caplog):
    node = FakeNode(str(tmp_path))
    manager = node.manager
    await manager.start()
    records = [await manager.start_engine(sim_spec(instance_id=f"prefill-{i}")) for i in range(2)]
    for record in records:
        await node.answer(NORMAL, record.engine_id)
    refused = fill_disk(manager.store)
    caplog.set_level(logging.INFO, logger="node_manager.record_saver")
    for record in records:
        node.ops.exit(record.pid, ExitStatus(exit_code=3))
        await ended(record)
    assert [r.state for r in records] == [FAILED, FAILED]
    failures = lambda: [engine.engine_id for engine, _ in node.reports if engine.state == FAILED]  # noqa: E731
    await settle(lambda: len(failures()) == 2)
    assert sorted(failures()) == [r.engine_id for r in records]
    stopped = await asyncio.wait_for(manager.stop_engine(records[0].engine_id), 10)  # returns, no hang
    assert stopped.state == FAILED
    await async_wait_for(lambda: len(refused) >= 4, timeout=10, what="writes tried again")
    assert set(manager.saver.unsaved) == {r.engine_id for r in records}
    assert refused_writes(manager) == len(refused)
    failing = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(failing) == 1, [r.getMessage() for r in caplog.records]

    free_disk(manager.store)
    await async_wait_for(lambda: not manager.saver.unsaved, timeout=10, what="the unsaved records written")
    assert [stored_state(manager.store, r.engine_id) for r in records] == ["FAILED", "FAILED"]
    assert any("written again" in r.getMessage() for r in caplog.records)
    await manager.close()


async def test_a_spell_shorter_than_a_heartbeat_still_reaches_the_next_one(tmp_path):
    """A refusal whose retry succeeded before the next beat (space freed meanwhile: a removed
    record, a log rotated) is still told once: the operator learns the disk filled up."""
    node = FakeNode(str(tmp_path))
    await node.manager.start()
    fill_disk(node.manager.store)
    with pytest.raises(Unavailable):
        await node.manager.start_engine(sim_spec())
    free_disk(node.manager.store)
    await async_wait_for(
        lambda: node.manager.saver.failing == "", timeout=10, what="the refused write check passing again"
    )
    told = node.manager.saver.for_heartbeat()
    assert "No space left on device" in told and "(written again since)" in told
    assert node.manager.saver.for_heartbeat() == ""  # told once; the next beat ends the spell
    await node.manager.close()
