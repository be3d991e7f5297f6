"""Warm spares against a fake node-manager client: started like any instance, never listed as
endpoints, promoted in one store write when a serving instance fails, preempted by serving
instances that wait for room."""

from __future__ import annotations

import asyncio

import pytest

from controller.store.sqlite import SqliteStore
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, all_ready, listed, small_deployment


def union(count: int = 2, spares: int = 1, name: str = "u", **group) -> C.Deployment:
    return small_deployment([{"name": name, "role": "union", "count": count, "spares": spares, **group}])


def node_of(h: Harness, instance_id: str) -> str:
    return h.controller.slots.get(f"{instance_id}/rank0").node_id


def spare_events(h: Harness) -> list[str]:
    return [e.message for e in h.controller.events.recent if e.type == C.EVENT_TYPE_SPARE]


async def spares_running(h: Harness, nodes=("node-a", "node-b"), accelerators=4, **kw) -> None:
    await h.start()
    for node in nodes:
        await h.register(node, accelerators=accelerators)
    h.controller.apply_deployment(union(**kw))
    await all_ready(h, nodes, kw.get("count", 2) + kw.get("spares", 1))


async def serving_ready_spare_loading(h: Harness):
    """u-0 and u-1 READY on one node, the spare u-2 still loading (INIT); returns the spare's engine."""
    await h.start()
    await h.register("node-a", accelerators=4)
    h.controller.apply_deployment(union())
    await async_wait_for(lambda: len(h.client.starts()) == 3, timeout=5)
    spare = h.client.engines["node-a"]["u-2/rank0"]
    for engine in h.client.engines["node-a"].values():
        if engine is not spare:
            engine.state, engine.health = T.ENGINE_STATE_RUNNING, T.HEALTH_STATUS_NORMAL
    h.beat("node-a")
    await async_wait_for(lambda: h.instance("u-0").state == C.INSTANCE_STATE_READY, timeout=5)
    return spare


def fail(h: Harness, instance_id: str, reason: str = "exited with signal 9 (SIGKILL)") -> None:
    node = node_of(h, instance_id)
    engine = h.client.engines[node][f"{instance_id}/rank0"]
    engine.state = T.ENGINE_STATE_FAILED
    h.controller.report_engine_event(node, h.generations[node], engine, reason)


async def test_spares_start_and_are_ready_but_never_listed_as_endpoints(harness):
    await spares_running(harness)
    ctl = harness.controller
    assert {i.instance_id: i.spare for i in ctl.list_instances()} == {"u-0": False, "u-1": False, "u-2": True}
    assert listed(harness) == {"u-0", "u-1"}
    [summary] = ctl.list_deployments().deployments
    assert (summary.instances, summary.ready_instances, summary.spare_instances, summary.ready_spare_instances) == (
        2,
        2,
        1,
        1,
    )
    # The serving instances spread over the two nodes (the spare then packs where it fits).
    assert node_of(harness, "u-0") != node_of(harness, "u-1")


async def test_a_failed_serving_instance_is_replaced_by_the_ready_spare_at_once_and_restarts_as_the_spare(harness):
    await spares_running(harness)
    ctl = harness.controller
    fail(harness, "u-0")
    # At once, in the same call: no wait for a restart.
    assert listed(harness) == {"u-1", "u-2"}
    assert not harness.instance("u-2").spare and harness.instance("u-0").spare
    assert harness.instance("u-0").state == C.INSTANCE_STATE_RESTARTING
    [promoted] = spare_events(harness)
    assert "spare u-2 promoted: serves in place of u-0" in promoted and "SIGKILL" in promoted
    # The failed one restarts, READY again as the spare: still out of the endpoints.
    await async_wait_for(lambda: len(harness.client.starts("u-0/rank0")) == 2, timeout=5)
    await all_ready(harness, ("node-a", "node-b"), 4)
    assert listed(harness) == {"u-1", "u-2"}
    [summary] = ctl.list_deployments().deployments
    assert (summary.instances, summary.ready_instances, summary.ready_spare_instances) == (2, 2, 1)


async def test_a_promotion_is_durable_a_restarted_controller_serves_the_same_instances(harness):
    await spares_running(harness)
    fail(harness, "u-1")
    assert listed(harness) == {"u-0", "u-2"}
    await async_wait_for(lambda: "u-1" not in harness.controller.state.unsaved["instances"], timeout=5)
    await harness.stop()
    store = SqliteStore(harness.db)
    flags = {instance_id: row["spare"] for instance_id, row in store.load().instances.items()}
    store.close()
    assert flags == {"u-0": False, "u-1": True, "u-2": False}
    await harness.start()
    assert {i.instance_id: i.spare for i in harness.controller.list_instances()} == flags


async def test_a_failing_spare_restarts_as_a_spare_and_touches_nothing_serving(harness):
    await spares_running(harness)
    fail(harness, "u-2")
    assert harness.instance("u-2").spare and harness.instance("u-2").state == C.INSTANCE_STATE_RESTARTING
    assert listed(harness) == {"u-0", "u-1"}
    assert not spare_events(harness)
    await async_wait_for(lambda: len(harness.client.starts("u-2/rank0")) == 2, timeout=5)
    assert len(harness.client.starts("u-0/rank0")) == len(harness.client.starts("u-1/rank0")) == 1
    assert not harness.client.stops()


async def test_without_a_ready_spare_a_failure_restarts_as_before(harness):
    await serving_ready_spare_loading(harness)
    fail(harness, "u-0")
    assert not harness.instance("u-0").spare and harness.instance("u-2").spare
    assert listed(harness) == {"u-1"}


async def test_a_node_lost_promotes_the_spare_on_another_node(harness):
    nodes = ("node-a", "node-b", "node-c")
    await spares_running(harness, nodes=nodes)
    victim = node_of(harness, "u-0")
    assert len({node_of(harness, i) for i in ("u-0", "u-1", "u-2")}) == 3  # spread: one each
    harness.client.unreachable.add(victim)
    async with harness.beating(*(n for n in nodes if n != victim)):
        await async_wait_for(lambda: harness.controller.nodes[victim].state == C.NODE_STATE_LOST, timeout=5)
    # The spare serves in place of the one instance lost with its node.
    assert listed(harness) == {"u-1", "u-2"}
    assert not harness.instance("u-2").spare
    assert [harness.instance(i).spare for i in ("u-0", "u-1")] == [True, False]
    assert any("spare u-2 promoted: serves in place of u-0" in m and victim in m for m in spare_events(harness))


async def test_a_serving_instance_waiting_for_room_preempts_a_spare(harness):
    await harness.start()
    await harness.register("node-a", accelerators=2)
    harness.controller.apply_deployment(union(count=1, spares=1))
    await all_ready(harness, ("node-a",), 2)
    harness.controller.apply_deployment(small_deployment([{"name": "other", "role": "union"}], name="other"))
    await async_wait_for(lambda: harness.client.starts("other-0/rank0"), timeout=5, what="other-0 placed")
    assert harness.instance("u-1").state == C.INSTANCE_STATE_PENDING
    assert "none has room" in harness.instance("u-1").reason  # until room appears
    assert ("node-a", "u-1/rank0") in [(n, e) for n, e, _ in harness.client.stops()]
    assert any("spare u-1 preempted" in m and "other-0" in m for m in spare_events(harness))
    harness.client.set_health("node-a")
    harness.beat("node-a")
    await async_wait_for(lambda: listed(harness) == {"u-0", "other-0"}, timeout=5)


def test_too_many_spares_are_refused_naming_the_field():
    from controller.rules.deployment_checks import validate_deployment

    with pytest.raises(InvalidArgument, match=r"instance_groups\[0\]\.spares: must be at most 10000 \(got 10001\)"):
        validate_deployment(union(count=1, spares=10001), max_engines=10**6)
    with pytest.raises(InvalidArgument, match=r"10 engines \(count x data_parallel_size, spares included\) exceed"):
        validate_deployment(union(count=8, spares=2), max_engines=9)


def test_paired_groups_need_the_same_number_of_spares():
    deployment = small_deployment(
        [
            {"name": "p", "role": "prefill", "count": 1, "spares": 1, "pair_with": "d"},
            {"name": "d", "role": "decode", "count": 1},
        ]
    )
    from controller.rules.deployment_checks import validate_deployment

    with pytest.raises(InvalidArgument, match=r"instance_groups\[0\]\.spares: 'd' has 0 spare\(s\)"):
        validate_deployment(deployment)


async def pd_pair_with_spares_applied(harness) -> None:
    """A prefill/decode pair with one spare pair, applied on one 8-accelerator node."""
    await harness.start()
    await harness.register("node-a", accelerators=8)
    harness.controller.apply_deployment(
        small_deployment(
            [
                {"name": "p", "role": "prefill", "count": 1, "spares": 1, "pair_with": "d"},
                {"name": "d", "role": "decode", "count": 1, "spares": 1},
            ]
        )
    )


async def test_a_pd_pair_is_promoted_whole(harness):
    await pd_pair_with_spares_applied(harness)
    await all_ready(harness, ("node-a",), 4)
    assert listed(harness) == {"p-0", "d-0"}
    fail(harness, "d-0")
    assert listed(harness) == {"p-1", "d-1"}
    assert harness.instance("p-0").spare and harness.instance("d-0").spare


async def test_fewer_spares_applied_after_a_promotion_keeps_count_instances_serving(harness):
    await spares_running(harness)
    fail(harness, "u-0")  # u-2 serves, u-0 is the spare
    harness.controller.apply_deployment(union(spares=0))  # the spare goes; those serving stay untouched
    assert {i.instance_id for i in harness.controller.list_instances() if not i.spare} == {"u-1", "u-2"}
    assert "u-0" not in harness.controller.instances


async def test_spares_have_their_own_lines_in_metrics_and_in_motorctl_tables(harness):
    from controller.fleet.series import FleetSeries
    from motorctl.render import render_deployments, render_instances
    from tests.support.controller_harness import scrape

    await spares_running(harness)
    ctl = harness.controller
    series = FleetSeries(ctl.state, lambda: "")

    def ready_counts(samples) -> dict[str, int]:
        """spare label -> READY instances of group u counted under it."""
        return {
            dict(labels)["spare"]: value
            for (name, labels), value in samples.items()
            if name == "motor_controller_group_instances" and dict(labels)["state"] == "ready"
        }

    assert ready_counts(await scrape(series)) == {"false": 2, "true": 1}
    table = render_instances(C.ListInstancesResponse(instances=ctl.list_instances()))
    assert [line.split()[2:4] for line in table.splitlines() if line.startswith("u-2")] == [["READY", "(spare)"]]
    assert "1/1 ready" in render_deployments(ctl.list_deployments())
    fail(harness, "u-0")
    assert ready_counts(await scrape(series)) == {"false": 2, "true": 0}  # u-0 restarts, now the spare


async def test_a_spare_ready_after_a_failure_takes_the_place_of_the_instance_still_loading(harness):
    spare = await serving_ready_spare_loading(harness)
    fail(harness, "u-0")
    assert not harness.instance("u-0").spare  # no READY spare: it restarts, serving
    await async_wait_for(lambda: len(harness.client.starts("u-0/rank0")) == 2, timeout=5)
    spare.state, spare.health = T.ENGINE_STATE_RUNNING, T.HEALTH_STATUS_NORMAL  # loaded before u-0's new copy
    harness.beat("node-a")
    await async_wait_for(lambda: listed(harness) == {"u-1", "u-2"}, timeout=5)
    assert harness.instance("u-0").spare and harness.instance("u-0").state != C.INSTANCE_STATE_READY
    assert any("spare u-2 promoted: serves in place of u-0" in m for m in spare_events(harness))


async def test_a_serving_engine_reported_abnormal_is_replaced_before_it_is_killed(harness):
    # A real vLLM engine server SIGKILLed: its node manager reports it ABNORMAL at once and kills
    # the rest of its tree (the engine core) before reporting it FAILED, seconds later.
    await spares_running(harness)
    node = node_of(harness, "u-0")
    harness.client.engines[node]["u-0/rank0"].health = T.HEALTH_STATUS_ABNORMAL
    harness.beat(node)
    await async_wait_for(lambda: harness.instance("u-0").state == C.INSTANCE_STATE_DEGRADED, timeout=5)
    assert listed(harness) == {"u-1", "u-2"}
    assert harness.instance("u-0").spare and not harness.instance("u-2").spare
    assert any("spare u-2 promoted: serves in place of u-0 (it is DEGRADED" in m for m in spare_events(harness))
    fail(harness, "u-0")  # then killed: it restarts as the spare, nothing else changes
    assert listed(harness) == {"u-1", "u-2"} and len(spare_events(harness)) == 1


async def test_a_rollout_keeps_the_old_spec_spare_until_the_new_version_serves_then_replaces_it(harness):
    await spares_running(harness)  # u-0 and u-1 serve, u-2 is the READY spare
    ctl = harness.controller
    old = harness.instance("u-0").spec_hash
    changed = small_deployment(
        [{"name": "u", "role": "union", "count": 2, "spares": 1}], model="sim-next", strategy={"min_ready": "0s"}
    )
    ctl.apply_deployment(changed)
    # The new version is not proven yet: the READY old-spec spare stays, no new spare starts.
    assert harness.instance("u-2").spare and harness.instance("u-2").spec_hash == old
    assert [i.instance_id for i in ctl.instances.values() if i.spare] == ["u-2"]
    fail(harness, "u-0")  # a failure promotes the old-spec spare: the proven version
    assert "u-2" in listed(harness) and harness.instance("u-0").spare
    # The rollout goes on; once the new version serves the whole count the spares are replaced.
    for _ in range(60):
        ctl.reconcile_once()
        for node in ("node-a", "node-b"):
            harness.client.set_health(node)
        harness.beat("node-a", "node-b")
        if ctl.list_deployments().deployments[0].rollout_state == C.ROLLOUT_STATE_COMPLETE:
            break
        await asyncio.sleep(0.05)
    summary = ctl.list_deployments().deployments[0]
    assert summary.rollout_state == C.ROLLOUT_STATE_COMPLETE, summary.rollout_reason
    assert all(i.spec_hash != old for i in ctl.instances.values())
    assert sum(1 for i in ctl.instances.values() if i.spare) == 1


async def test_a_pd_spare_pair_whose_prefill_becomes_ready_last_replaces_a_failed_decode(harness):
    await pd_pair_with_spares_applied(harness)
    await async_wait_for(lambda: len(harness.client.starts()) == 4, timeout=5)
    late = harness.client.engines["node-a"]["p-1/rank0"]  # the spare pair's prefill still loads
    for engine in harness.client.engines["node-a"].values():
        if engine is not late:
            engine.state, engine.health = T.ENGINE_STATE_RUNNING, T.HEALTH_STATUS_NORMAL
    harness.beat("node-a")
    await async_wait_for(lambda: harness.instance("d-1").state == C.INSTANCE_STATE_READY, timeout=5)
    fail(harness, "d-0")  # the serving decode dies while its spare pair is not whole yet
    assert "d-1" not in listed(harness)
    late.state, late.health = T.ENGINE_STATE_RUNNING, T.HEALTH_STATUS_NORMAL
    harness.beat("node-a")
    await async_wait_for(lambda: listed(harness) == {"p-1", "d-1"}, timeout=5, what="the spare pair promoted")
    assert harness.instance("p-0").spare and harness.instance("d-0").spare
