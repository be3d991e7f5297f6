"""The operator sequences a hostile tester ran against rollouts, replayed on the controller with a
fake node client: a fix applied while a bad version is paused, a new apply in the middle of a
rollout, a scale-down while an instance is FAILED. What they check is what a client sees: the
instances that serve are never stopped while fewer than the deployment's count serve, and a
rollout is COMPLETE only once the new revision serves."""

from __future__ import annotations

import asyncio
import json

from controller.model.instances import READY
from motor.v1 import controller_pb2, types_pb2
from tests.support.controller_harness import Harness
from tests.support.rollout_checks import Cluster, stopped, summary, union

C, T = controller_pb2, types_pb2


async def cluster(tmp_path, deployment: C.Deployment) -> Cluster:
    h = Harness(tmp_path)
    await h.start()
    await h.register("node-a", accelerators=8)
    h.controller.apply_deployment(deployment)
    c = Cluster(h)
    await c.serve()
    assert all(inst.state == READY for inst in h.controller.instances.values())
    return c


async def test_a_fix_applied_while_a_bad_version_is_paused_keeps_the_only_serving_instance(tmp_path):
    c = await cluster(tmp_path, union(1, latency=10))
    h, ctl = c.h, c.h.controller
    try:
        ctl.apply_deployment(union(1, latency=20))  # v2: completes on u-1
        await c.serve(12)
        assert c.serving() == {"u-1"} and summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
        ctl.apply_deployment(union(1, latency=30))  # v3: its engines crash at start
        c.crash_on_start()
        await c.serve(4)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_PAUSED and c.serving() == {"u-1"}
        reason = summary(h).rollout_reason  # the crash, not what the restart waits for
        assert "engine u-0/rank0 " in reason and "exit" in reason and "waiting for" not in reason, reason
        before = stopped(h)
        ctl.apply_deployment(union(1, latency=40))  # v4, the fix
        await asyncio.sleep(0.05)
        assert "u-1" in ctl.instances and "u-1" not in stopped(h) - before, "the only serving instance was stopped"
        assert c.serving() == {"u-1"}
        for _ in range(6):  # while the fix loads, u-1 keeps serving
            await c.serve(1)
            assert c.serving(), "nothing served during the rollout of the fix"
        await c.serve(12)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
        assert {ctl.instances[i].revision for i in c.serving()} == {4}
    finally:
        await h.stop()


async def test_a_new_apply_in_the_middle_of_a_rollout_keeps_every_serving_instance(tmp_path):
    c = await cluster(tmp_path, union(2, latency=10))
    h, ctl = c.h, c.h.controller
    try:
        ctl.apply_deployment(union(2, latency=20))
        # Step until the rollout is half way: one new instance serves beside an old one.
        for _ in range(20):
            await c.serve(1)
            revisions = {ctl.instances[i].revision for i in c.serving()}
            if revisions == {1, 2}:
                break
        assert {ctl.instances[i].revision for i in c.serving()} == {1, 2}, "never half way"
        serving = c.serving()
        before = stopped(h)
        ctl.apply_deployment(union(2, latency=30))
        await asyncio.sleep(0.05)
        # At most the surge instance goes: count (2) still serve, all of them serving before.
        assert len(c.serving()) >= 2 and c.serving() <= serving
        assert len((stopped(h) - before) & serving) <= len(serving) - 2
        for _ in range(16):
            await c.serve(1)
            assert len(c.serving()) >= 2, "fewer than count - max_unavailable served"
        assert summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
        assert {ctl.instances[i].revision for i in c.serving()} == {3} and len(c.serving()) == 2
    finally:
        await h.stop()


async def test_a_scale_down_while_an_instance_is_failed_stops_the_failed_one(tmp_path):
    c = await cluster(tmp_path, union(2, latency=10, restart_policy={"max_failures": 1}))
    h, ctl = c.h, c.h.controller
    try:
        c.crash("u-0")
        h.beat("node-a")
        await asyncio.sleep(0.05)
        assert ctl.instances["u-0"].state == C.INSTANCE_STATE_FAILED
        before = stopped(h)
        ctl.apply_deployment(union(1, latency=10, restart_policy={"max_failures": 1}))
        await c.serve(2)
        assert set(ctl.instances) == {"u-1"} and c.serving() == {"u-1"}
        assert "u-1" not in stopped(h) - before
    finally:
        await h.stop()


async def test_complete_only_once_the_new_revision_serves(tmp_path):
    c = await cluster(tmp_path, union(1, latency=10))
    h, ctl = c.h, c.h.controller
    try:
        c.crash_on_start()  # v1 stops serving: nothing old to wait for
        await c.serve(2)
        assert not c.serving()
        ctl.apply_deployment(union(1, latency=20))
        for _ in range(6):  # the new engine starts but is never NORMAL
            ctl.reconcile_once()
            await asyncio.sleep(0.02)
            h.beat("node-a")
        assert not c.serving() and all(inst.revision == 2 for inst in ctl.instances.values())
        s = summary(h)
        assert s.rollout_state == C.ROLLOUT_STATE_PROGRESSING, "COMPLETE while nothing serves"
        assert "waiting for" in s.rollout_reason and s.available_instances == 0
        await c.serve(4)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE and c.serving()
        done = [e.message for e in ctl.events.recent if e.type == C.EVENT_TYPE_ROLLOUT][-1]
        assert "complete" in done and "available" in done
    finally:
        await h.stop()


def models_listed(c: Cluster) -> dict[str, tuple[str, ...]]:
    return {e.instance_id: tuple(e.models) for e in c.h.controller.list_endpoints(T.ROLE_UNSPECIFIED, "")}


async def test_a_renamed_model_s_old_engines_stay_under_the_old_name_until_they_go(tmp_path):
    c = await cluster(tmp_path, union(1, model="sim-a", strategy={"min_ready": "60s"}))
    h, ctl = c.h, c.h.controller
    try:
        ctl.apply_deployment(union(1, model="sim-b", strategy={"min_ready": "60s"}))
        await c.serve(3)  # the new one serves, not yet for min_ready: both are listed
        assert models_listed(c) == {"u-0": ("sim-a",), "u-1": ("sim-b",)}
        assert [e.instance_id for e in ctl.list_endpoints(T.ROLE_UNSPECIFIED, "sim-b")] == ["u-1"]
        await h.stop()  # a controller restart reads each instance's model back
        await h.start()
        await h.register("node-a", accelerators=8)
        await c.serve(3)
        assert models_listed(c) == {"u-0": ("sim-a",), "u-1": ("sim-b",)}
    finally:
        await h.stop()


async def test_a_deleted_and_reapplied_deployment_never_reuses_a_revision(tmp_path):
    h = Harness(tmp_path)
    await h.start()
    try:
        assert h.controller.apply_deployment(union(1, latency=10))[1] == 1
        assert h.controller.apply_deployment(union(1, latency=20))[1] == 2
        h.controller.delete_deployment("t")
        assert h.controller.apply_deployment(union(1, latency=30))[1] == 3
        h.controller.delete_deployment("t")
        await h.stop()  # remembered by the store
        await h.start()
        assert h.controller.apply_deployment(union(1, latency=40))[1] == 4
    finally:
        await h.stop()


async def test_pause_rollout_answers_once_the_pause_is_in_the_store(tmp_path):
    from controller.api.controllers import SingleController
    from controller.api.servicer import ControllerServicer

    h = Harness(tmp_path)
    ctl = await h.start()
    try:
        ctl.apply_deployment(union(1, latency=10))
        ctl.apply_deployment(union(1, latency=20))
        landed = asyncio.Event()

        async def flush() -> None:  # a store that writes from a task (etcd): lands when told
            await landed.wait()

        h.store.flush = flush
        answer = asyncio.ensure_future(
            ControllerServicer(SingleController(ctl)).PauseRollout(C.PauseRolloutRequest(name="t"), None)
        )
        await asyncio.sleep(0.05)
        assert not answer.done(), "PauseRollout answered before its write landed"
        landed.set()
        await asyncio.wait_for(answer, 5)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_PAUSED
    finally:
        await h.stop()


async def test_renaming_a_group_under_rolling_keeps_the_old_group_serving_until_the_new_one_does(tmp_path):
    c = await cluster(tmp_path, union(1, latency=10))
    h, ctl = c.h, c.h.controller
    try:
        renamed = union(1, latency=10)
        renamed.instance_groups[0].name = "v"
        ctl.apply_deployment(renamed)
        await asyncio.sleep(0.05)
        assert c.serving() == {"u-0"} and "u-0" not in stopped(h), "the old group stopped at once"
        assert summary(h).rollout_state == C.ROLLOUT_STATE_PROGRESSING and summary(h).old_instances == 1
        await h.stop()  # a controller restart keeps it the deployment's
        await h.start()
        await h.register("node-a", accelerators=8)
        ctl = h.controller
        for _ in range(12):
            await c.serve(1)
            assert c.serving(), "nothing served during the rename"
        assert c.serving() == {"v-0"} and set(ctl.instances) == {"v-0"}
        assert summary(h).rollout_state == C.ROLLOUT_STATE_COMPLETE
    finally:
        await h.stop()


def with_spare(latency: int) -> C.Deployment:
    deployment = union(2, latency=latency)
    deployment.instance_groups[0].spares = 1
    return deployment


async def test_with_spares_a_paused_bad_version_never_serves_and_the_ready_old_spare_is_kept(tmp_path):
    c = await cluster(tmp_path, with_spare(10))
    h, ctl = c.h, c.h.controller
    try:
        assert c.serving() == {"u-0", "u-1"} and ctl.instances["u-2"].spare
        ctl.apply_deployment(with_spare(30))  # a version whose engines crash at start
        c.crash_on_start()
        await asyncio.sleep(0.05)
        assert "u-2" in ctl.instances and "u-2" not in stopped(h), "the READY old-spec spare was stopped"
        await c.serve(4)
        assert summary(h).rollout_state == C.ROLLOUT_STATE_PAUSED
        c.crash("u-0")  # a serving engine dies: the old-spec spare, READY, takes its place
        h.beat("node-a")
        await asyncio.sleep(0.05)
        assert c.serving() == {"u-1", "u-2"}
        for _ in range(8):
            await c.serve(1)
            assert not {i for i in c.serving() if ctl.instances[i].spec_hash in c.bad}, "the bad version serves"
            assert len(c.serving()) >= 2
        ctl.apply_deployment(with_spare(40))  # the fix: rolled out, then the spares replaced
        await c.serve(24)
        s = summary(h)
        assert s.rollout_state == C.ROLLOUT_STATE_COMPLETE, s.rollout_reason
        assert {ctl.instances[i].revision for i in c.serving()} == {3}
        assert [i.revision for i in ctl.instances.values() if i.spare] == [3]
    finally:
        await h.stop()


async def test_a_new_instance_never_takes_the_id_of_one_whose_engines_are_still_stopping(tmp_path):
    c = await cluster(tmp_path, union(2, latency=10))
    h, ctl = c.h, c.h.controller
    try:
        stopping = asyncio.Event()

        async def slow_stop(node, engine_id, generation, deadline):  # an engine that drains for long
            h.client.calls.append(("stop", node.node_id, engine_id, generation, deadline))
            await stopping.wait()

        h.client.stop_engine = slow_stop
        ctl.apply_deployment(union(1, latency=10))  # u-1 goes; its engine drains
        await asyncio.sleep(0.05)
        assert set(ctl.instances) == {"u-0"} and "u-1" in stopped(h)
        ctl.apply_deployment(union(1, latency=20))
        ctl.reconcile_once()
        new = [i for i, inst in ctl.instances.items() if inst.revision == 3]
        assert new and "u-1" not in new, f"started {new} while u-1's engine is still stopping"
        stopping.set()
    finally:
        await h.stop()


async def test_an_old_instance_that_fails_while_a_bad_version_is_paused_restarts_on_its_own_spec(tmp_path):
    """Its engines start again with the engine_config of the revision it runs, not the paused bad
    one's (that turned a good instance into a crashing one); across a controller restart too."""
    c = await cluster(tmp_path, union(2, latency=10))
    h, ctl = c.h, c.h.controller

    def restarted_with(instance_id: str) -> dict:
        spec = h.client.starts(f"{instance_id}/rank0")[-1]
        return json.loads(spec.config_json)["motor_engine_union_config"]["engine_args"]

    try:
        ctl.apply_deployment(union(2, latency=20))
        c.crash_on_start()
        await c.serve_until_paused()
        starts = len(h.client.starts("u-0/rank0"))
        c.crash("u-0")
        await c.serve(3)
        assert len(h.client.starts("u-0/rank0")) > starts, "u-0 not restarted"
        assert restarted_with("u-0") == {"latency_ms": 10, "model": "sim-tiny"}
        assert ctl.instances["u-0"].state == READY and ctl.instances["u-0"].revision == 1
        await h.stop()  # a restarted controller reads each instance's engine_config back
        await h.start()
        await h.register("node-a", accelerators=8)
        await c.serve(2)
        starts = len(h.client.starts("u-1/rank0"))
        c.crash("u-1")
        await c.serve(3)
        assert len(h.client.starts("u-1/rank0")) > starts, "u-1 not restarted"
        assert restarted_with("u-1") == {"latency_ms": 10, "model": "sim-tiny"}
    finally:
        await h.stop()


async def test_a_spare_of_a_paused_bad_version_is_never_promoted_even_while_it_is_ready(tmp_path):
    """A bad version's new instance that a promotion turned into a spare is READY between its
    crashes: a serving instance that fails then (or is down when the bad spare comes up) is not
    replaced by it; the good version's instance restarts and serves again."""
    c = await cluster(tmp_path, with_spare(10))
    h, ctl = c.h, c.h.controller
    try:
        ctl.apply_deployment(with_spare(30))  # a version whose engines crash after start
        c.crash_on_start()
        await c.serve_until_paused()
        bad = [i for i, inst in ctl.instances.items() if inst.revision == 2]
        assert len(bad) == 1 and ctl.instances[bad[0]].spare, "the bad new instance is not the spare"
        bad_spare = bad[0]
        c.bad.clear()  # between two crashes the bad spare is up
        await c.serve(3)
        assert ctl.instances[bad_spare].state == READY and ctl.instances[bad_spare].spare
        good = sorted(c.serving())
        c.crash(good[0])  # a serving engine of the good version dies while the bad spare is READY
        h.beat("node-a")
        await asyncio.sleep(0.05)
        assert bad_spare not in c.serving() and ctl.instances[bad_spare].spare, "the paused bad version serves"
        await c.serve(4)
        assert c.serving() == set(good), "the good instance did not come back"
        # The other order: a serving instance is down when the bad spare becomes READY.
        c.crash_on_start()
        c.crashing.add(good[1])
        await c.serve(2)
        c.bad.clear()
        deadline = ctl.mono() + 30
        ready_while_down, after = False, 0
        while after < 3:  # restarts back off (1 s, 2 s): passes until the bad spare is up, and then some
            await c.serve(1)
            assert bad_spare not in c.serving(), "the paused bad version serves"
            ready_while_down |= ctl.instances[bad_spare].state == READY and ctl.instances[good[1]].state != READY
            after += ready_while_down
            assert ctl.mono() < deadline, "the bad spare never READY while a serving instance was down"
        assert ctl.instances[bad_spare].spare
    finally:
        await h.stop()
