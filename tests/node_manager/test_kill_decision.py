"""The kill decision on fakes: the monitor judges each heartbeat, the manager alone kills.

Each heartbeat is answered by the test, on a fake clock: the threshold, the start-up grace, a
short pause and a hang are checked to the heartbeat, with no wall-clock time involved. The same
behaviours with real processes and signals are in test_engines.py.
"""

from __future__ import annotations

import pytest

from motor.processes import ExitStatus
from motor.v1 import engine_pb2, types_pb2
from node_manager.engine import Ending
from node_manager.health import Verdict
from tests.support.node_manager_fakes import ABNORMAL, INIT, NORMAL, TIMED_OUT, FakeNode, ended, settle, sim_spec

STARTING, RUNNING, FAILED = (
    types_pb2.ENGINE_STATE_STARTING,
    types_pb2.ENGINE_STATE_RUNNING,
    types_pb2.ENGINE_STATE_FAILED,
)


@pytest.fixture
async def make_fake_node(tmp_path):
    made: list[FakeNode] = []

    def make(**overrides) -> FakeNode:
        node = FakeNode(str(tmp_path / f"node{len(made)}"), **overrides)
        made.append(node)
        return node

    yield make
    for node in made:
        await node.manager.close()


async def running_engine(node: FakeNode):
    await node.manager.start()
    record = await node.manager.start_engine(sim_spec())
    await node.answer(NORMAL)
    assert record.state == RUNNING
    return record


def kills_of(node: FakeNode) -> int:
    return int(node.manager.metrics.kills.labels(node.config.node_id, "abnormal")._value.get())


async def test_a_hang_is_killed_at_the_threshold_and_not_before(make_fake_node):
    node = make_fake_node(abnormal_threshold=3)
    record = await running_engine(node)
    hang_began = node.clock.monotonic()
    for count in (1, 2):
        await node.answer(TIMED_OUT)
        assert record.state == RUNNING and record.consecutive_abnormal == count
        assert node.ops.kills == [] and record.health_reason == f"no answer: {TIMED_OUT}"
    await node.answer(TIMED_OUT)
    await ended(record)
    assert record.state == FAILED and record.exit_signal == 9
    reason = f"killed after 3 abnormal heartbeats: no answer: {TIMED_OUT} x3"
    assert record.state_reason == reason
    assert [tree.token for tree in node.ops.kills] == [record.token]  # the whole tree, once
    assert record.pid == 0 and node.ops.alive() == []
    # Routers first: "not serving" at the first missed status and again before the kill (still
    # RUNNING: no replacement yet), FAILED after.
    assert [r for _, r in node.reports] == [
        f"not serving: no answer: {TIMED_OUT}",
        f"{reason}; ending its process tree",
        reason,
    ]
    assert [e.state for e, _ in node.reports] == [RUNNING, RUNNING, FAILED]
    assert node.reports[1][0].health == types_pb2.HEALTH_STATUS_ABNORMAL
    assert kills_of(node) == 1
    # The documented bound: threshold x interval plus one interval, on the fake clock.
    assert node.clock.monotonic() - hang_began <= (3 + 1) * node.config.heartbeat_interval
    # Monitoring ended with the engine: both loops closed their clients.
    await settle(lambda: node.engine().clients_open == 0)


async def test_a_short_pause_is_tolerated_and_the_count_restarts_after_it(make_fake_node):
    node = make_fake_node(abnormal_threshold=3)
    record = await running_engine(node)
    for _ in range(2):  # a pause: two heartbeats missed, one short of the threshold
        for _ in range(2):
            await node.answer(TIMED_OUT)
        assert record.consecutive_abnormal == 2
        await node.answer(NORMAL)
        assert record.consecutive_abnormal == 0 and record.health == types_pb2.HEALTH_STATUS_NORMAL
    assert record.state == RUNNING and node.ops.kills == [] and kills_of(node) == 0
    # ABNORMAL answers count like silence; a mixed streak kills with both reasons.
    await node.answer(ABNORMAL)
    await node.answer(TIMED_OUT)
    await node.answer(ABNORMAL)
    await ended(record)
    assert record.state_reason == (
        f"killed after 3 abnormal heartbeats: ABNORMAL: probe failed; no answer: {TIMED_OUT}; ABNORMAL: probe failed"
    )


async def test_silence_and_init_are_allowed_during_the_startup_grace_then_count(make_fake_node):
    node = make_fake_node(abnormal_threshold=2, startup_grace=3.0)
    await node.manager.start()
    record = await node.manager.start_engine(sim_spec())
    # Not answering yet (loading, port not bound): more heartbeats than the threshold, not counted.
    for _ in range(4):
        await node.answer("GetStatus failed: UNAVAILABLE: connection refused")
    assert record.state == STARTING and record.consecutive_abnormal == 0
    assert record.health_reason.startswith("engine server not answering yet (starting)")
    await node.answer(INIT)  # answered, still loading: allowed while within the grace
    assert record.consecutive_abnormal == 0 and record.health == types_pb2.HEALTH_STATUS_INIT
    while node.clock.time() - record.started_at < 3.0:  # the pending call is judged at this age
        await node.answer(INIT)
        assert record.state == STARTING and record.consecutive_abnormal == 0
    await node.answer(INIT)  # past the grace: counts
    assert record.consecutive_abnormal == 1 and node.ops.kills == []
    await node.answer(INIT)
    await ended(record)
    assert record.state_reason.startswith("killed after 2 abnormal heartbeats: still INIT after the 3s start-up grace")


async def test_once_answered_silence_counts_even_within_the_grace(make_fake_node):
    node = make_fake_node(abnormal_threshold=2, startup_grace=60)
    await node.manager.start()
    record = await node.manager.start_engine(sim_spec())
    await node.answer(INIT)
    await node.answer(TIMED_OUT)
    assert record.consecutive_abnormal == 1
    await node.answer(TIMED_OUT)
    await ended(record)
    assert record.state == FAILED and record.state_reason.startswith("killed after 2 abnormal heartbeats")


async def test_the_probe_stream_marks_running_and_makes_an_older_failed_call_stale(make_fake_node):
    node = make_fake_node(abnormal_threshold=1)
    await node.manager.start()
    record = await node.manager.start_engine(sim_spec())
    engine = node.engine()
    await settle(lambda: engine.waiting)  # a GetStatus call is under way
    node.clock.advance(0.1)
    engine.stream.put_nowait(engine_pb2.WatchProbesResponse(status=NORMAL))
    await settle(lambda: record.state == RUNNING)
    assert record.state_reason == "engine server reported NORMAL" and record.ever_answered
    # The call began before the stream's answer: its failure is older news, not judged (a
    # threshold of 1 would kill otherwise).
    await node.answer("GetStatus failed: UNAVAILABLE: connection refused")
    assert record.state == RUNNING and record.consecutive_abnormal == 0 and node.ops.kills == []
    await node.answer(TIMED_OUT)  # a call that began after it counts
    await ended(record)
    assert record.state == FAILED


async def test_only_the_manager_kills_and_never_over_a_stop_or_a_known_exit(make_fake_node):
    node = make_fake_node(abnormal_threshold=3)
    record = await running_engine(node)
    verdict = Verdict(
        types_pb2.HEALTH_STATUS_UNSPECIFIED,
        "no answer",
        counted=True,
        kill=True,
        consecutive=3,
        kill_reason="killed after 3 abnormal heartbeats: no answer",
    )
    record.ending = Ending.STOP  # a stop is under way
    node.manager.on_verdict(record, verdict, changed=True)
    assert node.ops.kills == [] and record.state == RUNNING
    record.ending = Ending.NONE
    record.watch.status = ExitStatus(exit_code=1)  # the exit is known, its handling not begun yet
    node.manager.on_verdict(record, verdict, changed=True)
    assert node.ops.kills == [] and record.ending is Ending.NONE
    record.watch.status = None
    node.manager.on_verdict(record, verdict, changed=True)
    assert record.ending is Ending.KILL
    node.manager.on_verdict(record, verdict, changed=True)  # a second verdict does not kill twice
    await ended(record)
    assert len(node.ops.kills) == 1 and record.state_reason == verdict.kill_reason


async def test_a_kill_reaches_children_that_left_the_group_and_those_seen_before(make_fake_node):
    node = make_fake_node(abnormal_threshold=1)
    record = await running_engine(node)
    escaped = node.ops.spawn_child(record.pid, escape_group=True, keep_token=False)
    await node.answer(NORMAL)  # a heartbeat remembers the engine's descendants
    assert (escaped.pid, escaped.started) in record.remembered
    await node.answer(TIMED_OUT)
    await ended(record)
    assert node.ops.alive() == []


async def test_an_exit_is_reported_not_serving_at_once_and_failed_only_once_its_tree_is_gone(make_fake_node):
    # The controller removes the endpoint on the first report; it starts a replacement only on
    # FAILED, which must wait until nothing of the old copy (an engine core outliving its engine
    # server) can hold the engine's ports or accelerators.
    node = make_fake_node()
    record = await running_engine(node)
    core = node.ops.spawn_child(record.pid)
    node.ops.hold_find.clear()  # the search for leftovers is slow (a /proc scan on a busy host)
    node.ops.exit(record.pid, ExitStatus(signal=9))
    await settle(lambda: len(node.reports) == 1)
    notice, why = node.reports[0]
    assert why == "engine server killed by signal 9 (SIGKILL); ending its process tree"
    assert notice.state == RUNNING and notice.health == types_pb2.HEALTH_STATUS_ABNORMAL
    assert record.active and core.alive and record.allocated_ports
    # A start of the same engine meanwhile finds the old copy still active: nothing is launched.
    launched = len(node.ops.launched)
    assert await node.manager.start_engine(sim_spec()) is record and len(node.ops.launched) == launched
    node.ops.hold_find.set()
    await ended(record)
    assert not core.alive and record.state == FAILED and record.exit_signal == 9
    assert [e.state for e, _ in node.reports] == [RUNNING, FAILED]
    assert node.reports[1][1].startswith("killed by signal 9 (SIGKILL) without being asked to stop (while RUNNING)")


async def test_a_missed_or_abnormal_status_is_reported_at_once_and_so_is_the_recovery(make_fake_node):
    """Routers follow the controller's endpoints: a hang must reach it with the verdict, not a
    heartbeat later, and long before the kill at the threshold."""
    node = make_fake_node(abnormal_threshold=5)
    record = await running_engine(node)
    node.reports.clear()
    await node.answer(TIMED_OUT)
    await settle(lambda: len(node.reports) == 1)
    engine, reason = node.reports[0]
    assert engine.health == types_pb2.HEALTH_STATUS_UNSPECIFIED and engine.state == types_pb2.ENGINE_STATE_RUNNING
    assert TIMED_OUT in reason and "not serving" in reason
    await node.answer(TIMED_OUT)  # the same verdict again: nothing new to report
    await node.answer(ABNORMAL)
    await settle(lambda: len(node.reports) == 2)
    assert node.reports[1][0].health == types_pb2.HEALTH_STATUS_ABNORMAL
    await node.answer(NORMAL)
    await settle(lambda: len(node.reports) == 3)
    assert node.reports[2][0].health == types_pb2.HEALTH_STATUS_NORMAL and "serving again" in node.reports[2][1]
    assert record.state == RUNNING and node.ops.kills == []
