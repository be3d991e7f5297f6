"""A node's report is bounded and its fencing told once: a heartbeat or RegisterNode
listing more engines than one node may run is refused RESOURCE_EXHAUSTED naming
--max-engines-per-node, before anything is changed; the unknown copies one report fences are one
ENGINE_FENCED event with their count, not one event per copy."""

from __future__ import annotations

import asyncio

import pytest

from motor.errors import ResourceExhausted
from motor.v1 import controller_pb2 as C
from tests.support.controller_harness import Harness, made_up, node_info, small_deployment


@pytest.fixture
async def limited(tmp_path):
    h = Harness(tmp_path, max_engines_per_node=10)
    await h.start()
    # A deployment applied: a node's unknown copies are fenced, not kept for adoption.
    h.controller.apply_deployment(small_deployment([{"name": "u", "role": "union", "count": 1}]))
    yield h
    await h.stop()


def fenced_events(ctl):
    return [e for e in ctl.events.recent if e.type == C.EVENT_TYPE_ENGINE_FENCED]


async def test_a_heartbeat_over_the_limit_is_refused_naming_the_setting(limited):
    await limited.register("node-a")
    ctl, gen = limited.controller, limited.generations["node-a"]
    ctl.heartbeat("node-a", gen, made_up("node-a", 10))  # at the limit: taken
    assert len(ctl.nodes["node-a"].engines) == 10
    with pytest.raises(ResourceExhausted) as refused:
        ctl.heartbeat("node-a", gen, made_up("node-a", 11))
    assert "max_engines_per_node=10" in str(refused.value) and "--max-engines-per-node" in str(refused.value)
    assert "reports 11 engines" in str(refused.value)
    assert len(ctl.nodes["node-a"].engines) == 10  # nothing of the refused report was taken


async def test_a_delta_heartbeat_counts_what_the_node_would_run_after_it(limited):
    await limited.register("node-a")
    ctl, gen = limited.controller, limited.generations["node-a"]
    ctl.heartbeat("node-a", gen, made_up("node-a", 8))
    # 8 + 2 new = 10: taken; a change to a known engine is not a new one.
    ctl.heartbeat("node-a", gen, made_up("node-a", 2, start=8) + made_up("node-a", 1), delta=True)
    with pytest.raises(ResourceExhausted):
        ctl.heartbeat("node-a", gen, made_up("node-a", 1, start=10), delta=True)
    # One removed makes room for one new.
    ctl.heartbeat(
        "node-a", gen, made_up("node-a", 1, start=10), delta=True, removed=["zz0-0/rank0", "zz0-0/rank0", "nope/rank0"]
    )
    assert len(ctl.nodes["node-a"].engines) == 10


async def test_register_over_the_limit_is_refused(limited):
    ctl = limited.controller
    with pytest.raises(ResourceExhausted) as refused:
        await ctl.register_node(node_info("node-a"), made_up("node-a", 11))
    assert "max_engines_per_node=10" in str(refused.value)
    assert "node-a" not in ctl.nodes
    await ctl.register_node(node_info("node-a"), made_up("node-a", 10))
    assert "node-a" in ctl.nodes


async def test_unknown_copies_of_one_report_are_one_event_with_their_count(limited):
    await limited.register("node-a")
    ctl, gen = limited.controller, limited.generations["node-a"]
    before = len(fenced_events(ctl))
    ctl.heartbeat("node-a", gen, made_up("node-a", 9))
    events = fenced_events(ctl)[before:]
    assert len(events) == 1
    assert events[0].count == 9 and events[0].node_id == "node-a"
    assert "9 engines on node-a stopped: stale copies (zz0-0/rank0, zz1-0/rank0" in events[0].message
    assert "and 4 more" in events[0].message and "not part of the deployment" in events[0].message
    await asyncio.sleep(0.05)  # the stops run in the background: every copy is still stopped
    assert sorted(e for _, e, _ in limited.client.stops()) == sorted(e.engine_id for e in made_up("node-a", 9))
    # The next beat within the fence window asks nothing again and says nothing again.
    ctl.heartbeat("node-a", gen, made_up("node-a", 9))
    assert len(fenced_events(ctl)[before:]) == 1


async def test_a_single_unknown_copy_keeps_its_own_event(limited):
    await limited.register("node-a")
    ctl, gen = limited.controller, limited.generations["node-a"]
    before = len(fenced_events(ctl))
    ctl.heartbeat("node-a", gen, made_up("node-a", 1))
    events = fenced_events(ctl)[before:]
    assert len(events) == 1
    assert events[0].engine_id == "zz0-0/rank0" and events[0].instance_id == "zz0-0"
    assert (
        events[0].message
        == "engine zz0-0/rank0 on node-a stopped: stale copy (generation 1): it is not part of the deployment"
    )


async def test_register_fences_the_unknown_copies_it_lists_with_one_event(limited):
    ctl = limited.controller
    await ctl.register_node(node_info("node-a"), made_up("node-a", 3))
    events = fenced_events(ctl)
    assert len(events) == 1 and events[0].count == 3


def test_the_default_limit_is_generous_and_set_from_the_command_line():
    from controller.cli import parse_config

    assert parse_config(["--db", "/tmp/x.db"]).max_engines_per_node == 1024
    assert parse_config(["--db", "/tmp/x.db", "--max-engines-per-node", "7"]).max_engines_per_node == 7
