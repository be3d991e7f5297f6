"""The node and slot tables' remaining rules, one at a time: exact messages, and the index when a
slot is placed again, or is removed or unplaced while on no node (plain data; written to kill the
mutants `make mutation` found)."""

from __future__ import annotations

import pytest

from controller.model.instances import IllegalTransition
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeTable
from controller.model.slots import EngineSlot, SlotTable
from motor.errors import FailedPrecondition
from tests.support.controller_harness import runtime


def test_a_stale_heartbeat_of_a_lost_node_is_told_so_exactly():
    table = NodeTable()
    node = runtime("node-a", generation=3)
    table.put(node)
    table.set_state(node, NODE_SUSPECT, "silent")
    table.set_state(node, NODE_LOST, "gone")
    with pytest.raises(FailedPrecondition) as error:
        table.member("node-a", 2)
    assert str(error.value) == "generation 2 of node 'node-a' is stale (current 3, node declared lost); register again"


def test_a_heartbeat_of_a_generation_ahead_of_the_current_one_is_not_called_stale():
    table = NodeTable()
    table.put(runtime("node-a", generation=1))
    with pytest.raises(FailedPrecondition) as error:
        table.member("node-a", 2**64 - 1)
    assert str(error.value) == (
        "generation 18446744073709551615 of node 'node-a' is ahead of the current one (1): "
        "this controller never issued it; register again"
    )


def test_a_refused_record_names_its_node():
    table = NodeTable()
    with pytest.raises(IllegalTransition) as error:
        table.put(runtime("node-b", NODE_SUSPECT))
    assert str(error.value) == "node node-b: new -> SUSPECT is not allowed"
    assert table.count(NODE_READY) == 0


def placed(table: SlotTable, engine_id: str, node_id: str, accelerators: list[int]) -> EngineSlot:
    slot = EngineSlot(engine_id, engine_id.split("/")[0], 0)
    table.add(slot)
    table.place(slot, node_id, "10.0.0.1", accelerators, 2, generation=1)
    return slot


def test_placing_a_placed_slot_again_moves_it_in_the_index():
    table = SlotTable()
    slot = placed(table, "p-0/rank0", "node-a", [0])
    table.place(slot, "node-b", "10.0.0.2", [1], 2, generation=2)
    assert table.on_node("node-a") == [] and list(table.placed_on("node-a")) == []
    assert table.on_node("node-b") == [slot] and table.used_accelerators("node-b") == {1}


def test_a_node_without_slots_has_none():
    table = SlotTable()
    placed(table, "p-0/rank0", "node-a", [0])
    assert list(table.placed_on("node-x")) == [] and table.used_accelerators("node-x") == set()


def test_a_slot_on_no_node_can_be_removed_and_unplaced():
    table = SlotTable()
    slot = EngineSlot("p-0/rank0", "p-0", 0)
    table.add(slot)
    table.unplace(slot, moved=False)
    assert slot.node_id == "" and not slot.moved
    assert table.remove("p-0/rank0") is slot and "p-0/rank0" not in table


def test_a_new_generation_forgets_what_the_last_copy_said_of_its_stop():
    table = SlotTable()
    slot = placed(table, "p-0/rank0", "node-a", [0])
    slot.draining, slot.sleeping, slot.stop_grace = True, True, 12.5
    slot.not_serving_reason = "no progress for 3.0 s with 2 requests in flight"
    table.new_generation(slot, 2)
    assert (slot.draining, slot.sleeping, slot.stop_grace, slot.not_serving_reason) == (False, False, 0.0, "")


def test_a_node_heard_from_exactly_at_the_cutoff_is_not_silent():
    table = NodeTable()
    early, on_time = runtime("node-a"), runtime("node-b")
    early.last_seen, on_time.last_seen = 9.0, 10.0
    table.put(early)
    table.put(on_time)
    assert [n.node_id for n in table.ready_silent(10.0, 0.0)] == ["node-a"]


def test_time_the_controller_was_away_moves_ready_and_suspect_clocks_forward_by_that_much():
    table = NodeTable()
    ready, suspect = runtime("node-a"), runtime("node-b")
    ready.last_seen = 9.0
    table.put(ready)
    table.put(suspect)
    table.set_state(suspect, NODE_SUSPECT, "silent")
    suspect.last_seen, suspect.suspect_since = 5.0, 7.0
    table.not_counting(3.0)
    assert (ready.last_seen, suspect.suspect_since) == (12.0, 10.0)
    assert suspect.last_seen == 5.0  # a SUSPECT node's own clock is its suspicion
    assert [n.node_id for n in table.ready_silent(12.0, 0.0)] == []
    assert [n.node_id for n in table.ready_silent(12.5, 0.0)] == ["node-a"]


def test_each_node_is_judged_by_the_grace_it_was_last_told():
    table = NodeTable()
    short, long, untold = runtime("node-a"), runtime("node-b"), runtime("node-c")
    for node in (short, long, untold):
        table.put(node)  # all heard from at 0
    table.told(short, 1.0, 5.0)
    table.told(long, 4.0, 20.0)
    assert (short.told_interval, short.told_grace, long.told_interval, long.told_grace) == (1.0, 5.0, 4.0, 20.0)
    # A node told nothing is held to the grace given for those (here 30 s).
    assert [n.node_id for n in table.ready_silent(10.0, 30.0)] == ["node-a"]
    assert sorted(n.node_id for n in table.ready_silent(25.0, 30.0)) == ["node-a", "node-b"]
    assert sorted(n.node_id for n in table.ready_silent(31.0, 30.0)) == ["node-a", "node-b", "node-c"]
    # Told a longer grace, it is judged by that one from then on, and listed once.
    table.told(short, 4.0, 20.0)
    assert [n.node_id for n in table.ready_silent(10.0, 30.0)] == []
    assert sorted(n.node_id for n in table.ready_silent(31.0, 30.0)) == ["node-a", "node-b", "node-c"]


def test_a_suspect_node_told_a_grace_stays_out_of_the_ready_sweep():
    table = NodeTable()
    node = runtime("node-a")
    table.put(node)
    table.set_state(node, NODE_SUSPECT, "silent")
    table.told(node, 1.0, 5.0)
    assert node.told_grace == 5.0
    assert list(table.ready_silent(100.0, 1.0)) == []
