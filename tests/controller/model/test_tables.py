"""The controller's plain parts on their own: the node table (READY/SUSPECT/LOST transition
table and counts), the slot table (node index, placement, one reset per new generation), and
the actuator's stop de-duplication (its fencing map forgets old stops)."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from controller.engines.actuator import FENCE_WINDOW, Actuator
from controller.engines.node_client import NodeCallError
from controller.model.events import EventBus
from controller.model.instances import IllegalTransition
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeTable
from controller.model.slots import EngineSlot, SlotTable
from motor.errors import FailedPrecondition, NotFound
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support.controller_fakes import FakeNodeClient, ManualClock
from tests.support.controller_harness import node_info, runtime

# ---------------------------------------------------------------- node table


def test_the_sweep_reads_only_silent_ready_nodes_and_suspects():
    table = NodeTable()
    nodes = [runtime(f"node-{c}") for c in "abcd"]
    for node in nodes:
        table.put(node)  # last_seen 0
    for t, node in enumerate(nodes[1:], start=1):
        table.heard_from(node, float(t))  # b at 1, c at 2, d at 3
    table.heard_from(nodes[0], 4.0)  # a heard from last: now the newest
    assert [n.node_id for n in table.ready_silent(2.5, 0.0)] == ["node-b", "node-c"]
    table.set_state(nodes[1], NODE_SUSPECT, "silent")
    assert [n.node_id for n in table.ready_silent(2.5, 0.0)] == ["node-c"]
    assert [n.node_id for n in table.suspects()] == ["node-b"]
    nodes[1].last_seen = 5.0
    table.set_state(nodes[1], NODE_READY, "back")  # back: the newest, no longer a suspect
    assert [n.node_id for n in table.ready_silent(4.5, 0.0)] == ["node-c", "node-d", "node-a"]
    assert table.suspects() == []
    table.set_state(nodes[2], NODE_SUSPECT, "silent")
    table.set_state(nodes[2], NODE_LOST, "lost")
    assert table.suspects() == [] and "node-c" not in [n.node_id for n in table.ready_silent(10.0, 0.0)]


def test_node_states_follow_the_table_and_the_counts_follow_the_states():
    table = NodeTable()
    a, b = runtime("node-a"), runtime("node-b")
    table.put(a)
    table.put(b)
    assert table.counts() == {NODE_READY: 2, NODE_SUSPECT: 0, NODE_LOST: 0}
    table.set_state(a, NODE_SUSPECT, "silent")
    assert (a.state, a.reason) == (NODE_SUSPECT, "silent")
    assert table.silent_share() == (1, 2)
    table.set_state(a, NODE_LOST, "re-check failed")
    assert table.counts() == {NODE_READY: 1, NODE_SUSPECT: 0, NODE_LOST: 1}
    assert table.silent_share() == (0, 1)  # a LOST node is neither silent nor active
    table.put(runtime("node-a", generation=5))  # registers again: a new record, READY
    assert table["node-a"].generation == 5 and table.counts() == {NODE_READY: 2, NODE_SUSPECT: 0, NODE_LOST: 0}
    table.set_state(b, NODE_SUSPECT, "silent")
    table.set_state(b, NODE_READY, "heartbeats arrived again")
    assert table.count(NODE_READY) == 2 and len(table) == 2 and sorted(table) == ["node-a", "node-b"]


@pytest.mark.parametrize(
    "path, forbidden",
    [
        ([], NODE_LOST),  # READY -> LOST: a node is re-checked (SUSPECT) before it is lost
        ([NODE_SUSPECT], NODE_SUSPECT),
        ([NODE_SUSPECT, NODE_LOST], NODE_SUSPECT),  # a lost node comes back only by registering
        ([NODE_SUSPECT, NODE_LOST], NODE_LOST),
    ],
)
def test_forbidden_node_transitions_raise_and_change_nothing(path, forbidden):
    table = NodeTable()
    node = runtime("node-a")
    table.put(node)
    for state in path:
        table.set_state(node, state, "step")
    before = (node.state, node.reason, table.counts())
    with pytest.raises(IllegalTransition, match="node node-a: "):
        table.set_state(node, forbidden, "not allowed")
    assert (node.state, node.reason, table.counts()) == before


def test_a_node_is_known_ready_or_lost_and_a_new_record_keeps_the_table():
    table = NodeTable()
    table.put(runtime("node-a", NODE_LOST))
    with pytest.raises(IllegalTransition, match="new -> SUSPECT"):
        table.put(runtime("node-b", NODE_SUSPECT))
    with pytest.raises(IllegalTransition, match="LOST -> LOST"):
        table.put(runtime("node-a", NODE_LOST))
    assert "node-b" not in table and table.counts() == {NODE_READY: 0, NODE_SUSPECT: 0, NODE_LOST: 1}


def test_membership_needs_the_current_generation():
    table = NodeTable()
    node = runtime("node-a", generation=3)
    table.put(node)
    assert table.member("node-a", 3) is node
    with pytest.raises(NotFound, match="node_id 'node-x' is not registered"):
        table.member("node-x", 3)
    with pytest.raises(
        FailedPrecondition, match="^generation 2 of node .node-a. is stale \\(current 3\\); register again"
    ):
        table.member("node-a", 2)
    table.set_state(node, NODE_SUSPECT, "silent")
    table.set_state(node, NODE_LOST, "gone")
    with pytest.raises(FailedPrecondition, match="node declared lost"):
        table.member("node-a", 2)


# ---------------------------------------------------------------- slot table


def observed(slot: EngineSlot) -> EngineSlot:
    """What a node's report leaves on a slot."""
    slot.port, slot.mgmt_port, slot.kv_port, slot.dp_rpc_port = 21000, 21001, 21002, 21003
    slot.launched, slot.handled_failure_generation = True, slot.generation
    slot.state, slot.health, slot.health_reason = T.ENGINE_STATE_RUNNING, T.HEALTH_STATUS_ABNORMAL, "slow"
    return slot


def assert_no_copy_known(slot: EngineSlot) -> None:
    assert (slot.port, slot.mgmt_port, slot.kv_port, slot.dp_rpc_port, slot.launched) == (0, 0, 0, 0, False)
    assert (slot.state, slot.health, slot.health_reason) == (
        T.ENGINE_STATE_UNSPECIFIED,
        T.HEALTH_STATUS_UNSPECIFIED,
        "",
    )


def test_placing_indexes_the_slot_by_node_as_a_new_generation():
    table = SlotTable()
    slot = EngineSlot("u-0/rank0", "u-0", 0, moved=True)
    table.add(slot)
    assert table.on_node("node-a") == []
    table.place(slot, "node-a", "10.0.0.1", [2, 3], 4, generation=7)
    assert (slot.node_id, slot.host, slot.accelerator_ids, slot.requested_ports) == (
        "node-a",
        "10.0.0.1",
        (2, 3),
        (0, 0, 0, 0),
    )
    assert slot.generation == 7 and not slot.moved
    assert table.on_node("node-a") == [slot] and table.used_accelerators("node-a") == {2, 3}
    assert_no_copy_known(slot)


def test_unplacing_leaves_the_node_index_and_forgets_the_copy():
    table = SlotTable()
    slot = EngineSlot("u-0/rank0", "u-0", 0, node_id="node-a", host="h", accelerator_ids=[1], generation=4, restarts=2)
    table.add(slot)  # loaded from the store already placed
    assert table.on_node("node-a") == [slot]
    table.unplace(observed(slot), moved=True)
    assert table.on_node("node-a") == [] and table.used_accelerators("node-a") == set()
    assert (slot.node_id, slot.host, slot.accelerator_ids, slot.requested_ports, slot.moved) == ("", "", (), (), True)
    assert slot.generation == 4 and slot.restarts == 2  # what is persisted about the rank stays
    assert_no_copy_known(slot)


def test_new_generation_keeps_the_place_and_forgets_the_last_copy():
    table = SlotTable()
    slot = EngineSlot("u-0/rank0", "u-0", 0)
    table.add(slot)
    table.place(slot, "node-a", "h", [0], 2, generation=3)
    observed(slot)
    table.new_generation(slot, 9)
    assert (slot.node_id, slot.accelerator_ids, slot.generation, slot.handled_failure_generation) == (
        "node-a",
        (0,),
        9,
        0,
    )
    assert_no_copy_known(slot)
    assert table.on_node("node-a") == [slot]


def test_slots_by_instance_by_node_and_removal():
    table = SlotTable()
    slots = [EngineSlot(f"p-0/rank{r}", "p-0", r, node_id="node-b" if r else "node-a") for r in range(3)]
    for s in slots:
        table.add(s)
    table.add(EngineSlot("q-0/rank0", "q-0", 0, node_id="node-b"))
    assert table.of_instance("p-0", 3) == slots and table.of_instance("p-0", 2) == slots[:2]
    assert [s.engine_id for s in table.on_node("node-b")] == ["p-0/rank1", "p-0/rank2", "q-0/rank0"]
    assert table.remove("p-0/rank2") is slots[2]
    assert [s.engine_id for s in table.on_node("node-b")] == ["p-0/rank1", "q-0/rank0"]
    assert table.of_instance("p-0", None) == slots[:2]  # the instance is gone: found by scanning
    assert "p-0/rank2" not in table and len(table) == 3


def test_ports_the_node_picked_are_adopted_once():
    slot = EngineSlot("u-0/rank0", "u-0", 0)
    spec = T.EngineSpec(port=21000, mgmt_port=21001, kv_port=21002, dp_rpc_port=21003)
    assert slot.adopt_ports(spec)
    assert (slot.port, slot.mgmt_port, slot.kv_port, slot.dp_rpc_port) == (21000, 21001, 21002, 21003)
    assert not slot.adopt_ports(spec)  # unchanged: nothing to save
    assert not slot.adopt_ports(T.EngineSpec()) and slot.port == 21000  # a report without ports keeps them


def test_persisted_fields_round_trip_and_observations_do_not():
    slot = observed(
        EngineSlot("u-0/rank0", "u-0", 0, node_id="node-a", generation=5, restarts=1, last_failure_reason="x")
    )
    again = EngineSlot.from_dict(slot.to_dict())
    assert (again.node_id, again.generation, again.restarts, again.last_failure_reason, again.port) == (
        "node-a",
        5,
        1,
        "x",
        21000,
    )
    assert not again.launched and again.state == T.ENGINE_STATE_UNSPECIFIED


def test_a_stored_slot_keeps_its_ports_and_accelerators_as_tuples():
    # The store keeps JSON (lists); in memory they are tuples, which the garbage collector does not track.
    slot = EngineSlot("u-0/rank0", "u-0", 0, node_id="node-a", requested_ports=(0, 0), accelerator_ids=(2, 3))
    again = EngineSlot.from_dict(json.loads(json.dumps(slot.to_dict())))
    assert (again.requested_ports, again.accelerator_ids) == ((0, 0), (2, 3))
    gc.collect()
    assert not gc.is_tracked(again.requested_ports) and not gc.is_tracked(again.accelerator_ids)


# ---------------------------------------------------------------- actuator


async def test_a_copy_is_asked_to_stop_once_per_window_and_old_stops_are_forgotten():
    client, clock, events = FakeNodeClient(), ManualClock(), EventBus()
    nodes = NodeTable()
    nodes.put(runtime("node-a"))
    tasks: list[asyncio.Task] = []
    actuator = Actuator(client, nodes, 5.0, lambda coro, name: tasks.append(asyncio.create_task(coro)), events, clock)
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy", fence=True)
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy", fence=True)  # asked already
    await asyncio.gather(*tasks)
    assert client.stops() == [("node-a", "u-0/rank0", 3)]
    assert [e.type for e in events.recent] == [C.EVENT_TYPE_ENGINE_FENCED]
    clock.advance(FENCE_WINDOW / 2)
    actuator.stop_copy("node-a", "u-1/rank0", 4, "removed")
    assert len(actuator.fencing) == 2
    clock.advance(FENCE_WINDOW / 2)
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy")  # the window passed: asked again
    await asyncio.gather(*tasks)
    assert client.stops()[-1] == ("node-a", "u-0/rank0", 3) and len(client.stops()) == 3
    clock.advance(FENCE_WINDOW)
    actuator.stop_copy("node-a", "u-2/rank0", 5, "removed")
    assert list(actuator.fencing) == [("node-a", "u-2/rank0", 5)]  # the map does not grow with every stop
    await asyncio.gather(*tasks)


async def test_a_failed_stop_is_asked_again_after_a_backoff():
    client, clock = FakeNodeClient(), ManualClock()
    nodes = NodeTable()
    nodes.put(runtime("node-a"))
    tasks: list[asyncio.Task] = []
    actuator = Actuator(
        client, nodes, 5.0, lambda coro, name: tasks.append(asyncio.create_task(coro)), EventBus(), clock
    )
    client.unreachable.add("node-a")
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy")
    await asyncio.gather(*tasks)
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy")  # the next heartbeat: within the backoff
    await asyncio.gather(*tasks)
    assert len(client.stops()) == 1
    clock.advance(1.0)  # the first backoff (1 s) passed
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy")
    await asyncio.gather(*tasks)
    assert len(client.stops()) == 2
    clock.advance(1.0)  # the second backoff is 2 s
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy")
    await asyncio.gather(*tasks)
    assert len(client.stops()) == 2


async def test_start_over_an_older_copy_stops_it_then_starts_once_more():
    client = FakeNodeClient()
    actuator = Actuator(client, NodeTable(), 5.0, lambda coro, name: None, EventBus(), ManualClock())
    client.start_errors["u-0/rank0"] = NodeCallError("ALREADY_EXISTS", "u-0/rank0 runs generation 6")
    spec = T.EngineSpec(instance_id="u-0", dp_rank=0, generation=7)
    engine = await actuator.start(node_info("node-a"), "u-0/rank0", spec)
    assert engine.spec.generation == 7
    assert [c[0] for c in client.calls] == ["start", "stop", "start"] and client.stops() == [("node-a", "u-0/rank0", 6)]


# ---------------------------------------------------------------- metrics


def test_metrics_read_the_state_counts_through_callables():
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics

    table = NodeTable()
    table.put(runtime("node-a"))
    table.put(runtime("node-b"))
    table.set_state(table["node-b"], NODE_SUSPECT, "silent")
    metrics = ControllerMetrics(table.counts, lambda: {C.INSTANCE_STATE_READY: 3})
    text = generate_latest(metrics.registry).decode()
    assert 'motor_controller_nodes{state="READY"} 1.0' in text and 'motor_controller_nodes{state="SUSPECT"} 1.0' in text
    assert 'motor_controller_nodes{state="LOST"} 0.0' in text
    assert (
        'motor_controller_instances{state="READY"} 3.0' in text
        and 'motor_controller_instances{state="FAILED"} 0.0' in text
    )


# ---------------------------------------------------------------- what the placement view re-reads


def test_the_slot_table_notes_every_node_whose_slots_changed_and_nothing_else():
    table = SlotTable()
    table.add(EngineSlot("u-0/rank0", "u-0", 0))  # unplaced: no node's room changed
    assert table.room_changed == set()
    table.add(EngineSlot("u-1/rank0", "u-1", 0, node_id="node-a"))
    assert table.room_changed == {"node-a"}
    table.room_changed.clear()
    slot = table["u-0/rank0"]
    table.place(slot, "node-b", "h", [0], 2, generation=3)
    assert table.room_changed == {"node-b"}
    table.room_changed.clear()
    table.new_generation(slot, 4)  # same place, same room
    table.place(slot, "node-c", "h", [1], 2, generation=5)  # moved: both nodes
    assert table.room_changed == {"node-b", "node-c"} and table.on_node("node-b") == []
    table.room_changed.clear()
    table.unplace(slot, moved=True)
    assert table.room_changed == {"node-c"}
    table.room_changed.clear()
    table.remove("u-0/rank0")  # unplaced already: nothing
    assert table.room_changed == set()
    table.remove("u-1/rank0")
    assert table.room_changed == {"node-a"} and table.on_node("node-a") == []


def test_the_node_table_notes_registrations_and_state_changes_not_heartbeats():
    table = NodeTable()
    node = runtime("node-a")
    table.put(node)
    assert table.room_changed == {"node-a"}
    table.room_changed.clear()
    table.heard_from(node, 5.0)
    assert table.room_changed == set()
    table.set_state(node, NODE_SUSPECT, "silent")
    assert table.room_changed == {"node-a"}


def test_a_fleet_takes_a_node_in_or_replaces_it_and_drops_it():
    from controller.rules.placement import Fleet, NodeCapacity

    fleet = Fleet([NodeCapacity("a", "h", [0, 1])])
    fleet.put(NodeCapacity("b", "h", [0, 1, 2, 3]))
    assert [key[2] for key in fleet.order] == ["a", "b"]
    fleet.put(NodeCapacity("a", "h", [0, 1, 2, 3, 4, 5]))  # a replaced: once, with its new room
    assert [(free, node) for free, _, node in fleet.order] == [(4, "b"), (6, "a")] and set(fleet.nodes) == {"a", "b"}
    assert fleet.best_fit(5, 2).node_id == "a"
    fleet.drop("a")
    fleet.drop("unknown")
    assert list(fleet.nodes) == ["b"] and [(free, node) for free, _, node in fleet.order] == [(4, "b")]
    assert fleet.best_fit(5, 2) is None
