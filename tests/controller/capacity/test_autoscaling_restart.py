"""A restarted controller (or a new HA leader, which loads the same store) treats the autoscaler's
own rollouts as the one before it did. Which revision was the autoscaler's, and whether a pause was
an operator's, were kept in memory only: after a restart the group stayed held by its own
self-paused scale-up (stuck at 8 with 4 pending and no load, where without the restart it went
8 -> 6 -> 1 in about 25 s)."""

from __future__ import annotations

import asyncio

import pytest

from controller.capacity import autoscaler
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, small_deployment

# Real loops on real time (a window of 1 s, delays of seconds), as tests/controller/capacity/test_autoscaling.py.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def short_window(monkeypatch):
    monkeypatch.setattr(autoscaler, "WINDOW_S", 1.0)


def scaled(**strategy) -> C.Deployment:
    block = {"min": 1, "max": 4, "target_in_flight": 4, "scale_down_delay_s": 2}
    return small_deployment([{"name": "u", "role": "union", "count": 1, "autoscaling": block}], strategy=strategy)


def load(h: Harness, per_instance: dict[str, float]) -> None:
    """Each engine's requests in flight averaged over its last second, as its node reports it."""
    for engines in h.client.engines.values():
        for engine_id, engine in engines.items():
            engine.in_flight_average = per_instance.get(engine_id.split("/")[0], 0)


def count(h: Harness) -> int:
    return h.controller.deployments.by_name["t"][0].instance_groups[0].count


def reason(h: Harness) -> str:
    return h.controller.list_deployments().deployments[0].scale[0].reason


def rollout_state(h: Harness) -> int:
    return h.controller.rollouts.status("t")[0]


async def first_ready(h: Harness, node: str) -> None:
    await async_wait_for(lambda: len(h.client.starts()) >= 1, timeout=5, what="u-0 started")
    h.client.set_health(node)
    h.beat(node)
    await async_wait_for(lambda: h.instance("u-0").state == C.INSTANCE_STATE_READY, timeout=5, what="u-0 READY")


async def restarted(h: Harness, node: str, accelerators: int) -> None:
    """The controller stops and a new one starts on the same store; the node registers again."""
    await h.stop()
    await h.start()
    await h.register(node, accelerators=accelerators)


async def test_a_scale_up_that_paused_itself_does_not_hold_the_group_after_a_restart(harness):
    # 4 asked for, room for 2: the count's own rollout pauses itself past its deadline.
    await harness.start()
    await harness.register("node-a", accelerators=2)
    harness.controller.apply_deployment(scaled(progress_deadline="1s", min_ready="0.1s"))
    await first_ready(harness, "node-a")
    load(harness, {"u-0": 16})
    async with harness.beating("node-a"):
        await async_wait_for(lambda: count(harness) == 4, timeout=15, what="the count raised to 4")
        await async_wait_for(lambda: len(harness.client.starts()) >= 2, timeout=5, what="u-1 started")
        harness.client.set_health("node-a")  # u-1 serves; u-2 and u-3 wait for room
        await async_wait_for(lambda: rollout_state(harness) == C.ROLLOUT_STATE_PAUSED, timeout=10, what="paused")
    await restarted(harness, "node-a", accelerators=2)
    load(harness, {})
    async with harness.beating("node-a"):
        try:
            await async_wait_for(lambda: count(harness) == 1, timeout=20, what="back to 1")
        except AssertionError:
            raise AssertionError(f"count {count(harness)}: {reason(harness)}") from None


async def test_an_operators_pause_of_the_autoscalers_own_rollout_still_holds_after_a_restart(harness):
    await harness.start()
    for node in ("node-a", "node-b"):
        await harness.register(node, accelerators=4)
    harness.controller.apply_deployment(scaled(min_ready="0s"))
    await first_ready(harness, "node-a")
    load(harness, {"u-0": 12})
    async with harness.beating("node-a", "node-b"):
        await async_wait_for(lambda: count(harness) == 3, timeout=15, what="the count raised to 3")
        await async_wait_for(lambda: not harness.controller.changes.busy, timeout=5)
        await harness.controller.rollouts.pause_durably("t")  # u-1 and u-2 still loading (never READY here)
    await harness.stop()
    await harness.start()
    for node in ("node-a", "node-b"):
        await harness.register(node, accelerators=4)
    load(harness, {"u-0": 40})
    async with harness.beating("node-a", "node-b"):
        await async_wait_for(lambda: reason(harness).endswith("resume or undo it to scale again"), timeout=5)
        await asyncio.sleep(2)
        assert count(harness) == 3 and rollout_state(harness) == C.ROLLOUT_STATE_PAUSED
        harness.controller.rollouts.resume("t")  # the operator's word: the autoscaler goes on
        await async_wait_for(lambda: count(harness) == 4, timeout=15, what="scaled once resumed")


async def test_the_autoscalers_own_rollout_in_progress_does_not_hold_it_after_a_restart(harness):
    # Before the restart a scale-up's own rollout holds nothing (a load still growing is met while
    # the added engines load); a new controller must not hold the group until they are READY.
    await harness.start()
    for node in ("node-a", "node-b"):
        await harness.register(node, accelerators=4)
    harness.controller.apply_deployment(scaled(min_ready="0s"))
    await first_ready(harness, "node-a")
    load(harness, {"u-0": 12})
    async with harness.beating("node-a", "node-b"):
        await async_wait_for(lambda: count(harness) == 3, timeout=15, what="the count raised to 3")
        await async_wait_for(lambda: not harness.controller.changes.busy, timeout=5)
    await harness.stop()
    await harness.start()
    for node in ("node-a", "node-b"):
        await harness.register(node, accelerators=4)
    load(harness, {"u-0": 16})  # the queue grows on u-0 while u-1 and u-2 load (never READY here)
    async with harness.beating("node-a", "node-b"):
        try:
            await async_wait_for(lambda: count(harness) == 4, timeout=15, what="a second step while the first loads")
        except AssertionError:
            raise AssertionError(reason(harness)) from None
        assert rollout_state(harness) == C.ROLLOUT_STATE_PROGRESSING
