"""Rolling updates on the controller with a fake node client: waves bounded by max_surge and
max_unavailable, readiness before withdrawal, a failing or slow new version pausing the rollout,
scaling and restart-policy changes that restart nothing, and the rollout's record in the store."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from controller.model.instances import READY
from motor.errors import FailedPrecondition, InvalidArgument
from motor.v1 import controller_pb2, types_pb2
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, small_deployment
from tests.support.rollout_checks import stopped, summary, union

C, T = controller_pb2, types_pb2


async def serve(h: Harness, passes: int = 8) -> None:
    """Reconcile passes with the node's engines RUNNING and NORMAL in between (launched, reported)."""
    for _ in range(passes):
        h.controller.reconcile_once()
        await asyncio.sleep(0.02)
        h.client.set_health("node-a")
        h.beat("node-a")
        await asyncio.sleep(0.02)


def ids(h: Harness) -> dict[str, int]:
    """Instance id -> the revision it runs."""
    return {i: inst.revision for i, inst in sorted(h.controller.instances.items())}


async def started(tmp_path, deployment: C.Deployment, accelerators: int = 8, clock=None) -> Harness:
    h = Harness(tmp_path, clock=clock)
    await h.start()
    await h.register("node-a", accelerators=accelerators)
    h.controller.apply_deployment(deployment)
    await serve(h)
    assert all(inst.state == READY for inst in h.controller.instances.values())
    return h


async def test_a_spec_change_surges_one_new_instance_and_withdraws_an_old_one_only_once_it_serves(tmp_path):
    h = await started(tmp_path, union(2))
    try:
        ctl = h.controller
        ctl.apply_deployment(union(2, latency=30))
        assert ids(h) == {"u-0": 1, "u-1": 1}  # the change itself stops nothing
        ctl.reconcile_once()
        assert ids(h) == {"u-0": 1, "u-1": 1, "u-2": 2}  # one surge instance, at the lowest free index
        assert not stopped(h) and summary(h).rollout_state == C.ROLLOUT_STATE_PROGRESSING
        gauge = generate_latest(ctl.metrics.registry).decode()
        assert 'motor_controller_instances_by_revision{deployment="t",revision="1"} 2.0' in gauge
        assert 'motor_controller_instances_by_revision{deployment="t",revision="2"} 1.0' in gauge
        listed = {i.instance_id: i.revision for i in ctl.page_instances(C.ListInstancesRequest()).instances}
        assert listed == {"u-0": 1, "u-1": 1, "u-2": 2}
        ctl.reconcile_once()
        assert len(ids(h)) == 3, "no second surge and no withdrawal while the new one is not serving"
        await serve(h, passes=1)  # u-2 READY and listed: now one old one goes, and the next new one comes
        await serve(h, passes=12)
        assert ids(h) == {"u-0": 2, "u-2": 2} or ids(h) == {"u-1": 2, "u-2": 2} or set(ids(h).values()) == {2}
        assert stopped(h) == {"u-0", "u-1"}
        s = summary(h)
        assert (s.rollout_state, s.updated_instances, s.old_instances, s.available_instances) == (
            C.ROLLOUT_STATE_COMPLETE,
            2,
            0,
            2,
        )
        steps = [e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_ROLLOUT]
        assert any("u-0 withdrawn and drained" in m for m in steps) and "complete" in steps[-1], steps
    finally:
        await h.stop()


async def test_old_instances_serving_for_less_than_min_ready_are_not_withdrawn_at_once(tmp_path):
    h = await started(tmp_path, union(3))
    try:
        ctl = h.controller
        ctl.apply_deployment(union(3, latency=30, strategy={"min_ready": "60s"}))  # the old ones READY for < 1 s
        ctl.reconcile_once()
        await asyncio.sleep(0.05)
        assert not stopped(h) and len(ids(h)) == 4
        assert summary(h).available_instances == 3  # the old ones serve; the new one has not served 60 s
    finally:
        await h.stop()


async def test_max_unavailable_replaces_in_place_without_a_surge_instance(tmp_path):
    h = await started(tmp_path, union(2), accelerators=2)  # no room for a third engine
    try:
        ctl = h.controller
        ctl.apply_deployment(union(2, latency=30, strategy={"max_surge": 0, "max_unavailable": 1}))
        ctl.reconcile_once()
        await asyncio.sleep(0.05)  # the stop is sent
        # One out of service, none extra (the new one takes its place under its id).
        assert stopped(h) == {"u-0"} and ids(h)["u-1"] == 1 and len(ids(h)) <= 2
        await serve(h, passes=16)
        assert set(ids(h).values()) == {2} and len(ids(h)) == 2
        assert summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
    finally:
        await h.stop()


async def test_a_new_instance_that_fails_pauses_the_rollout_and_leaves_the_old_ones_alone(tmp_path):
    h = await started(tmp_path, union(2))
    try:
        ctl = h.controller
        ctl.apply_deployment(union(2, latency=30))
        ctl.reconcile_once()
        await asyncio.sleep(0.05)  # u-2 launched
        for engine in h.client.engines["node-a"].values():
            if engine.engine_id.startswith("u-2/"):
                engine.state, engine.exit_code = T.ENGINE_STATE_FAILED, 1
        h.beat("node-a")
        await serve(h, passes=4)
        s = summary(h)
        assert s.rollout_state == C.ROLLOUT_STATE_PAUSED and "u-2" in s.rollout_reason, s.rollout_reason
        old = [ctl.instances[i] for i in ("u-0", "u-1")]
        assert all(i.state == READY and i.restarts == 0 and not i.failure_times for i in old)
        assert not stopped(h) & {"u-0", "u-1"}
        paused = [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_ROLLOUT and "paused" in e.message]
        assert paused and paused[-1].instance_id == "u-2"
        # Applying the old spec again rolls back: the failed new instance goes, the old ones stay.
        ctl.apply_deployment(union(2, latency=20))
        await serve(h, passes=4)
        assert set(ids(h)) == {"u-0", "u-1"} and summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
    finally:
        await h.stop()


async def test_a_new_instance_never_available_within_the_progress_deadline_pauses_the_rollout(tmp_path):
    clock = ManualClock()
    h = await started(tmp_path, union(2), clock=clock)
    try:
        ctl = h.controller
        ctl.apply_deployment(union(2, latency=30, strategy={"progress_deadline": "60s"}))
        ctl.reconcile_once()
        assert "u-2" in ctl.instances
        clock.advance(30)
        ctl.reconcile_once()
        assert summary(h).rollout_state == C.ROLLOUT_STATE_PROGRESSING
        assert "waiting for u-2" in summary(h).rollout_reason
        clock.advance(31)
        ctl.reconcile_once()
        s = summary(h)
        assert s.rollout_state == C.ROLLOUT_STATE_PAUSED and "progress_deadline (60s)" in s.rollout_reason
        assert "u-2" in s.rollout_reason and not stopped(h)
    finally:
        await h.stop()


async def test_a_count_change_starts_or_stops_only_the_difference(tmp_path):
    h = await started(tmp_path, union(2))
    try:
        ctl = h.controller
        starts = len(h.client.starts())
        ctl.apply_deployment(union(4))
        await serve(h)
        assert ids(h) == {"u-0": 2, "u-1": 2, "u-2": 2, "u-3": 2}
        assert {s.instance_id for s in h.client.starts()[starts:]} == {"u-2", "u-3"} and not stopped(h)
        ctl.apply_deployment(union(1))
        await asyncio.sleep(0.05)
        assert set(ids(h)) == {"u-0"} and stopped(h) == {"u-1", "u-2", "u-3"}
        endpoints = {e.instance_id for e in ctl.list_endpoints(T.ROLE_UNSPECIFIED, "")}
        assert endpoints == {"u-0"}  # the stopped ones left the routers' feed first
    finally:
        await h.stop()


async def test_a_restart_policy_only_change_restarts_nothing(tmp_path):
    h = await started(tmp_path, union(2))
    try:
        ctl = h.controller
        starts = len(h.client.starts())
        changed = union(2, restart_policy={"max_failures": 9}, strategy={"type": "recreate"})
        _, revision = ctl.apply_deployment(changed)
        await serve(h)
        assert ids(h) == {"u-0": revision, "u-1": revision}  # moved on to the new revision, in place
        assert len(h.client.starts()) == starts and not stopped(h)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
    finally:
        await h.stop()


async def test_paired_groups_roll_a_prefill_and_its_decode_partner_together(tmp_path):
    def pairs(latency: int) -> C.Deployment:
        deployment = small_deployment(
            [
                {"name": "p", "role": "prefill", "count": 1, "pair_with": "d"},
                {"name": "d", "role": "decode", "count": 1},
            ],
            strategy={"min_ready": "0s"},
        )
        deployment.engine_config["motor_engine_prefill_config"]["engine_args"] = {"latency_ms": latency}
        return deployment

    h = await started(tmp_path, pairs(20))
    try:
        h.controller.apply_deployment(pairs(30))
        h.controller.reconcile_once()
        assert set(ids(h)) == {"p-0", "d-0", "p-1", "d-1"}  # the decode instance comes with its new partner
        assert h.controller.instances["p-1"].paired_instance_id == "d-1"
        await serve(h, passes=10)
        assert ids(h) == {"d-1": 2, "p-1": 2} and stopped(h) == {"p-0", "d-0"}
    finally:
        await h.stop()


async def test_pause_resume_and_undo(tmp_path):
    h = await started(tmp_path, union(2))
    try:
        ctl = h.controller
        ctl.apply_deployment(union(2, latency=30))
        ctl.rollouts.pause("t")
        await serve(h)
        assert ids(h) == {"u-0": 1, "u-1": 1} and summary(h).rollout_state == C.ROLLOUT_STATE_PAUSED
        ctl.rollouts.resume("t")
        await serve(h, passes=12)
        assert set(ids(h).values()) == {2}
        deployment, revision = await ctl.rollouts.undo("t")
        config = deployment.engine_config["motor_engine_union_config"]
        assert revision == 3 and config["engine_args"]["latency_ms"] == 20
        await serve(h, passes=12)
        assert set(ids(h).values()) == {3} and len(ids(h)) == 2
    finally:
        await h.stop()


async def test_a_paused_rollout_stays_paused_across_a_controller_restart(tmp_path):
    h = await started(tmp_path, union(2))
    try:
        h.controller.apply_deployment(union(2, latency=30))
        h.controller.rollouts.pause("t")
        await h.stop()
        await h.start()
        await h.register("node-a", accelerators=8)
        await serve(h)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_PAUSED and set(ids(h)) == {"u-0", "u-1"}
        h.controller.rollouts.resume("t")
        await serve(h, passes=12)
        assert set(ids(h).values()) == {2}
    finally:
        await h.stop()


async def test_undo_without_a_previous_revision_and_a_strategy_that_cannot_progress_are_refused(tmp_path):
    h = Harness(tmp_path)
    await h.start()
    try:
        h.controller.apply_deployment(union(2))
        with pytest.raises(FailedPrecondition, match="no previous revision"):
            await h.controller.rollouts.undo("t")
        with pytest.raises(InvalidArgument, match="strategy.max_surge"):
            h.controller.apply_deployment(union(2, strategy={"max_surge": 0, "max_unavailable": 0}))
    finally:
        await h.stop()


async def test_one_step_withdraws_at_most_step_limit_instances(tmp_path):
    """10,000 idle old instances are not withdrawn in one store write on the loop."""
    from controller.deploy.rollout import STEP_LIMIT
    from controller.rules.slicing import run_at_once

    h = Harness(tmp_path)
    await h.start()
    try:
        ctl = h.controller
        ctl.apply_deployment(union(STEP_LIMIT + 36))  # no node: nothing serves, every old one may go
        ctl.apply_deployment(union(STEP_LIMIT + 36, latency=30))
        run_at_once(ctl.rollouts.steps())
        assert sum(1 for revision in ids(h).values() if revision == 1) == 36
        run_at_once(ctl.rollouts.steps())
        assert sum(1 for revision in ids(h).values() if revision == 1) == 0
    finally:
        await h.stop()
