"""A controller whose store was lost (a new, empty database) under a running fleet: it keeps
what the nodes run, adopts what the first deployment describes, issues generations above what
the nodes report, and announces the generation limit (fake node-manager client, no processes)."""

from __future__ import annotations

import pytest

from controller.engines.generations import WINDOW
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import (
    NODES,
    Harness,
    _lose_the_store,
    example_deployment,
    node_info,
    running_example,
)


async def test_a_new_store_keeps_what_nodes_run_then_adopts_the_same_deployment(harness):
    await running_example(harness)
    running = await _lose_the_store(harness)
    highest = max(g for _, g in running.values())
    for node in NODES:
        reply = await harness.controller.register_node(node_info(node), harness.client.report(node))
        harness.generations[node] = reply.generation
        assert reply.keep_unassigned and not reply.assignments
        assert reply.generation > highest  # issued above every generation the nodes report
        assert reply.generation_limit == harness.store.last_generation() + WINDOW
    harness.beat(*NODES)
    harness.beat(*NODES)
    assert not harness.client.stops()  # nothing unknown is stopped while the store is new
    harness.controller.apply_deployment(example_deployment())
    harness.beat(*NODES)
    await async_wait_for(
        lambda: all(i.state == C.INSTANCE_STATE_READY for i in harness.controller.instances.values()),
        timeout=5,
        what="every instance READY with the adopted engines",
    )
    assert set(harness.controller.instances) == {"prefill-0", "decode-0"}
    assert not harness.client.starts() and not harness.client.stops()
    slots = {(s.node_id, s.engine_id): s.generation for s in harness.controller.state.slots.values()}
    assert slots == {k: g for k, (_, g) in running.items()}
    messages = [e.message for e in harness.controller.events.recent]
    assert any("adopted the engines the nodes run" in m for m in messages)
    assert any("2 instance(s) adopted" in m for m in messages)
    # The next reply says the wait is over; a restart takes a generation above everything.
    again = await harness.controller.register_node(node_info("node-a"), harness.client.report("node-a"))
    harness.generations["node-a"] = again.generation
    assert not again.keep_unassigned and again.assignments


async def test_copies_the_first_deployment_does_not_describe_are_stopped_and_started_anew(harness):
    await running_example(harness)
    running = await _lose_the_store(harness)
    for node in NODES:
        await harness.register(node)
    changed = example_deployment()  # another engine config: no copy runs as it describes
    changed.engine_config["motor_engine_decode_config"]["engine_args"] = {"latency_ms": 7}
    harness.controller.apply_deployment(changed)
    harness.beat(*NODES)
    await async_wait_for(
        lambda: len(harness.client.stops()) == 3 and len(harness.client.starts()) == 3,
        timeout=5,
        what="the three undescribed copies stopped and new ones started",
    )
    assert {e for _, e, _ in harness.client.stops()} == {e for _, e in running}
    assert min(s.generation for s in harness.client.starts()) > max(g for _, g in running.values())


async def test_delete_on_a_new_store_ends_the_wait(harness):
    await running_example(harness)
    await _lose_the_store(harness)
    for node in NODES:
        await harness.register(node)
    harness.controller.delete_deployment()
    harness.beat(*NODES)
    await async_wait_for(lambda: len(harness.client.stops()) == 3, timeout=5, what="every unknown copy stopped")
    await harness.stop()
    await harness.start()  # the store is not new any more: no wait after a restart
    assert not harness.controller.adoption.waiting


async def test_a_first_start_waits_and_a_stored_deployment_does_not(tmp_path):
    fresh = Harness(tmp_path)
    await fresh.start()
    assert fresh.controller.adoption.waiting
    fresh.controller.apply_deployment(example_deployment())
    assert not fresh.controller.adoption.waiting
    await fresh.stop()
    await fresh.start()
    assert not fresh.controller.adoption.waiting
    await fresh.stop()


async def test_a_generation_beyond_any_controller_is_refused_at_registration(harness):
    await harness.start()
    with pytest.raises(InvalidArgument, match="highest_generation: 4611686018427387904 is beyond"):
        await harness.controller.register_node(node_info("node-a"), [], 1 << 62)
    assert not harness.controller.state.nodes.get("node-a")


async def test_heartbeats_teach_generations_within_the_limit_only(harness):
    await harness.start()
    await harness.register("node-a")
    last = harness.store.last_generation()
    planted = T.Engine(
        engine_id="x-0/rank0", state=T.ENGINE_STATE_STOPPED, spec=T.EngineSpec(instance_id="x-0", generation=last + 50)
    )
    harness.controller.heartbeat("node-a", harness.generations["node-a"], [planted])
    assert harness.store.last_generation() == last + 51
    beyond = T.Engine(
        engine_id="y-0/rank0",
        state=T.ENGINE_STATE_STOPPED,
        spec=T.EngineSpec(instance_id="y-0", generation=last + 51 + WINDOW + 1),
    )
    harness.controller.heartbeat("node-a", harness.generations["node-a"], [beyond])
    assert harness.store.last_generation() == last + 51  # no node that checks the limit ran it
    assert harness.store.next_generation() == last + 52


async def test_an_instance_is_adopted_whole_or_not_at_all(harness):
    await running_example(harness)
    for engines in harness.client.engines.values():
        engines.pop("prefill-0/rank1", None)  # that rank's engine is gone: the group is started anew
    await _lose_the_store(harness)
    for node in NODES:
        await harness.register(node)
    harness.controller.apply_deployment(example_deployment())
    harness.beat(*NODES)
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="both prefill ranks started")
    assert {f"{s.instance_id}/rank{s.dp_rank}" for s in harness.client.starts()} == {
        "prefill-0/rank0",
        "prefill-0/rank1",
    }
    assert [e for _, e, _ in harness.client.stops()] == ["prefill-0/rank0"]  # the lone rank's copy
    # The surviving rank is replaced, and says so: one event naming it and why, and a restart counted.
    fenced = [e for e in harness.controller.events.recent if e.type == C.EVENT_TYPE_ENGINE_FENCED]
    assert [(e.instance_id, e.engine_id) for e in fenced] == [("prefill-0", "prefill-0/rank0")], fenced
    assert "rank 1 of prefill-0 is not running" in fenced[0].message, fenced[0].message
    assert "replaced" in fenced[0].message, fenced[0].message
    assert harness.controller.state.instances["prefill-0"].restarts == 1
