"""The heartbeat rate budget (controller/fleet/heartbeat_budget.py): the interval the controller
announces grows with the fleet so that the total rate stays within --max-heartbeats-per-second,
the grace grows with it, and node loss is judged by the grace the controller stated. On a
hand-driven clock; the same with real node managers is in test_heartbeat_budget_processes.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from controller.api.controllers import SingleController
from controller.api.servicer import ControllerServicer
from controller.fleet.heartbeat_budget import HeartbeatBudget
from motor.contract import pbtime
from motor.errors import ResourceExhausted
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, node_info


def budget(live: list[int], clock: ManualClock, rate: float = 100.0) -> HeartbeatBudget:
    return HeartbeatBudget(
        base_interval=1.0, base_grace=5.0, max_per_second=rate, live_nodes=lambda: live[0], clock=clock
    )


def test_the_interval_is_the_configured_one_until_the_fleet_would_exceed_the_budget():
    clock, live = ManualClock(), [50]
    b = budget(live, clock)
    assert (b.interval(), b.grace()) == (1.0, 5.0)
    live[0] = 100
    assert (b.interval(), b.grace()) == (1.0, 5.0)  # exactly at the budget
    live[0] = 101
    assert b.interval() == pytest.approx(1.1)  # rounded up to a tenth: never over the budget
    live[0] = 1000
    assert (b.interval(), b.grace()) == (10.0, 50.0)  # 1000 nodes / 10 s = 100 beats/s, grace scaled alike
    assert b.announced == 10.0 and b.held_grace() == 50.0


def test_budget_zero_means_a_fixed_interval():
    clock, live = ManualClock(), [100_000]
    b = budget(live, clock, rate=0)
    assert (b.interval(), b.grace()) == (1.0, 5.0)


def test_a_shorter_interval_is_announced_at_once_but_silence_is_judged_by_the_longer_one_for_two_of_its_intervals():
    clock, live = ManualClock(), [1000]
    b = budget(live, clock)
    assert b.interval() == 10.0
    live[0] = 300  # most of the fleet left: nodes hear 3 s only at their next answer, up to 10 s from now
    assert b.interval() == 3.0
    assert (b.liveness_interval(), b.grace()) == (10.0, 50.0)
    clock.advance(19.9)
    assert b.grace() == 50.0
    clock.advance(0.2)
    assert (b.liveness_interval(), b.grace()) == (3.0, 15.0)
    live[0] = 700  # a longer one counts at once
    assert (b.interval(), b.grace()) == (7.0, 35.0)


def test_an_interval_announced_while_a_longer_one_was_held_is_held_for_two_of_its_own_intervals():
    # The fleet shrinks in two waves: 10 s, then 5.5 s told to a node at t=16, then 1 s. The 10 s
    # hold ends at t=20; the node, told 5.5 s, beats again at t=21.5. Judged by 1 s (grace 5 s)
    # from t=20 on, it was suspected at t=21.1 for beating at the pace it was told.
    clock, live = ManualClock(), [1000]
    b = budget(live, clock)
    assert b.interval() == 10.0
    clock.advance(16)
    live[0] = 550
    assert b.interval() == 5.5  # told to a node now
    clock.advance(2)  # t=18
    live[0] = 100
    assert b.interval() == 1.0
    assert (b.liveness_interval(), b.grace()) == (10.0, 50.0)
    clock.advance(2.1)  # t=20.1: the 10 s hold is over, the 5.5 s one lasts until t=27
    assert (b.liveness_interval(), b.grace()) == (5.5, 27.5)
    assert b.held_grace() == 27.5
    clock.advance(7)  # t=27.1
    assert (b.liveness_interval(), b.grace()) == (1.0, 5.0)


@pytest.mark.parametrize("seed", range(20))
def test_a_node_beating_at_the_pace_it_was_told_is_never_silent_past_the_grace(seed):
    # A fleet that grows and shrinks tenfold at random while one node beats exactly at the
    # interval of its last answer (other nodes' answers announce too).
    rnd, clock, live = random.Random(seed), ManualClock(), [5000]
    b = HeartbeatBudget(
        base_interval=1.0, base_grace=1.5, max_per_second=2000.0, live_nodes=lambda: live[0], clock=clock
    )
    last_beat, next_beat = clock(), clock() + b.interval()
    for _ in range(20_000):  # 1,000 s in steps of 50 ms
        clock.advance(0.05)
        if rnd.random() < 0.01:
            live[0] = (
                max(1, int(live[0] * rnd.choice([0.1, 0.5, 2, 10]))) if rnd.random() < 0.5 else rnd.randint(1, 40_000)
            )
        if rnd.random() < 0.2:
            b.announcement()
        if clock() >= next_beat - 1e-9:
            last_beat, next_beat = clock(), clock() + b.interval()
        assert clock() - last_beat <= b.grace(), f"silent {clock() - last_beat:.2f}s, grace {b.grace():g}s"


async def test_the_announcement_is_in_every_registration_and_heartbeat_answer(tmp_path):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, heartbeat_interval=0.1, node_grace=0.6, max_heartbeats_per_second=10)
    servicer = ControllerServicer(SingleController(await h.start()))
    try:
        answers = []
        for node in ("node-a", "node-b", "node-c", "node-d"):
            reply = await servicer.RegisterNode(C.RegisterNodeRequest(node=node_info(node)), None)
            h.generations[node] = reply.generation
            answers.append((pbtime.seconds(reply.heartbeat_interval), pbtime.seconds(reply.node_grace)))
        # 1 node at 10/s fits 0.1 s; 2 nodes: 0.2 s ... the grace is 6 intervals, as 0.6 s is of 0.1 s.
        assert answers == [
            (0.1, pytest.approx(0.6)),
            (0.2, pytest.approx(1.2)),
            (0.3, pytest.approx(1.8)),
            (0.4, pytest.approx(2.4)),
        ]
        beat = await servicer.Heartbeat(
            C.HeartbeatRequest(node_id="node-a", generation=h.generations["node-a"], sequence=7), None
        )
        assert (beat.sequence, pbtime.seconds(beat.heartbeat_interval), pbtime.seconds(beat.node_grace)) == (
            7,
            0.4,
            pytest.approx(2.4),
        )
    finally:
        await h.stop()


async def test_a_silent_node_is_judged_by_the_announced_grace_then_lost_within_grace_two_intervals_and_the_recheck(
    tmp_path,
):
    clock = ManualClock()
    # 4 nodes at 10 beats/s: interval 0.4 s, grace 2.4 s (the configured 0.6 s would be 6 x 0.1 s).
    h = Harness(tmp_path, clock=clock, heartbeat_interval=0.1, node_grace=0.6, max_heartbeats_per_second=10)
    ctl = await h.start()
    try:
        for node in ("node-a", "node-b", "node-c", "node-d"):
            await h.register(node)
        assert (ctl.budget.interval(), ctl.budget.grace()) == (0.4, pytest.approx(2.4))
        h.client.unreachable.add("node-a")
        silent_since = clock.now
        for _ in range(5):  # the others beat at the announced interval; node-a is silent for 2.0 s
            clock.advance(0.4)
            h.beat("node-b", "node-c", "node-d")
            ctl.check_nodes()
            assert ctl.nodes["node-a"].state == C.NODE_STATE_READY, "judged by the configured grace, not the announced"
        clock.advance(0.6)
        h.beat("node-b", "node-c", "node-d")
        ctl.check_nodes()
        node = ctl.nodes["node-a"]
        assert node.state == C.NODE_STATE_SUSPECT and "grace 2.4s, heartbeat interval 0.4s" in node.reason
        await async_wait_for(lambda: node.recheck_failed_at is not None, timeout=5, what="node-a's re-check failed")
        lost_at = None
        while lost_at is None and clock.now - silent_since < 2.4 + 2 * 0.4 + h.config.recheck_timeout + 0.4:
            clock.advance(0.1)
            h.beat("node-b", "node-c", "node-d")
            ctl.check_nodes()
            if node.state == C.NODE_STATE_LOST:
                lost_at = clock.now - silent_since
        # Lost no sooner than two announced intervals after it turned SUSPECT, within grace + 2 intervals + re-check.
        assert lost_at is not None and lost_at >= 2.4 + 2 * 0.4 - 1e-6, lost_at
        assert all(ctl.nodes[n].state == C.NODE_STATE_READY for n in ("node-b", "node-c", "node-d"))
    finally:
        await h.stop()


async def test_a_node_already_silent_is_lost_within_the_bound_it_was_told_while_nodes_register(tmp_path):
    """Four nodes told interval 4 s, grace 20 s (1 beat/s for the fleet); node-b falls silent, and
    5 s later ten more nodes register: the fleet's interval grows to 14 s, but node-b is still
    judged by the 4 s / 20 s it was told, so it is lost within 20 + 2 x 4 + the re-check."""
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, heartbeat_interval=1, node_grace=5, max_heartbeats_per_second=1)
    servicer = ControllerServicer(SingleController(ctl := await h.start()))
    next_beat: dict[str, float] = {}

    async def register(node: str) -> None:
        reply = await servicer.RegisterNode(C.RegisterNodeRequest(node=node_info(node)), None)
        h.generations[node] = reply.generation
        next_beat[node] = clock.now + pbtime.seconds(reply.heartbeat_interval)

    async def beat_when_due() -> None:
        for node, due in list(next_beat.items()):
            if node != "node-b" and due <= clock.now:
                reply = await servicer.Heartbeat(C.HeartbeatRequest(node_id=node, generation=h.generations[node]), None)
                next_beat[node] = clock.now + pbtime.seconds(reply.heartbeat_interval)

    try:
        for node in ("node-a", "node-b", "node-c", "node-d"):
            await register(node)
        reply = await servicer.Heartbeat(C.HeartbeatRequest(node_id="node-b", generation=h.generations["node-b"]), None)
        assert (pbtime.seconds(reply.heartbeat_interval), pbtime.seconds(reply.node_grace)) == (
            4.0,
            pytest.approx(20.0),
        )
        h.client.unreachable.add("node-b")
        silent_since, lost_at = clock.now, None
        while lost_at is None and clock.now - silent_since < 120:
            clock.advance(0.5)
            if clock.now - silent_since == 5.0:
                for index in range(10):
                    await register(f"late-{index}")
            await beat_when_due()
            ctl.check_nodes()
            await asyncio.sleep(0.01)  # the direct re-check of a suspect node runs
            if ctl.nodes["node-b"].state == C.NODE_STATE_LOST:
                lost_at = clock.now - silent_since
        assert ctl.budget.interval() == 13.0  # the fleet's interval did grow (13 live nodes, node-b lost)
        assert lost_at is not None and lost_at <= 20 + 2 * 4 + 1, lost_at
        assert sum(n.state == C.NODE_STATE_READY for n in ctl.nodes.values()) == 13
    finally:
        await h.stop()


async def test_a_node_beating_far_faster_than_told_is_pushed_back_counted_and_named_once(tmp_path, caplog):
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, heartbeat_interval=1, node_grace=5, max_heartbeats_per_second=100)
    servicer = ControllerServicer(SingleController(ctl := await h.start()))
    try:
        for node in ("node-a", "node-b"):
            reply = await servicer.RegisterNode(C.RegisterNodeRequest(node=node_info(node)), None)
            h.generations[node] = reply.generation

        async def beat(node: str) -> C.HeartbeatResponse:
            return await servicer.Heartbeat(C.HeartbeatRequest(node_id=node, generation=h.generations[node]), None)

        refused = 0
        with caplog.at_level("WARNING", logger="controller.fleet.beat_pacing"):
            for _ in range(1000):  # a hostile node: 1000 beats in 1 s, told 1 s
                clock.advance(0.001)
                try:
                    await beat("node-a")
                except ResourceExhausted as exc:
                    refused += 1
                    assert "far faster than the 1s interval it was told" in str(exc) and "retry after" in str(exc)
        assert 990 <= refused <= 995  # the burst and 4 x the told rate went through
        assert (
            ctl.metrics.registry.get_sample_value("motor_controller_heartbeats_refused_total", {"node_id": "node-a"})
            == refused
        )
        assert len(caplog.records) == 1 and "node-a" in caplog.records[0].getMessage()
        # node-b keeps to its interval, with retries after lost answers now and then: never refused.
        for index in range(200):
            clock.advance(1.0)
            await beat("node-b")
            if index % 10 == 0:
                await beat("node-b")
        clock.advance(1.0)
        await beat("node-a")  # slowed down: read again
    finally:
        await h.stop()
