"""The controller link on a fake clock and a scripted controller: heartbeat spacing, backoff with
jitter while the controller fails, registering again when refused, retries of failure reports.

The same link against a real gRPC fake controller (and a controller outage) is in
test_controller_link.py.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from motor.v1 import controller_pb2, types_pb2
from node_manager.controller_link import ControllerLink
from tests.support.node_manager_fakes import (
    INTERVAL,
    MAX_BACKOFF,
    FakeNode,
    ScriptedChannel,
    ScriptedController,
    link,  # noqa: F401 (fixture)
    settle,
)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 9) for a, b in zip(times, times[1:])]


async def test_heartbeats_back_off_with_jitter_while_the_controller_fails_then_resume(link):
    random.seed(1234)  # tenacity's jitter draws from `random`: the run is repeatable
    controller: ScriptedController = link.stub
    failures = 12
    link.start()
    await settle(lambda: len(controller.times("Heartbeat")) >= 3)
    controller.errors["Heartbeat"] = [UNAVAILABLE] * failures
    await settle(lambda: len(controller.times("Heartbeat")) >= 3 + failures + 4)
    beats = controller.times("Heartbeat")
    assert gaps(beats[:3]) == [INTERVAL, INTERVAL]  # every interval while all is well
    # beats[2] was the last good one; beats[3..3+failures-1] failed; after failure k the next
    # attempt waits a random time below an exponentially growing bound, capped.
    waits = gaps(beats[3 : 3 + failures + 1])
    bounds = [min(MAX_BACKOFF, INTERVAL / 2 * 2**k) for k in range(failures)]
    assert all(0 <= wait <= bound for wait, bound in zip(waits, bounds)), list(zip(waits, bounds))
    assert waits[0] < INTERVAL  # a blip is retried sooner than the next heartbeat would be
    assert max(waits[4:]) > 2 * INTERVAL  # a long outage is not hammered at the heartbeat rate
    assert len(set(waits[4:])) == len(waits[4:])  # jitter: nodes do not retry in step
    # Back: on its grid again (phase 0: whole seconds), the first within an interval of the
    # retry that got through, with no new registration (the node's generation still holds).
    resumed = beats[3 + failures :]
    assert 0 < resumed[1] - resumed[0] <= INTERVAL and gaps(resumed[1:]) == [INTERVAL] * 2
    assert all(at == round(at) for at in resumed[1:]), resumed
    assert len(controller.times("RegisterNode")) == 1
    assert all(r.generation == 1 for r in controller.requests("Heartbeat"))


@pytest.mark.parametrize("code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND])
async def test_a_refused_heartbeat_registers_again_at_once(link, code):
    controller: ScriptedController = link.stub
    link.start()
    await settle(lambda: len(controller.times("Heartbeat")) >= 2)
    controller.errors["Heartbeat"] = [code]
    await settle(lambda: len(controller.times("Heartbeat")) >= 5)
    refused_at = controller.times("Heartbeat")[2]
    registrations = controller.times("RegisterNode")
    assert len(registrations) == 2 and registrations[1] == refused_at  # no backoff first
    assert link.generation == 2 and link.registered.is_set()
    assert [r.generation for r in controller.requests("Heartbeat")][3:] == [2, 2]


async def test_transient_heartbeat_failures_never_register_again(link):
    controller: ScriptedController = link.stub
    controller.errors["Heartbeat"] = [UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL]
    link.start()
    await settle(lambda: len(controller.times("Heartbeat")) >= 5)
    assert len(controller.times("RegisterNode")) == 1


async def test_registration_waits_for_the_controller_with_backoff_and_jitter(link):
    random.seed(99)
    controller: ScriptedController = link.stub
    controller.errors["RegisterNode"] = [UNAVAILABLE] * 8
    link.start()
    await settle(lambda: controller.times("Heartbeat"))
    attempts = controller.times("RegisterNode")
    assert len(attempts) == 9 and link.generation == 1
    waits = gaps(attempts)
    bounds = [min(MAX_BACKOFF, min(INTERVAL, 1.0) / 2 * 2**k) for k in range(8)]
    assert all(0 <= wait <= bound for wait, bound in zip(waits, bounds)), list(zip(waits, bounds))
    assert max(waits) > INTERVAL and len(set(waits)) == len(waits)


async def test_a_failure_report_retries_transient_errors_only_and_a_few_times(link):
    controller: ScriptedController = link.stub
    await link.register()
    engine = types_pb2.Engine(engine_id="prefill-0/rank0", state=types_pb2.ENGINE_STATE_FAILED)
    controller.errors["ReportEngineEvent"] = [UNAVAILABLE, UNAVAILABLE]
    await link.report(engine, "killed by signal 9")
    assert len(controller.times("ReportEngineEvent")) == 3  # delivered on the third try
    assert controller.requests("ReportEngineEvent")[-1].reason == "killed by signal 9"

    controller.calls.clear()
    controller.errors["ReportEngineEvent"] = [UNAVAILABLE] * 5
    await link.report(engine, "again")  # gives up (the next heartbeat carries the failure)
    assert len(controller.times("ReportEngineEvent")) == 3

    controller.calls.clear()
    controller.errors["ReportEngineEvent"] = [grpc.StatusCode.FAILED_PRECONDITION, UNAVAILABLE]
    await link.report(engine, "stale")  # a refusal is not retried: registering again fixes it
    assert len(controller.times("ReportEngineEvent")) == 1


async def test_heartbeats_follow_the_interval_the_controller_announces_up_to_the_cap(link):
    controller: ScriptedController = link.stub
    link.max_interval = 30.0
    link.start()
    await settle(lambda: len(controller.times("Heartbeat")) >= 2)
    controller.announce = 3.0  # the fleet grew past the controller's heartbeat budget
    await settle(lambda: len(controller.times("Heartbeat")) >= 5)
    controller.announce = 100.0  # beyond --max-heartbeat-interval: the node beats at its cap
    await settle(lambda: len(controller.times("Heartbeat")) >= 8)
    controller.announce = 0.5  # the fleet shrank: faster again at once
    await settle(lambda: len(controller.times("Heartbeat")) >= 11)
    steps = gaps(controller.times("Heartbeat"))
    # Each announcement sets the wait after the beat it answers: runs of the configured interval,
    # the announced 3 s, the cap, then 0.5 s, in that order and nothing else, but for one shorter
    # step into each new grid (the next point of the new interval after the beat that taught it).
    lone = [i for i in range(1, len(steps) - 1) if steps[i - 1] != steps[i] != steps[i + 1]]
    assert all(0 < steps[i] <= steps[i + 1] for i in lone), steps
    steady = [value for i, value in enumerate(steps) if i not in lone]
    runs = [value for i, value in enumerate(steady) if i == 0 or steady[i - 1] != value]
    assert runs == [INTERVAL, 3.0, 30.0, 0.5], steps
    assert steps.count(30.0) >= 2 and steps[-2:] == [0.5, 0.5], steps
    assert len(controller.times("RegisterNode")) == 1  # following the interval is no reason to register again


async def test_beats_fall_on_the_nodes_own_grid_so_nodes_started_at_once_beat_spread(tmp_path):
    """Each node beats at the points (k + phase) x interval of its own phase: two node managers
    registered at the same instant beat half an interval apart (phases 0.25 and 0.75), through an
    interval change, and each stays on its grid; without a phase given, each link draws its own."""
    # One fake clock each (time moves when its node sleeps), both reading the same at the start.
    nodes = [FakeNode(str(tmp_path / name)) for name in ("a", "b")]
    controllers, tasks = [], []
    for node, phase in zip(nodes, (0.25, 0.75)):
        await node.manager.start()
        link = ControllerLink(
            node.manager,
            "127.0.0.1:1",
            controller_pb2.NodeInfo(node_id=f"node-{phase}"),
            interval=INTERVAL,
            clock=node.clock,
            stream_heartbeats=False,
            phase=phase,
        )
        link.channels[link.address] = ScriptedChannel(ScriptedController(node.clock))
        controllers.append(link.stub)
        tasks.append(asyncio.get_running_loop().create_task(link.run()))
    try:
        await settle(lambda: all(len(c.times("Heartbeat")) >= 4 for c in controllers))
        for c in controllers:
            c.announce = 4.0
        await settle(lambda: all(len(c.times("Heartbeat")) >= 9 for c in controllers))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    registered = [c.times("RegisterNode")[0] for c in controllers]
    assert registered[0] == registered[1]  # started together
    for c, phase in zip(controllers, (0.25, 0.75)):
        beats = c.times("Heartbeat")
        assert 0 < beats[0] - registered[0] <= INTERVAL  # the first beat within an interval of registering
        fast, slow = beats[:4], beats[-3:]
        assert all(round(at / INTERVAL - phase, 9) == round(at / INTERVAL - phase) for at in fast), fast
        assert all(round(at / 4.0 - phase, 9) == round(at / 4.0 - phase) for at in slow), slow
        assert gaps(slow) == [4.0, 4.0]
    first, second = (c.times("Heartbeat") for c in controllers)
    assert {round(abs(a - b), 9) for a, b in zip(first[:4], second[:4])} == {INTERVAL / 2}
    assert {round(abs(a - b), 9) for a, b in zip(first[-3:], second[-3:])} == {2.0}  # half of 4 s

    drawn = []
    for _ in range(3):
        link = ControllerLink(
            node.manager, "127.0.0.1:1", controller_pb2.NodeInfo(node_id="node-x"), interval=INTERVAL, clock=node.clock
        )
        drawn.append(link.phase)
        await link.channels[link.address].close()
    for node in nodes:
        await node.manager.close()
    assert len(set(drawn)) == 3 and all(0 <= p < 1 for p in drawn), drawn
