"""Autoscaling acting on a controller with a fake node-manager client: the group's engines' requests
in flight (reported in heartbeats) scale its count, a READY spare serving first; the lower count
takes instances out of the routers before their engines stop; nothing moves while a rollout is
paused. The decision rules themselves are pinned on a fake clock (test_autoscaling_rules.py)."""

from __future__ import annotations

import asyncio

import pytest

from controller.capacity import autoscaler
from controller.model.instances import READY
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, all_ready, listed, small_deployment

# Real loops on real time (a window of 1 s, delays of seconds): 5-10 s a test, so the fast tier
# (`make test-fast`) leaves them to the full suite and pins the rules on a fake clock instead.
pytestmark = pytest.mark.slow

NODES = ("node-a", "node-b")


@pytest.fixture(autouse=True)
def short_window(monkeypatch):
    monkeypatch.setattr(autoscaler, "WINDOW_S", 1.0)  # a test waits seconds, not the product's 10 s


def chat(count: int = 1, spares: int = 1, delay: float = 2.0) -> C.Deployment:
    block = {"min": 1, "max": 4, "target_in_flight": 4, "scale_down_delay_s": delay}
    return small_deployment([{"name": "u", "role": "union", "count": count, "spares": spares, "autoscaling": block}])


def load(h: Harness, per_instance: dict[str, int], average: dict[str, float] | None = None) -> None:
    """Each engine's requests in flight as its engine server reads them now and, where `average`
    names its instance, averaged over its last second (without: an engine server that does not
    report the average)."""
    for engines in h.client.engines.values():
        for engine_id, engine in engines.items():
            instance = engine_id.split("/")[0]
            engine.in_flight_requests = per_instance.get(instance, 0)
            if average is not None and instance in average:
                engine.in_flight_average = average[instance]
            else:
                engine.ClearField("in_flight_average")


def events(h: Harness) -> list[str]:
    return [e.message for e in h.controller.events.recent if e.type == C.EVENT_TYPE_AUTOSCALE]


def count(h: Harness) -> int:
    return h.controller.deployments.by_name["t"][0].instance_groups[0].count


def counts(h: Harness) -> tuple[int, ...]:
    """Every group's count, in the file's order."""
    return tuple(g.count for g in h.controller.deployments.by_name["t"][0].instance_groups)


def reason(h: Harness) -> str:
    """What ListDeployments says of the group's scale: the last decision, then what follows it."""
    return h.controller.list_deployments().deployments[0].scale[0].reason


async def running(h: Harness, **kw) -> None:
    await h.start()
    for node in NODES:
        await h.register(node, accelerators=4)
    h.controller.apply_deployment(chat(**kw))
    await all_ready(h, NODES, kw.get("count", 1) + kw.get("spares", 1))


async def test_load_scales_up_with_the_spare_serving_at_once_then_down_after_the_delay(harness):
    await running(harness)
    assert listed(harness) == {"u-0"}
    load(harness, {"u-0": 12})  # 12 in flight on one engine, a target of 4: three engines
    async with harness.beating(*NODES):
        await async_wait_for(lambda: count(harness) == 3, timeout=15, what="the count raised to 3")
        [decision] = events(harness)
        assert decision.startswith("u: 1 -> 3, in flight 12.0 per engine over 1 s against a target of 4")
        assert "spare u-1 serves at once" in decision
        assert "u-1" in listed(harness)  # the spare serves before any new engine has loaded
        await async_wait_for(lambda: len(harness.client.starts()) >= 4, timeout=5, what="the new engines started")
        await all_ready(harness, NODES, 4)
        assert listed(harness) == {"u-0", "u-1", "u-2"} and harness.instance("u-3").spare
        [summary] = harness.controller.list_deployments().deployments
        [scale] = summary.scale
        assert (scale.group, scale.desired, scale.current) == ("u", 3, 3)
        assert scale.reason.startswith("u: 1 -> 3, in flight 12.0 per engine")  # the last decision, then what follows
        sample = harness.controller.metrics.registry.get_sample_value
        labels = {"deployment": "t", "group": "u"}
        assert sample("motor_controller_autoscale_desired_instances", labels) == 3
        assert sample("motor_controller_autoscale_decisions_total", {**labels, "direction": "up"}) == 1

        load(harness, {})  # idle: after the 2 s delay, back to min
        stops_before = len(harness.client.stops())
        await async_wait_for(lambda: count(harness) == 1, timeout=15, what="the count lowered to 1")
        assert events(harness)[-1].startswith("u: 3 -> 1, in flight 0.0 per engine")
        await async_wait_for(lambda: len(harness.client.stops()) >= stops_before + 2, timeout=5, what="2 stops")
        assert len(listed(harness)) == 1 and "u-3" not in listed(harness)


async def test_the_load_is_the_engines_average_over_their_last_second_not_an_instants_count(harness):
    await running(harness)
    load(harness, {"u-0": 12}, average={"u-0": 2.0})  # a burst read at an instant, 2 over the second
    async with harness.beating(*NODES):
        await async_wait_for(lambda: "steady" in reason(harness), timeout=10)
        await asyncio.sleep(1.5)  # more windows: none scales
        assert count(harness) == 1 and not events(harness)
        assert "in flight 2.0 per engine" in reason(harness)


async def test_a_load_still_growing_while_the_added_engines_load_is_met_before_they_are_ready(harness):
    await running(harness, spares=0)
    load(harness, {"u-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: count(harness) == 3, timeout=15, what="the count raised to 3")
        load(harness, {"u-0": 24})  # the queue grows on u-0 while u-1 and u-2 load (never READY here)
        await async_wait_for(lambda: count(harness) == 4, timeout=15, what="a second step while the first loads")
        assert harness.instance("u-1").state != READY and harness.instance("u-2").state != READY
        assert events(harness)[-1].startswith("u: 3 -> 4, in flight 8.0 per engine")


async def test_an_operators_rollout_in_progress_holds_the_count(harness):
    await running(harness, spares=0)
    changed = chat(spares=0)
    changed.engine_config["motor_engine_union_config"]["engine_args"] = {"latency_ms": 5}  # a new spec: rolled out
    await harness.controller.apply(changed)
    load(harness, {"u-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: reason(harness).startswith("held: a rollout is in progress"), timeout=5)
        assert count(harness) == 1


async def test_a_paused_rollout_holds_the_count_and_says_so(harness):
    await running(harness)
    harness.controller.rollouts.pause("t")
    load(harness, {"u-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: reason(harness).startswith("held: the rollout is paused"), timeout=5)
        harness.controller.rollouts.resume("t")
        await async_wait_for(lambda: count(harness) == 3, timeout=15, what="scaled once resumed")


async def test_reapplying_the_file_keeps_the_count_the_autoscaler_reached(harness):
    await running(harness)
    load(harness, {"u-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: count(harness) == 3, timeout=15)
    load(harness, {"u-0": 0})
    await harness.controller.apply(chat(delay=300))  # the same file but a longer delay
    assert count(harness) == 3


async def test_a_dry_run_of_the_same_file_says_what_the_apply_would_do_keep_the_count(harness):
    await running(harness)
    load(harness, {"u-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: count(harness) == 3, timeout=15)
    await async_wait_for(lambda: not harness.controller.changes.busy, timeout=5)
    revision = harness.controller.deployments.by_name["t"][1]
    deployment, would_be = harness.controller.dry_run_apply(chat())
    assert (would_be, deployment.instance_groups[0].count) == (revision, 3)  # no change, as the apply finds
    _, applied = await harness.controller.apply(chat())
    assert applied == revision


async def test_motorctl_deployments_shows_desired_current_and_why(harness):
    from motorctl.render import render_deployments

    await running(harness)
    load(harness, {"u-0": 2})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: "steady" in reason(harness), timeout=10)
    text = render_deployments(harness.controller.list_deployments())
    lines = text.splitlines()
    assert lines[-2].split()[:5] == ["DEPLOYMENT", "AUTOSCALED", "GROUP", "DESIRED", "CURRENT"]
    assert lines[-1].split()[:4] == ["t", "u", "1", "1"]
    assert "steady: in flight 2.0 per engine over 1 s against a target of 4" in lines[-1]


async def test_scale_down_removes_the_least_loaded_instances(harness):
    await running(harness, count=3, spares=0)
    load(harness, {"u-2": 2})  # u-0 and u-1 idle: they go, u-2 keeps its requests
    async with harness.beating(*NODES):
        await async_wait_for(lambda: count(harness) == 1, timeout=15, what="the count lowered to 1")
    assert {i.instance_id for i in harness.controller.list_instances()} == {"u-2"}
    assert listed(harness) == {"u-2"}
    stopped = {engine_id for _, engine_id, _ in harness.client.stops()}
    assert stopped == {"u-0/rank0", "u-1/rank0"}


async def test_a_pd_pair_scales_as_one_on_the_larger_of_its_two_loads(harness):
    block = {"min": 1, "max": 3, "target_in_flight": 4, "scale_down_delay_s": 2}
    pair = small_deployment(
        [
            {"name": "p", "role": "prefill", "count": 1, "spares": 1, "pair_with": "d", "autoscaling": block},
            {"name": "d", "role": "decode", "count": 1, "spares": 1},
        ]
    )
    await harness.start()
    for node in NODES:
        await harness.register(node, accelerators=4)
    harness.controller.apply_deployment(pair)
    await all_ready(harness, NODES, 4)

    load(harness, {"d-0": 12})  # the decode side is the busy one: three pairs
    async with harness.beating(*NODES):
        await async_wait_for(lambda: counts(harness) == (3, 3), timeout=15, what="both groups raised to 3")
        assert not harness.instance("p-1").spare and not harness.instance("d-1").spare  # the spare pair serves
        await all_ready(harness, NODES, 8)
        assert {i.paired_instance_id for i in harness.controller.list_instances() if i.group == "p"} == {
            "d-0",
            "d-1",
            "d-2",
            "d-3",
        }
        load(harness, {"d-2": 1})  # idle but for pair 2: pairs 0 and 1 go, whole
        await async_wait_for(lambda: counts(harness) == (1, 1), timeout=15, what="both groups lowered to 1")
    serving = {i.instance_id for i in harness.controller.list_instances() if not i.spare}
    assert serving == {"p-2", "d-2"}


async def test_unpaired_prefill_and_decode_groups_scale_each_on_its_own_load(harness):
    # Prefill and decode engines are busy in different measures (long prompts load prefill, long
    # answers decode): groups not bound by index each scale on their own requests in flight.
    block = {"min": 1, "max": 3, "target_in_flight": 4, "scale_down_delay_s": 2}
    groups = small_deployment(
        [
            {"name": "p", "role": "prefill", "count": 1, "autoscaling": block},
            {"name": "d", "role": "decode", "count": 1, "autoscaling": block},
        ]
    )
    await harness.start()
    for node in NODES:
        await harness.register(node, accelerators=4)
    harness.controller.apply_deployment(groups)
    await all_ready(harness, NODES, 2)

    load(harness, {"p-0": 12, "d-0": 2})  # long prompts: prefill needs three engines, decode one
    async with harness.beating(*NODES):
        await async_wait_for(lambda: counts(harness)[0] == 3, timeout=15, what="prefill raised to 3")
        await all_ready(harness, NODES, 4)
        await asyncio.sleep(3)  # windows of the 1 s the test sets: decode's own load keeps it at 1
        assert counts(harness) == (3, 1)
        assert not any(m.startswith("d:") for m in events(harness)), events(harness)
        load(harness, {"p-0": 0, "d-0": 12})  # now long answers: decode up, prefill back down
        await async_wait_for(lambda: counts(harness)[1] == 3, timeout=15, what="decode raised to 3")
        await all_ready(harness, NODES, 6)  # the new decode engines serve: the change is complete
        await async_wait_for(
            lambda: counts(harness) == (1, 3), timeout=15, what="prefill lowered to 1, decode kept at 3"
        )


async def test_reapplying_a_pd_pairs_file_keeps_both_groups_at_the_count_the_autoscaler_reached(harness):
    # The block is on the prefill group only; the decode group follows it. Re-applying the same
    # file must keep both at the reached count, not refuse the pair's counts as unequal.
    block = {"min": 1, "max": 3, "target_in_flight": 4, "scale_down_delay_s": 300}
    pair = small_deployment(
        [
            {"name": "p", "role": "prefill", "count": 1, "pair_with": "d", "autoscaling": block},
            {"name": "d", "role": "decode", "count": 1},
        ]
    )
    await harness.start()
    for node in NODES:
        await harness.register(node, accelerators=4)
    harness.controller.apply_deployment(pair)
    await all_ready(harness, NODES, 2)

    load(harness, {"p-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: counts(harness) == (3, 3), timeout=15, what="both groups raised to 3")
    await harness.controller.apply(pair)  # the same file again
    assert counts(harness) == (3, 3)


@pytest.fixture
def manual_ticks(monkeypatch):
    """The controller's own once-a-second pass does nothing; the test calls the returned tick
    where it wants a decision made (a race needs its order, not a second's luck)."""
    tick = autoscaler.Autoscaler.tick
    monkeypatch.setattr(autoscaler.Autoscaler, "tick", lambda self: None)
    return tick


async def settled(h: Harness) -> None:
    """The first apply's rollout has completed (until then it holds every decision)."""
    async with h.beating(*NODES):
        await async_wait_for(
            lambda: h.controller.rollouts.status("t")[0] == C.ROLLOUT_STATE_COMPLETE, timeout=15, what="rollout done"
        )


def spec_of(h: Harness) -> dict:
    return dict(h.controller.deployments.by_name["t"][0].engine_config["motor_engine_union_config"])


async def test_an_operators_apply_made_between_a_decision_and_its_write_is_not_undone(harness, manual_ticks):
    # The operator's apply is on its way (validated, waiting for its turn) as the autoscaler decides;
    # its turn comes first. The autoscaler's change, computed from the revision before it, must not
    # write that revision's spec back over the operator's.
    await running(harness, spares=0)
    await settled(harness)
    load(harness, {"u-0": 12})
    harness.beat(*NODES)
    assert harness.controller.autoscaler.in_flight("u") == 12
    changed = chat(spares=0)
    changed.engine_config["motor_engine_union_config"]["engine_args"] = {"latency_ms": 5}
    operator = asyncio.create_task(harness.controller.apply(changed))
    await asyncio.sleep(0)  # the operator's apply waits for its turn
    manual_ticks(harness.controller.autoscaler)  # the decision: 1 -> 3, on the revision before it
    assert count(harness) == 1 and events(harness)[-1].startswith("u: 1 -> 3")
    await operator
    await asyncio.sleep(0.2)
    await async_wait_for(lambda: not harness.controller.changes.busy, timeout=5)
    assert "engine_args" in spec_of(harness), "the operator's change was written over"
    assert "not applied" in events(harness)[-1], events(harness)


async def test_an_operators_apply_that_waits_behind_the_autoscalers_change_keeps_its_count(harness, manual_ticks):
    # The autoscaler's change is being made when the operator applies: the count the operator's
    # apply keeps is the one that change made, not the one before it.
    await running(harness, spares=0)
    await settled(harness)
    load(harness, {"u-0": 12})
    harness.beat(*NODES)
    manual_ticks(harness.controller.autoscaler)  # 1 -> 3
    for _ in range(100):  # the change takes a few turns of the loop
        if harness.controller.changes.busy:
            break
        await asyncio.sleep(0)
    assert harness.controller.changes.busy, "the autoscaler's change under way"
    changed = chat(spares=0)
    changed.engine_config["motor_engine_union_config"]["engine_args"] = {"latency_ms": 5}
    await harness.controller.apply(changed)
    assert count(harness) == 3 and "engine_args" in spec_of(harness)


async def test_a_scale_up_beyond_the_nodes_room_does_not_stop_autoscaling_once_its_rollout_times_out(harness):
    # max is a bound, not a promise of room: 4 asked for, room for 2. The count's rollout pauses
    # itself past its progress deadline (nothing of a new spec is under review there); the load
    # then falls and the group must still come back down.
    block = {"min": 1, "max": 4, "target_in_flight": 4, "scale_down_delay_s": 2}
    deployment = small_deployment(
        [{"name": "u", "role": "union", "count": 1, "autoscaling": block}],
        strategy={"progress_deadline": "1s", "min_ready": "0.1s"},
    )
    await harness.start()
    await harness.register("node-a", accelerators=2)
    harness.controller.apply_deployment(deployment)
    await all_ready(harness, ("node-a",), 1)
    load(harness, {"u-0": 16})
    async with harness.beating("node-a"):
        await async_wait_for(lambda: count(harness) == 4, timeout=15, what="the count raised to 4")
        await async_wait_for(lambda: len(harness.client.starts()) >= 2, timeout=5, what="u-1 started")
        harness.client.set_health("node-a")  # u-1 serves; u-2 and u-3 wait for room
        await async_wait_for(
            lambda: harness.controller.rollouts.status("t")[0] == C.ROLLOUT_STATE_PAUSED, timeout=10, what="paused"
        )
        load(harness, {})
        try:
            await async_wait_for(lambda: count(harness) == 1, timeout=20)
        except AssertionError:
            raise AssertionError(reason(harness)) from None


async def test_an_operators_pause_of_the_autoscalers_own_rollout_holds_the_count(harness):
    await running(harness, spares=0)
    load(harness, {"u-0": 12})
    async with harness.beating(*NODES):
        await async_wait_for(lambda: count(harness) == 3, timeout=15, what="the count raised to 3")
        await async_wait_for(lambda: not harness.controller.changes.busy, timeout=5)
        harness.controller.rollouts.pause("t")  # u-1 and u-2 still loading (never READY here)
        load(harness, {"u-0": 40})
        await async_wait_for(lambda: reason(harness).endswith("resume or undo it to scale again"), timeout=5)
        await asyncio.sleep(2)
        assert count(harness) == 3
