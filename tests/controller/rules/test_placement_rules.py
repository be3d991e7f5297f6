"""Placement, rule by rule: ports, accelerators and the fleet description (controller/rules/placement.py).

Each test pins a boundary or a message a user relies on (they keep `make mutation` honest)."""

from __future__ import annotations

import pytest

from controller.rules.placement import Fleet, NodeCapacity, RankPlacement, Unplaceable, place_instance

# ---------------------------------------------------------------- placement


def test_a_port_range_counts_its_ends():
    assert NodeCapacity("a", "h", [], port_range=(100, 103)).free_port_count() == 4
    assert NodeCapacity("a", "h", [], port_range=(100, 103), ports_in_use=3).free_port_count() == 1


def test_a_node_with_exactly_the_ports_needed_fits():
    nodes = [NodeCapacity("a", "10.0.0.1", [0], port_range=(100, 101))]
    assert place_instance([3], 1, False, nodes) == [RankPlacement(3, "a", "10.0.0.1", (0,), 2)]
    assert nodes[0].ports_in_use == 2


def test_an_engine_publishing_kv_events_needs_a_third_port():
    nodes = [NodeCapacity("a", "10.0.0.1", [0, 1], port_range=(100, 102))]
    with pytest.raises(Unplaceable, match="needs 1 accelerator\\(s\\) and 3 port\\(s\\)"):
        place_instance([0], 1, False, [NodeCapacity("a", "h", [0], port_range=(100, 101))], kv_events=True)
    (placed,) = place_instance([0], 1, False, nodes, kv_events=True)
    assert placed.port_count == 3 and nodes[0].ports_in_use == 3


def test_ports_taken_add_up_and_a_failed_placement_gives_back_only_its_own():
    node = NodeCapacity("a", "h", [0, 1, 2], port_range=(100, 109))
    fleet = Fleet([node])
    place_instance([0], 1, False, fleet)
    place_instance([0], 1, False, fleet)
    assert node.ports_in_use == 4 and node.free_port_count() == 6
    with pytest.raises(Unplaceable):
        place_instance([0, 1], 1, False, fleet)  # rank 0 fits, rank 1 does not
    assert node.ports_in_use == 4 and node.used_accelerators == {0, 1}


def test_the_fleet_describes_its_roomiest_node():
    assert Fleet([]).describe() == "no READY node is registered"
    with pytest.raises(Unplaceable, match=r"^no READY node is registered$"):
        place_instance([0], 1, False, [])
    nodes = [NodeCapacity("a", "h", [0, 1, 2, 3], used_accelerators={0}, port_range=(100, 105)),
             NodeCapacity("b", "h", [0, 1])]  # fmt: skip
    assert Fleet(nodes).describe() == "2 READY node(s); most free: a with 3/4 accelerators and 6 ports"


def test_a_rank_that_fits_nowhere_says_what_it_needs_and_what_the_fleet_has():
    """The whole PENDING reason an operator reads, not a fragment of it."""
    nodes = [NodeCapacity("a", "10.0.0.1", [0], port_range=(100, 101))]
    with pytest.raises(Unplaceable) as unplaceable:
        place_instance([0], 2, False, nodes)
    assert str(unplaceable.value) == (
        "rank 0 needs 2 accelerator(s) and 2 port(s) on one READY node; none has room "
        "(1 READY node(s); most free: a with 1/1 accelerators and 2 ports)"
    )


def test_a_spare_avoids_the_nodes_it_is_told_to_while_another_has_room():
    """The fullest node with room wins, unless it is to be avoided (a node holding its group's
    serving instances) and another has room; only then does it fall back to an avoided one."""
    fullest = NodeCapacity("a", "10.0.0.1", [0, 1, 2, 3], used_accelerators={0, 1, 2})
    roomy = NodeCapacity("b", "10.0.0.2", [0, 1, 2, 3])
    assert place_instance([0], 1, False, [fullest, roomy])[0].node_id == "a"
    fullest = NodeCapacity("a", "10.0.0.1", [0, 1, 2, 3], used_accelerators={0, 1, 2})
    roomy = NodeCapacity("b", "10.0.0.2", [0, 1, 2, 3])
    assert place_instance([0], 1, False, [fullest, roomy], avoid=frozenset({"a"}))[0].node_id == "b"
    full = NodeCapacity("b", "10.0.0.2", [0, 1], used_accelerators={0, 1})
    fullest = NodeCapacity("a", "10.0.0.1", [0, 1, 2, 3], used_accelerators={0, 1, 2})
    assert place_instance([0], 1, False, [fullest, full], avoid=frozenset({"a"}))[0].node_id == "a"
    both = [NodeCapacity("a", "h", [0, 1], used_accelerators={0}), NodeCapacity("c", "h", [0, 1, 2])]
    assert Fleet(both).best_fit(1, 2, avoid=frozenset({"a", "c"})).node_id == "a"  # the fullest of the avoided
