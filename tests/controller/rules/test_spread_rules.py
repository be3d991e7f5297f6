"""A group's instances spread across nodes (as Kubernetes' topology spread, max skew 1 where room
allows): two instances on two empty nodes went both to one, whose loss took the model down.
`Fleet.best_fit`'s `spread` (the group's instances per node) picks, among the nodes with room, one
holding the fewest; packing (best fit) decides among equals and when nothing else fits."""

from __future__ import annotations

from controller.rules.placement import Fleet, NodeCapacity, place_instance


def nodes(*free: int, total: int = 4) -> list[NodeCapacity]:
    """Nodes a, b, c... with `free` free accelerators each (of `total`)."""
    return [
        NodeCapacity(chr(ord("a") + i), f"h{i}", tuple(range(total)), set(range(total - f))) for i, f in enumerate(free)
    ]


def test_two_instances_on_two_empty_nodes_go_one_to_each():
    fleet, spread = Fleet(nodes(4, 4)), {}
    for _ in range(2):
        (p,) = place_instance([0], 1, False, fleet, spread=spread)
        spread[p.node_id] = spread.get(p.node_id, 0) + 1
    assert spread == {"a": 1, "b": 1}


def test_the_node_holding_fewest_of_the_group_wins_over_the_fullest():
    fleet = Fleet(nodes(1, 3, 4))  # best fit alone: a
    assert fleet.best_fit(1, 2, spread={"a": 1, "b": 2}).node_id == "c"
    assert fleet.best_fit(1, 2, spread={"a": 1, "c": 1}).node_id == "b"


def test_among_nodes_holding_as_many_the_fullest_wins():
    fleet = Fleet(nodes(2, 1, 4))
    assert fleet.best_fit(1, 2, spread={"a": 1, "b": 1, "c": 1}).node_id == "b"
    assert fleet.best_fit(1, 2, spread={}).node_id == "b"


def test_it_packs_when_only_nodes_holding_more_have_room():
    fleet = Fleet(nodes(0, 3, 1))  # a, holding none, is full
    assert fleet.best_fit(1, 2, spread={"b": 2, "c": 2}).node_id == "c"
    assert fleet.best_fit(1, 2, spread={"b": 1, "c": 2}).node_id == "b"


def test_a_node_to_avoid_counts_before_the_spread():
    fleet = Fleet(nodes(4, 4))
    assert fleet.best_fit(1, 2, avoid=frozenset({"a"}), spread={"b": 3}).node_id == "b"
    assert fleet.best_fit(1, 2, avoid=frozenset({"a", "b"}), spread={"a": 2, "b": 1}).node_id == "b"


def test_the_ranks_of_one_instance_still_pack_onto_one_node():
    fleet = Fleet(nodes(4, 4))
    placed = place_instance([0, 1], 2, False, fleet, spread={"a": 1})
    assert {p.node_id for p in placed} == {"b"}


def test_a_node_without_free_ports_is_passed_over_for_the_next_with_room():
    short, roomy = nodes(1, 2)
    short.port_range, short.ports_in_use = (30000, 30001), 1  # one port left; an engine needs more
    assert Fleet([short, roomy]).best_fit(1, 2).node_id == roomy.node_id
