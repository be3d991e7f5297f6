"""The registration rule for node ids (controller/fleet/claims.py): the rule alone, then through the
controller on a fake node-manager client and a clock moved by hand."""

from __future__ import annotations

import pytest

from controller.fleet import claims
from controller.fleet.claims import Claim, judge
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from motor.errors import FailedPrecondition
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, node_info, small_deployment

GRACE = 0.6


def proc(nonce: str, boot: str = "boot-1", state_dir: str = "dir-1", pid: int = 100) -> T.NodeManagerProcess:
    return T.NodeManagerProcess(boot_id=boot, state_dir_id=state_dir, nonce=nonce, pid=pid, hostname="h")


def holder(process: T.NodeManagerProcess, state=NODE_READY, last_seen=100.0, recheck_failed=None) -> NodeRuntime:
    info = C.NodeInfo(node_id="node-a", address="127.0.0.1:1", process=process)
    node = NodeRuntime(info, 1, state, "", last_seen=last_seen)
    node.recheck_failed_at = recheck_failed
    return node


@pytest.mark.parametrize(
    "case, node, newcomer, now, alarm, expected",
    [
        ("nobody holds it", None, proc("n2"), 100.0, False, Claim.NEW),
        ("the holder registers again", holder(proc("n1")), proc("n1"), 100.0, False, Claim.SAME),
        ("the holder restarted (same boot and state dir)", holder(proc("n1")), proc("n2"), 100.0, False, Claim.RESTART),
        ("an older node manager holds it", holder(T.NodeManagerProcess()), proc("n2"), 100.0, False, Claim.UNCHECKED),
        ("an older node manager asks", holder(proc("n1")), T.NodeManagerProcess(), 100.0, False, Claim.UNCHECKED),
        (
            "heartbeating holder, other state dir",
            holder(proc("n1")),
            proc("n2", state_dir="dir-2"),
            100.5,
            False,
            Claim.REFUSE,
        ),
        (
            "heartbeating holder, same state dir after a reboot",
            holder(proc("n1")),
            proc("n2", boot="boot-2"),
            100.5,
            False,
            Claim.REFUSE,
        ),
        (
            "holder silent past the grace, not re-checked yet",
            holder(proc("n1")),
            proc("n2", state_dir="dir-2"),
            101.0,
            False,
            Claim.RECHECK,
        ),
        (
            "suspect holder whose re-check failed",
            holder(proc("n1"), NODE_SUSPECT, recheck_failed=101.0),
            proc("n2", state_dir="dir-2"),
            101.2,
            False,
            Claim.TAKEOVER,
        ),
        (
            "the same from another host while the silent-nodes alarm is on",
            holder(proc("n1"), NODE_SUSPECT, recheck_failed=101.0),
            proc("n2", boot="boot-2"),
            101.2,
            True,
            Claim.REFUSE,
        ),
        (
            "the same from the holder's host while the alarm is on",
            holder(proc("n1"), NODE_SUSPECT, recheck_failed=101.0),
            proc("n2", state_dir="dir-2"),
            101.2,
            True,
            Claim.TAKEOVER,
        ),
        (
            "holder declared lost",
            holder(proc("n1"), NODE_LOST),
            proc("n2", state_dir="dir-2"),
            100.1,
            False,
            Claim.AFTER_LOST,
        ),
    ],
)
def test_rule(case, node, newcomer, now, alarm, expected):
    assert judge(node, newcomer, now, GRACE, alarm) is expected, case


def info(node_id: str, process: T.NodeManagerProcess, port: int) -> C.NodeInfo:
    value = node_info(node_id)
    value.address = f"127.0.0.1:{port}"
    value.process.CopyFrom(process)
    return value


async def started(tmp_path) -> tuple[Harness, ManualClock]:
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock)
    await h.start()
    return h, clock


def refused_count(h: Harness) -> float:
    return (
        h.controller.metrics.registry.get_sample_value(
            "motor_controller_registrations_refused_total", {"reason": "node_id_held"}
        )
        or 0.0
    )


async def test_a_second_live_process_is_refused_naming_both_once_per_conflict(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl = h.controller
        first = await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        for _ in range(5):
            clock.advance(0.2)
            ctl.heartbeat("node-a", first.generation, [])
            with pytest.raises(FailedPrecondition) as refused:
                await ctl.register_node(info("node-a", proc("n2", state_dir="dir-2", pid=200), 5002), [])
        message = str(refused.value)
        assert "127.0.0.1:5001" in message and "127.0.0.1:5002" in message
        assert "pid 100" in message and "pid 200" in message and "holding it since 20" in message
        assert ctl.nodes["node-a"].generation == first.generation  # the holder keeps its generation
        ctl.heartbeat("node-a", first.generation, [])
        conflicts = [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_CONFLICT]
        assert len(conflicts) == 1 and "127.0.0.1:5002" in conflicts[0].message
        assert refused_count(h) == 5
        _, alarms = ctl.list_nodes()
        assert any("5 registration(s) from 127.0.0.1:5002" in a for a in alarms)
        # The refused process stops asking: the conflict ends with one event carrying its count.
        clock.advance(claims.CONFLICT_QUIET_S + 1)
        ctl.heartbeat("node-a", first.generation, [])
        ctl.check_nodes()
        ends = [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_CONFLICT][1:]
        assert len(ends) == 1 and "after 5 refused registration(s)" in ends[0].message
        assert not ctl.list_nodes()[1]
    finally:
        await h.stop()


async def test_a_restart_of_the_holder_is_admitted_at_once(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl = h.controller
        first = await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        again = await ctl.register_node(info("node-a", proc("n2", pid=101), 5003), [])
        assert again.generation > first.generation and not again.HasField("replaced")
        assert refused_count(h) == 0
    finally:
        await h.stop()


async def test_a_silent_holder_that_fails_the_recheck_is_taken_over_and_fenced(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl, client = h.controller, h.client
        old = await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        with pytest.raises(FailedPrecondition):
            await ctl.register_node(info("node-a", proc("n2", state_dir="dir-2"), 5002), [])
        client.unreachable.add("node-a")
        clock.advance(GRACE + 0.1)
        new = await ctl.register_node(info("node-a", proc("n2", state_dir="dir-2"), 5002), [])
        assert ("list", "node-a") in client.calls  # re-checked directly before the takeover
        assert new.generation > old.generation and new.replaced.nonce == "n1"
        assert ctl.nodes["node-a"].info.address == "127.0.0.1:5002"
        with pytest.raises(FailedPrecondition, match="stale"):  # the old holder's heartbeats are refused
            ctl.heartbeat("node-a", old.generation, [])
        # The old holder registers again: the newcomer holds the id now and is alive.
        with pytest.raises(FailedPrecondition, match="127.0.0.1:5002"):
            await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        messages = [e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_CONFLICT]
        assert any("took the node id over after 1 refused registration(s)" in m for m in messages)
    finally:
        await h.stop()


async def test_a_silent_holder_that_answers_the_recheck_keeps_the_node_id(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl, client = h.controller, h.client
        first = await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        client.processes["node-a"] = proc("n1")
        clock.advance(GRACE + 0.1)
        with pytest.raises(FailedPrecondition, match="held by another live node manager"):
            await ctl.register_node(info("node-a", proc("n2", state_dir="dir-2"), 5002), [])
        assert ("list", "node-a") in client.calls
        assert ctl.nodes["node-a"].state == NODE_READY and ctl.nodes["node-a"].generation == first.generation
    finally:
        await h.stop()


async def test_a_recheck_answered_by_another_process_is_not_the_holder(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl, client = h.controller, h.client
        await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        client.processes["node-a"] = proc("n3", state_dir="dir-3")  # someone else listens at the holder's address
        clock.advance(GRACE + 0.1)
        reply = await ctl.register_node(info("node-a", proc("n2", state_dir="dir-2"), 5002), [])
        assert ("list", "node-a") in client.calls and reply.replaced.nonce == "n1"
    finally:
        await h.stop()


async def test_a_takeover_on_the_same_host_starts_the_engines_there_with_new_generations(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl, client = h.controller, h.client
        await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        ctl.apply_deployment(small_deployment([{"name": "u", "role": "union", "data_parallel_size": 2}]))
        await async_wait_for(lambda: len(client.starts()) == 2, timeout=5, what="2 StartEngine calls")
        before = {e: s.generation for e, s in ctl.slots.items()}
        client.unreachable.add("node-a")
        clock.advance(GRACE + 0.1)
        reply = await ctl.register_node(info("node-a", proc("n2", state_dir="dir-2"), 5002), [])
        assert reply.replaced.nonce == "n1"
        assert all(a.generation > before[a.engine_id] for a in reply.assignments)  # the old copies are stale
        client.unreachable.discard("node-a")
        await async_wait_for(lambda: len(client.starts()) == 4, timeout=5, what="the engines started again")
        for spec in client.starts()[2:]:
            engine = f"{spec.instance_id}/rank{spec.dp_rank}"
            assert spec.generation > before[engine] and ctl.slots[engine].node_id == "node-a"
        assert not [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_LOST]
    finally:
        await h.stop()


async def test_a_takeover_from_another_host_moves_the_engines(tmp_path):
    h, clock = await started(tmp_path)
    try:
        ctl, client = h.controller, h.client
        await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        ctl.apply_deployment(small_deployment([{"name": "u", "role": "union"}]))
        await async_wait_for(lambda: len(client.starts()) == 1, timeout=5, what="StartEngine")
        client.unreachable.add("node-a")
        clock.advance(GRACE + 0.1)
        other = info("node-a", proc("n2", state_dir="dir-2"), 5002)
        other.host = "10.9.9.9"
        reply = await ctl.register_node(other, [])
        assert reply.replaced.nonce == "n1"
        lost = [e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_LOST]
        assert lost and "another host or other accelerators" in lost[0]
    finally:
        await h.stop()


async def test_a_silent_node_whose_host_has_a_process_asking_for_it_waits_for_that_takeover(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, heartbeat_interval=0.4)
    await h.start()
    try:
        ctl, client = h.controller, h.client
        await ctl.register_node(info("node-a", proc("n1"), 5001), [])
        await h.register("node-b")  # heartbeating: one silent node of two raises no alarm
        client.unreachable.add("node-a")
        newcomer = info("node-a", proc("n2", state_dir="dir-2"), 5002)
        for _ in range(5):  # asks every 0.1 s while the holder is within its grace: refused
            clock.advance(0.1)
            h.beat("node-b")
            with pytest.raises(FailedPrecondition):
                await ctl.register_node(newcomer, [])
        clock.advance(0.2)
        h.beat("node-b")
        ctl.check_nodes()  # SUSPECT, re-checked
        await async_wait_for(
            lambda: ctl.nodes["node-a"].recheck_failed_at is not None, timeout=5, what="re-check failed"
        )
        clock.advance(0.9)  # past the two intervals after which a silent, unanswering node is lost
        h.beat("node-b")
        ctl.check_nodes()
        assert ctl.nodes["node-a"].state == NODE_SUSPECT and "takes the node over" in ctl.nodes["node-a"].reason
        reply = await ctl.register_node(newcomer, [])
        assert reply.replaced.nonce == "n1" and ctl.nodes["node-a"].state == NODE_READY
        assert not [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_NODE_LOST]
    finally:
        await h.stop()
