"""Placement: bin-pack the ranks of one instance onto READY nodes by free accelerators and ports.

Pure functions over plain data, so the policy is tested without nodes or gRPC. Best fit: each
rank goes to the node left with the fewest free accelerators (ties: fewest free ports, then
node id), which keeps large holes free for large engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeCapacity:
    node_id: str
    host: str
    accelerator_ids: list[int]
    used_accelerators: set[int] = field(default_factory=set)
    # Inclusive range of engine ports; (0, 0) when the node manager allocates ports itself.
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


def ports_per_engine(single_container: bool) -> int:
    return 4 if single_container else 2


def place_instance(
    ranks: list[int],
    accelerators_per_engine: int,
    single_container: bool,
    nodes: list[NodeCapacity],
) -> list[RankPlacement]:
    """Place `ranks`; `nodes` is updated only when every rank fits. Raises Unplaceable."""
    if not nodes:
        raise Unplaceable("no READY node is registered")
    need_ports = ports_per_engine(single_container)
    trial = {
        n.node_id: NodeCapacity(n.node_id, n.host, list(n.accelerator_ids), set(n.used_accelerators), n.port_range, n.ports_in_use)
        for n in nodes
    }
    placements: list[RankPlacement] = []
    for rank in ranks:
        candidates = [
            n for n in trial.values()
            if len(n.free_accelerators) >= accelerators_per_engine and n.free_port_count() >= need_ports
        ]
        if not candidates:
            summary = ", ".join(
                f"{n.node_id}: {len(n.free_accelerators)}/{len(n.accelerator_ids)} accelerators"
                + (f", {n.free_port_count()} ports" if n.has_port_range else "")
                + " free"
                for n in sorted(trial.values(), key=lambda n: n.node_id)
            )
            raise Unplaceable(
                f"rank {rank} needs {accelerators_per_engine} accelerator(s) and {need_ports} port(s) on one READY node; "
                f"none has room ({summary})"
            )
        best = min(
            candidates,
            key=lambda n: (len(n.free_accelerators) - accelerators_per_engine, n.free_port_count(), n.node_id),
        )
        accelerators = tuple(best.free_accelerators[:accelerators_per_engine])
        best.used_accelerators.update(accelerators)
        best.ports_in_use += need_ports
        placements.append(RankPlacement(rank, best.node_id, best.host, accelerators, need_ports))
    for node in nodes:  # commit
        node.used_accelerators = trial[node.node_id].used_accelerators
        node.ports_in_use = trial[node.node_id].ports_in_use
    return placements
