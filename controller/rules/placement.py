"""Placement: the ranks of one instance onto READY nodes by free accelerators and ports.

Plain data and functions, so the policy is tested without nodes or gRPC. A group spreads: each
rank goes to a node holding the fewest of its group's other instances (as Kubernetes' topology
spread: a node's loss takes as few of a model's instances as room allows). Among those, best fit:
the node left with the fewest free accelerators (ties: fewest free ports, then node id), which
keeps large holes free for large engines; a group packs only when no emptier node has room.
`Fleet` keeps the nodes ordered by free room so that one placement costs O(log n) on fleets of
thousands of nodes (a group spread over most of them scans further); `put` and `drop` let
the controller keep one Fleet between passes (controller/capacity/fleet_view.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class NodeCapacity:
    node_id: str
    host: str
    accelerator_ids: Sequence[int]  # a tuple in the controller (untracked by the garbage collector)
    used_accelerators: set[int] = field(default_factory=set)
    # Inclusive range of engine ports; (0, 0) when the node manager has no declared range.
    port_range: tuple[int, int] = (0, 0)
    # Ports of the range held by engines placed here (the node manager picks the numbers).
    ports_in_use: int = 0

    @property
    def free_accelerators(self) -> list[int]:
        return [a for a in self.accelerator_ids if a not in self.used_accelerators]

    @property
    def has_port_range(self) -> bool:
        return self.port_range[0] > 0

    def free_port_count(self) -> int:
        if not self.has_port_range:
            return 1 << 30
        start, end = self.port_range
        return (end - start + 1) - self.ports_in_use


@dataclass(frozen=True)
class RankPlacement:
    dp_rank: int
    node_id: str
    host: str
    accelerator_ids: tuple[int, ...]
    # Ports the engine takes from the node's range: port and mgmt_port, plus kv_port and
    # dp_rpc_port in single-container mode. The node manager picks the numbers (it knows which
    # ports are free on its host) and StartEngine's answer tells them.
    port_count: int


class Unplaceable(Exception):
    """The instance does not fit now; the message says why (shown as the PENDING reason)."""


def ports_per_engine(single_container: bool, kv_events: bool) -> int:
    """Ports a node manager hands one engine: inference and management, the KV-transfer and
    data-parallel RPC ports in single-container mode, one more for its KV events (--kv-events)."""
    return (4 if single_container else 2) + kv_events


class Fleet:
    """READY nodes ordered by (free accelerators, free ports, node id)."""

    def __init__(self, nodes: list[NodeCapacity]):
        self.nodes = {n.node_id: n for n in nodes}
        self.order = sorted(self._key(n) for n in nodes)

    @staticmethod
    def _key(n: NodeCapacity) -> tuple[int, int, str]:
        return (len(n.accelerator_ids) - len(n.used_accelerators), n.free_port_count(), n.node_id)

    def put(self, node: NodeCapacity) -> None:
        """Add a node, or replace what the fleet knew of it."""
        self.drop(node.node_id)
        self.nodes[node.node_id] = node
        bisect.insort(self.order, self._key(node))

    def drop(self, node_id: str) -> None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            del self.order[bisect.bisect_left(self.order, self._key(node))]

    def best_fit(
        self,
        accelerators: int,
        ports: int,
        avoid: frozenset[str] = frozenset(),
        spread: Mapping[str, int] | None = None,
    ) -> NodeCapacity | None:
        """Of the nodes with room: one not in `avoid` if any, then one holding the fewest of
        `spread` (the group's instances by node), then the fullest."""
        i = bisect.bisect_left(self.order, (accelerators, -1, ""))
        best, best_key = None, None
        for j in range(i, len(self.order)):
            _, free_ports, node_id = self.order[j]
            if free_ports < ports:
                continue
            key = (node_id in avoid, spread.get(node_id, 0) if spread else 0)
            if best_key is None or key < best_key:
                best, best_key = node_id, key
                if key == (False, 0):
                    break  # nothing beats it: the scan stops at the first such node (O(log n) on a new group)
        return self.nodes[best] if best is not None else None

    def _update(self, node: NodeCapacity, change) -> None:
        key = self._key(node)
        del self.order[bisect.bisect_left(self.order, key)]
        change()
        bisect.insort(self.order, self._key(node))

    def take(self, node: NodeCapacity, accelerators: tuple[int, ...], ports: int) -> None:
        def change():
            node.used_accelerators.update(accelerators)
            node.ports_in_use += ports

        self._update(node, change)

    def give_back(self, node: NodeCapacity, accelerators: tuple[int, ...], ports: int) -> None:
        def change():
            node.used_accelerators.difference_update(accelerators)
            node.ports_in_use -= ports

        self._update(node, change)

    def describe(self) -> str:
        if not self.order:
            return "no READY node is registered"
        free, ports, node_id = self.order[-1]
        node = self.nodes[node_id]
        most = f"most free: {node_id} with {free}/{len(node.accelerator_ids)} accelerators"
        if node.has_port_range:
            most += f" and {ports} ports"
        return f"{len(self.order)} READY node(s); {most}"


def place_instance(
    ranks: list[int],
    accelerators_per_engine: int,
    single_container: bool,
    fleet: Fleet | list[NodeCapacity],
    avoid: frozenset[str] = frozenset(),
    spread: Mapping[str, int] | None = None,
    kv_events: bool = False,
) -> list[RankPlacement]:
    """Place `ranks`, on nodes other than `avoid` where they have room, spread from the group's
    other instances (`spread`: how many each node holds); the fleet is updated only when every
    rank fits. Raises Unplaceable."""
    if not isinstance(fleet, Fleet):
        fleet = Fleet(fleet)
    if not fleet.order:
        raise Unplaceable("no READY node is registered")
    need_ports = ports_per_engine(single_container, kv_events)
    placements: list[RankPlacement] = []
    for rank in ranks:
        best = fleet.best_fit(accelerators_per_engine, need_ports, avoid, spread)
        if best is None:
            for p in placements:  # not all ranks fit: give back what this call took
                fleet.give_back(fleet.nodes[p.node_id], p.accelerator_ids, p.port_count)
            raise Unplaceable(
                f"rank {rank} needs {accelerators_per_engine} accelerator(s) and {need_ports} port(s) on one READY "
                "node; "
                f"none has room ({fleet.describe()})"
            )
        accelerators = tuple(best.free_accelerators[:accelerators_per_engine])
        fleet.take(best, accelerators, need_ports)
        placements.append(RankPlacement(rank, best.node_id, best.host, accelerators, need_ports))
    return placements
