"""The node table: every registered node, its READY/SUSPECT/LOST state with one transition
table, and the per-state counts (kept on each change, so the silent share costs O(1)).
READY nodes are also kept in the order of their last heartbeat, one order per grace they were
told (a handful: the grace changes in steps with the fleet's size), and SUSPECT nodes apart, so
the node monitor's sweep reads only the nodes that fell silent and those under re-check:
O(changed) per tick, not O(fleet).

Plain data, no I/O: the node monitor (controller/fleet/liveness.py) decides when a node changes
state; this table checks that the change is allowed and keeps the counts right.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from controller.model.reported import Reported
from controller.model.table import Table
from motor.contract.names import check_node_id, enum_short_name, excerpt
from motor.errors import FailedPrecondition, NotFound
from motor.state_machine import Transitions
from motor.v1 import controller_pb2

C = controller_pb2
NODE_READY, NODE_SUSPECT, NODE_LOST = C.NODE_STATE_READY, C.NODE_STATE_SUSPECT, C.NODE_STATE_LOST

# Which state may follow which (None: a node the table does not hold yet). READY: heartbeats
# arrive; SUSPECT: silent past the grace, being re-checked; LOST: the re-check failed too, its
# generation was bumped and its engines placed elsewhere. A registration (READY -> READY too)
# replaces the node's record; a node known from the store starts READY or LOST.
NODE_TRANSITIONS: Transitions[int | None, int] = Transitions.between(
    {
        None: {NODE_READY, NODE_LOST},
        NODE_READY: {NODE_READY, NODE_SUSPECT},
        NODE_SUSPECT: {NODE_READY, NODE_LOST},
        NODE_LOST: {NODE_READY},
    },
    lambda state: node_state_name(state),
)


def node_state_name(state: int | None) -> str:
    return "new" if state is None else enum_short_name(C.NodeState, state)


@dataclass(slots=True)
class NodeRuntime:
    info: C.NodeInfo
    generation: int
    state: int
    reason: str
    last_seen: float  # monotonic
    last_heartbeat_wall: float = 0.0
    registered_wall: float = 0.0  # when the holding process registered (0: before a controller restart)
    engines: dict[str, Reported] = field(
        default_factory=dict
    )  # engine id -> its last report (controller/model/reported.py)
    rechecking: bool = False
    recheck_failed_at: float | None = None
    recheck_error: str = ""
    reported_since_start: bool = False
    suspect_since: float = 0.0  # monotonic: when it last turned SUSPECT
    # The heartbeat interval and grace its latest answer told it (0: none told by this process
    # yet); its silence is judged by them, whatever the fleet announces later.
    told_interval: float = 0.0
    told_grace: float = 0.0
    # Its heartbeat token bucket (controller/fleet/beat_pacing.py): tokens, when last refilled, said once.
    beat_tokens: float = 0.0
    beats_checked: float = 0.0
    pace_logged: bool = False
    # Why it gets no new engines although READY (its address answers as another node); cleared
    # by registering again (a new NodeRuntime).
    unusable: str = ""

    @property
    def node_id(self) -> str:
        return self.info.node_id


class NodeTable(Table[NodeRuntime]):
    """node id -> NodeRuntime, read like a dict; every state change goes through `put` or
    `set_state`, which follow NODE_TRANSITIONS and keep the per-state counts."""

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[int, int] = {NODE_READY: 0, NODE_SUSPECT: 0, NODE_LOST: 0}
        # Told grace -> its READY nodes, oldest heartbeat first.
        self._ready_by_grace: dict[float, OrderedDict[str, NodeRuntime]] = {}
        self._ready_grace: dict[str, float] = {}  # node id -> the key of its order above
        self._suspect: dict[str, NodeRuntime] = {}
        # Nodes registered or changed state since the placement view last read them (FleetView).
        self.room_changed: set[str] = set()

    def _index(self, node: NodeRuntime, old: int | None) -> None:
        """Keep the READY order and the SUSPECT set right after `node` went from `old` to its state."""
        self._unorder(node.node_id)
        self._suspect.pop(node.node_id, None)
        self.room_changed.add(node.node_id)
        if node.state == NODE_READY:
            self._order(node)  # just heard from (registered, back): newest
        elif node.state == NODE_SUSPECT:
            self._suspect[node.node_id] = node

    @staticmethod
    def _check(node_id: str, old: int | None, new: int) -> None:
        NODE_TRANSITIONS.check(f"node {node_id}", old, new)

    def put(self, node: NodeRuntime) -> None:
        """Add a node, or replace its record (a registration), in the state the record holds."""
        previous = self._rows.get(node.node_id)
        old = previous.state if previous is not None else None
        self._check(node.node_id, old, node.state)
        if old is not None:
            self._counts[old] -= 1
        self._counts[node.state] += 1
        self._rows[node.node_id] = node
        self._index(node, old)

    def set_state(self, node: NodeRuntime, state: int, reason: str) -> None:
        self._check(node.node_id, node.state, state)
        self._counts[node.state] -= 1
        self._counts[state] += 1
        old, node.state, node.reason = node.state, state, reason
        self._index(node, old)

    def _order(self, node: NodeRuntime) -> None:
        self._ready_by_grace.setdefault(node.told_grace, OrderedDict())[node.node_id] = node
        self._ready_grace[node.node_id] = node.told_grace

    def _unorder(self, node_id: str) -> None:
        grace = self._ready_grace.pop(node_id, None)
        if grace is not None:
            order = self._ready_by_grace[grace]
            del order[node_id]
            if not order:
                del self._ready_by_grace[grace]

    def heard_from(self, node: NodeRuntime, now: float) -> None:
        """A heartbeat arrived at monotonic `now`: O(1)."""
        node.last_seen = now
        if node.state == NODE_READY:
            self._ready_by_grace[node.told_grace].move_to_end(node.node_id)

    def told(self, node: NodeRuntime, interval: float, grace: float) -> None:
        """An answer just told the node this interval and grace (it was heard from just now): O(1)."""
        node.told_interval = interval
        if grace != node.told_grace:
            node.told_grace = grace
            if node.state == NODE_READY:
                self._unorder(node.node_id)
                self._order(node)

    def not_counting(self, seconds: float) -> None:
        """The controller itself did not run for `seconds` (paused, or its loop held): that is not
        the nodes' silence. O(fleet), once per such pause; the READY order stays as it was."""
        for order in self._ready_by_grace.values():
            for node in order.values():
                node.last_seen += seconds
        for node in self._suspect.values():
            node.suspect_since += seconds

    def ready_silent(self, now: float, untold_grace: float) -> Iterator[NodeRuntime]:
        """READY nodes silent at monotonic `now` past the grace they were told (`untold_grace` for
        those told none), oldest first within each grace; each order stops at its first newer one."""
        silent = []
        for grace, order in self._ready_by_grace.items():
            cutoff = now - (grace or untold_grace)
            for node in order.values():
                if node.last_seen >= cutoff:
                    break
                silent.append(node)
        return iter(silent)  # a copy: the caller changes the states of what it reads

    def suspects(self) -> list[NodeRuntime]:
        return list(self._suspect.values())

    def count(self, state: int) -> int:
        return self._counts[state]

    def counts(self) -> dict[int, int]:
        return dict(self._counts)

    def silent_share(self) -> tuple[int, int]:
        """(silent, active): SUSPECT nodes among the nodes not LOST. A LOST node counts as neither."""
        return self._counts[NODE_SUSPECT], self.live()

    def live(self) -> int:
        """Nodes not LOST (READY or SUSPECT): those expected to heartbeat."""
        return len(self._rows) - self._counts[NODE_LOST]

    def member(self, node_id: str, generation: int) -> NodeRuntime:
        """The node, if `generation` is its current one (heartbeats and reports of a member).
        The id rule first: a node id no node can have is INVALID_ARGUMENT, not NOT_FOUND."""
        check_node_id(node_id)
        node = self._rows.get(node_id)
        if node is None:
            raise NotFound(f"node_id {excerpt(node_id)} is not registered; call RegisterNode first")
        if generation > node.generation:
            raise FailedPrecondition(
                f"generation {generation} of node {excerpt(node_id)} is ahead of the current one "
                f"({node.generation}): this controller never issued it; register again"
            )
        if generation != node.generation:
            raise FailedPrecondition(
                f"generation {generation} of node {excerpt(node_id)} is stale (current {node.generation}"
                f"{', node declared lost' if node.state == NODE_LOST else ''}); register again"
            )
        return node
