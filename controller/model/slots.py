"""The slot table: one EngineSlot per rank of every instance (where it is assigned, which
generation runs, what its node last said about it) and the node -> slots index.

Every placement change goes through `place`, `unplace` and `new_generation`, so the index and
the per-copy fields cannot drift apart. Plain data, no I/O (the controller persists slots).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from controller.model.table import Table
from motor.contract import names
from motor.v1 import types_pb2

T = types_pb2

# Slot fields that are persisted; the others are observations rebuilt from node reports.
_SLOT_PERSISTED = (
    "engine_id",
    "instance_id",
    "dp_rank",
    "node_id",
    "host",
    "requested_ports",
    "port",
    "mgmt_port",
    "kv_port",
    "dp_rpc_port",
    "kv_events_port",
    "accelerator_ids",
    "generation",
    "restarts",
    "last_failure_reason",
)


@dataclass(slots=True)
class EngineSlot:
    """One rank of an instance: where it is assigned and what its node last said about it.

    One per engine (80,000 at 10,000 nodes x 8): slots, and tuples of ints, which the garbage
    collector stops tracking, where lists would be two more objects per engine for every full
    collection to walk (docs/controller-decisions.md, memory per engine)."""

    engine_id: str
    instance_id: str
    dp_rank: int
    node_id: str = ""
    host: str = ""
    requested_ports: tuple[int, ...] = ()  # what placement asked for (0: node picks)
    port: int = 0
    mgmt_port: int = 0
    kv_port: int = 0
    dp_rpc_port: int = 0
    kv_events_port: int = 0  # where it publishes its KV cache events (0: it does not)
    accelerator_ids: tuple[int, ...] = ()
    generation: int = 0
    restarts: int = 0
    last_failure_reason: str = ""
    # In memory only.
    launched: bool = False  # StartEngine acknowledged, or the node reported this generation
    busy: bool = False  # a start/stop for this slot is in flight
    retry_at: float = 0.0  # monotonic time before which a failed launch is not retried
    moved: bool = False  # unplaced because its node was lost: placing it again is a reschedule
    state: int = T.ENGINE_STATE_UNSPECIFIED
    health: int = T.HEALTH_STATUS_UNSPECIFIED
    health_reason: str = ""
    draining: bool = False  # the engine admits no new requests (Drain or SIGTERM)
    sleeping: bool = False
    not_serving_reason: str = ""  # the engine's stall watchdog (Engine.not_serving_reason): '' while it serves
    stop_grace: float = 0.0  # what the engine said a SIGTERM may take (Engine.stop_grace)
    handled_failure_generation: int = 0
    failed_at: float | None = None  # monotonic time of the failure (or node loss) not yet recovered from

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SLOT_PERSISTED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineSlot:
        slot = cls(**{k: v for k, v in data.items() if k in _SLOT_PERSISTED})
        slot.requested_ports, slot.accelerator_ids = tuple(slot.requested_ports), tuple(slot.accelerator_ids)
        return slot

    def adopt_ports(self, spec: T.EngineSpec) -> bool:
        """Take the ports the node manager allocated; True when they changed (save the slot)."""
        if not spec.port or spec.port == self.port:
            return False
        self.port, self.mgmt_port, self.kv_port, self.dp_rpc_port, self.kv_events_port = (
            spec.port,
            spec.mgmt_port,
            spec.kv_port,
            spec.dp_rpc_port,
            spec.kv_events_port,
        )
        return True

    def _forget_copy(self) -> None:
        # Ports the node manager picked are picked again for the next copy (the old ones may be
        # taken by then), and nothing is known about that copy yet.
        self.port = self.mgmt_port = self.kv_port = self.dp_rpc_port = self.kv_events_port = 0
        self.launched = False
        self.state, self.health, self.health_reason = T.ENGINE_STATE_UNSPECIFIED, T.HEALTH_STATUS_UNSPECIFIED, ""
        self.draining = self.sleeping = False
        self.not_serving_reason = ""
        self.stop_grace = 0.0


class SlotTable(Table[EngineSlot]):
    """engine id -> EngineSlot, read like a dict, plus the node -> engine ids index."""

    def __init__(self) -> None:
        super().__init__()
        self._by_node: dict[str, set[str]] = {}
        # Nodes whose set of slots changed since the placement view last read them (FleetView).
        self.room_changed: set[str] = set()

    def add(self, slot: EngineSlot) -> None:
        self._rows[slot.engine_id] = slot
        if slot.node_id:
            self._by_node.setdefault(slot.node_id, set()).add(slot.engine_id)
            self.room_changed.add(slot.node_id)

    def remove(self, engine_id: str) -> EngineSlot:
        slot = self._rows.pop(engine_id)
        self._leave(slot)
        return slot

    def _leave(self, slot: EngineSlot) -> None:
        if slot.node_id:  # a placed slot is always in its node's index (add and place put it there)
            self._by_node[slot.node_id].discard(slot.engine_id)
            self.room_changed.add(slot.node_id)

    def of_instance(self, instance_id: str, ranks: int | None) -> list[EngineSlot]:
        """The slots of an instance of `ranks` ranks; None: the instance is gone, find leftovers."""
        if ranks is None:
            return [s for s in self._rows.values() if s.instance_id == instance_id]
        found = (self._rows.get(names.engine_id(instance_id, r)) for r in range(ranks))
        return [s for s in found if s is not None]

    def on_node(self, node_id: str) -> list[EngineSlot]:
        """The slots assigned to a node, by engine id."""
        return [self._rows[e] for e in sorted(self._by_node.get(node_id, ()))]

    def placed_on(self, node_id: str) -> Iterator[EngineSlot]:
        """The slots assigned to a node, in no order (for counting)."""
        return (self._rows[e] for e in self._by_node.get(node_id, ()))

    def used_accelerators(self, node_id: str) -> set[int]:
        return {a for s in self.placed_on(node_id) for a in s.accelerator_ids}

    def place(
        self,
        slot: EngineSlot,
        node_id: str,
        host: str,
        accelerator_ids: Iterable[int],
        port_count: int,
        generation: int,
    ) -> None:
        """Assign an unplaced slot to a node, as a new generation; the node manager picks its ports."""
        self._leave(slot)
        slot.node_id, slot.host, slot.accelerator_ids = node_id, host, tuple(accelerator_ids)
        slot.requested_ports = (0,) * port_count
        self._by_node.setdefault(node_id, set()).add(slot.engine_id)
        self.room_changed.add(node_id)
        self.new_generation(slot, generation)
        slot.moved = False

    def unplace(self, slot: EngineSlot, moved: bool) -> None:
        """Take a slot off its node; `moved`: placing it again counts as a reschedule."""
        self._leave(slot)
        slot.node_id, slot.host, slot.requested_ports, slot.accelerator_ids = "", "", (), ()
        slot._forget_copy()
        slot.moved = moved

    @staticmethod
    def new_generation(slot: EngineSlot, generation: int) -> None:
        """The next copy of the slot gets `generation`; what was known of the last copy goes."""
        slot.generation = generation
        slot.handled_failure_generation = 0
        slot._forget_copy()
