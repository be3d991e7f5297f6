"""Adoption after a node-manager restart, and engines started again, on fakes (see fakes.py).

The real `motor-node-manager` SIGKILLed and restarted under real engines is in test_restart.py.
"""

from __future__ import annotations

import pytest

from motor.errors import AlreadyExists, FailedPrecondition
from motor.processes import ExitStatus
from motor.v1 import types_pb2
from tests.support.node_manager_fakes import NORMAL, FakeNode, FakeProcess, ended, settle, sim_spec

STARTING, RUNNING, STOPPING = (
    types_pb2.ENGINE_STATE_STARTING,
    types_pb2.ENGINE_STATE_RUNNING,
    types_pb2.ENGINE_STATE_STOPPING,
)
STOPPED, FAILED = types_pb2.ENGINE_STATE_STOPPED, types_pb2.ENGINE_STATE_FAILED
ENGINE = "prefill-0/rank0"


@pytest.fixture
async def fake_node(tmp_path):
    node = FakeNode(str(tmp_path / "node"))
    await node.manager.start()
    yield node
    await node.manager.close()


async def restart(node: FakeNode):
    """The node manager ends (its engines keep running) and a new one starts on the same state."""
    await node.manager.close()
    node.manager = node.new_manager()
    await node.manager.start()
    return node.manager.records.get(ENGINE)


async def test_a_live_engine_is_readopted_not_relaunched_and_still_supervised(fake_node):
    node = fake_node
    record = await node.manager.start_engine(sim_spec())
    await node.answer(NORMAL)
    pid, calls = record.pid, node.engine().calls
    adopted = await restart(node)
    assert adopted is not record and adopted.state == RUNNING and adopted.pid == pid
    assert len(node.ops.launched) == 1  # nothing launched again
    assert not node.ops.watches[pid].child  # no longer our child: exit code unknown
    assert node.ops.watches[pid].on_exit is not None and adopted.watch is node.ops.watches[pid]
    await settle(lambda: node.engine().calls > calls)  # status polling resumed
    node.ops.exit(pid, ExitStatus(signal=9))
    await ended(adopted)
    assert adopted.state == FAILED and adopted.exit_signal is None
    assert adopted.state_reason.startswith("exited (exit code unknown")
    assert "without being asked to stop (while RUNNING)" in adopted.state_reason
    assert node.reports[-1][1] == adopted.state_reason


async def test_an_engine_that_died_while_away_fails_and_its_leftovers_are_killed(fake_node):
    node = fake_node
    record = await node.manager.start_engine(sim_spec())
    await node.answer(NORMAL)
    escaped = node.ops.spawn_child(record.pid, escape_group=True)  # carries the token
    await node.manager.close()
    node.ops.procs[record.pid].alive = False  # dies while no node manager runs
    node.ops.spawn_child(escaped.pid)  # its leftovers live on
    found = await restart(node)
    await ended(found)
    assert found.state == FAILED
    assert found.state_reason == "exited while the node manager was not running (exit code unknown)"
    # Found by the token only: the dead engine's pid and group id may belong to others by now.
    assert [(t.pid, t.pgid, t.token) for t in node.ops.kills] == [(0, 0, record.token)]
    assert node.ops.alive() == [] and len(node.ops.launched) == 1
    assert node.manager.metrics.kills.labels("node-f", "orphans")._value.get() == 1


async def test_a_reused_pid_is_not_adopted(fake_node):
    node = fake_node
    record = await node.manager.start_engine(sim_spec())
    await node.manager.close()
    # The engine died and its pid now belongs to another process (started later, no token).
    node.ops.procs[record.pid] = FakeProcess(record.pid, record.process_started + 100, token="", pgid=record.pid)
    node.ops.watches.clear()
    found = await restart(node)
    await ended(found)
    assert found.state == FAILED and "while the node manager was not running" in found.state_reason
    assert record.pid not in node.ops.watches  # not watched as if it were the engine
    assert node.ops.alive() == [record.pid]  # and left alone


async def test_a_stop_under_way_at_a_restart_is_finished(fake_node):
    node = fake_node
    record = await node.manager.start_engine(sim_spec())
    await node.answer(NORMAL)
    node.ops.hold_terminate.clear()  # the stop does not finish before the node manager ends
    node.manager._begin_stop(record, 5.0, "stop requested")
    await settle(lambda: node.ops.terminated)
    assert record.state == STOPPING
    node.ops.hold_terminate.set()
    adopted = await restart(node)
    await ended(adopted)
    assert adopted.state == STOPPED
    assert adopted.state_reason.startswith("stop requested before a node-manager restart: exited (exit code unknown")
    assert len(node.ops.terminated) == 2 and node.ops.alive() == []


async def test_a_failed_engine_starts_again_as_a_new_process_and_counts_a_restart(fake_node):
    node = fake_node
    first = await node.manager.start_engine(sim_spec(generation=1))
    again = await node.manager.start_engine(sim_spec(generation=1))  # repeated: the same engine
    assert again is first and len(node.ops.launched) == 1
    with pytest.raises(AlreadyExists, match="stop it first"):
        await node.manager.start_engine(sim_spec(generation=1, accelerator_ids=[1]))
    node.ops.exit(first.pid, ExitStatus(exit_code=1))
    await ended(first)
    assert first.state == FAILED
    assert first.state_reason.startswith("exited with code 1 without being asked to stop (while STARTING)")
    assert node.reports[-1][0].exit_code == 1
    ports = sorted(node.manager.ports.reserved)
    assert ports == []  # released with the failure

    restarts = {"node": "node-f", "instance_id": "prefill-0", "engine_id": ENGINE}
    # There from the first launch, at 0, so that increase() sees the first restart.
    assert node.manager.metrics.registry.get_sample_value("motor_node_manager_engine_restarts_total", restarts) == 0
    second = await node.manager.start_engine(sim_spec(generation=1))
    assert second is not first and second.pid != first.pid and second.state == STARTING
    assert len(node.ops.launched) == 2
    assert node.manager.metrics.registry.get_sample_value("motor_node_manager_engine_restarts_total", restarts) == 1
    await node.manager.stop_engine(ENGINE)
    assert second.state == STOPPED and "after SIGTERM" in second.state_reason
    with pytest.raises(FailedPrecondition, match="generation 0 is older than generation 1"):
        await node.manager.start_engine(sim_spec(generation=0))


async def test_an_exit_during_a_stop_is_not_a_failure(fake_node):
    node = fake_node
    await node.manager.start_engine(sim_spec())
    await node.answer(NORMAL)
    stopped = await node.manager.stop_engine(ENGINE, deadline=1.0)
    assert stopped.state == STOPPED and stopped.exit_code == 0 and node.reports == []


def engine_health(node: FakeNode) -> dict[tuple[str, str], str]:
    """(instance_id, engine_id) -> the health whose sample is 1 in the node manager's /metrics."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    current = {}
    for family in text_string_to_metric_families(generate_latest(node.manager.metrics.registry).decode()):
        for s in family.samples:
            if s.name == "motor_node_manager_engine_health" and s.value == 1:
                key = (s.labels["instance_id"], s.labels["engine_id"])
                assert key not in current, f"two healths at once for {key}"
                assert s.labels["node"] == node.manager.node_id
                current[key] = s.labels["health"]
    return current


async def test_the_node_manager_exports_each_running_engines_health_and_nothing_once_it_ended(fake_node):
    node = fake_node
    record = await node.manager.start_engine(sim_spec())
    await node.answer(NORMAL)
    await settle(lambda: record.health == types_pb2.HEALTH_STATUS_NORMAL)
    assert engine_health(node) == {("prefill-0", ENGINE): "normal"}
    node.ops.exit(record.pid, ExitStatus(exit_code=1))
    await ended(record)
    assert engine_health(node) == {}
