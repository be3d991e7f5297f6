"""Who may register a node id: the rule between the node id's holder and a newcomer process
(`judge`, plain), the log of conflicts (one event when one starts, one with its count when it
ends), and `NodeClaims`, the gate RegisterNode passes: it runs the direct re-check of a silent
holder when `judge` asks for it, declares a replaced holder lost, and refuses the rest.
"""

from __future__ import annotations

import enum

from prometheus_client import Counter

from controller.config import ControllerConfig
from controller.engines.generations import MAX_GENERATION
from controller.fleet.conflicts import Conflict, ConflictLog
from controller.fleet.liveness import NodeMonitor
from controller.model.cluster import ClusterState
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from motor.contract import names, node_process
from motor.errors import FailedPrecondition, InvalidArgument
from motor.v1 import controller_pb2, types_pb2

# A conflict is over when the refused process has not asked for this long (it asks every 10 s at most).
CONFLICT_QUIET_S = 60.0


def check_registration(info: controller_pb2.NodeInfo, highest_generation: int) -> None:
    """What a RegisterNode must carry; INVALID_ARGUMENT naming the field otherwise."""
    if not info.node_id:
        raise InvalidArgument("node.node_id: required (a unique name of the node, e.g. 'node-a')")
    names.check_node_id(info.node_id, "node.node_id")
    if not info.address:
        raise InvalidArgument("node.address: required (host:port of the node manager's gRPC server)")
    names.check_printable(info.address, "node.address")
    names.check_printable(info.host, "node.host")
    if info.port_range_start or info.port_range_end:
        if not 0 < info.port_range_start <= info.port_range_end <= 65535:
            raise InvalidArgument(
                f"node.port_range_start/port_range_end: {info.port_range_start}-{info.port_range_end} is not a range "
                "within 1-65535"
            )
    if highest_generation >= MAX_GENERATION:
        raise InvalidArgument(
            f"highest_generation: {highest_generation} is beyond any generation a controller issues (2^62): an "
            "engine record in the node's state directory carries it; remove that engine's record"
        )


class Claim(enum.Enum):
    NEW = "new"  # nobody held the node id
    SAME = "same process"  # the holder registers again (a refused heartbeat, a controller restart)
    RESTART = "restart"  # the holder restarted: same boot and state directory, new process
    UNCHECKED = "unchecked"  # one side has no process identity (an older node manager)
    AFTER_LOST = "after lost"  # the holder was declared lost: the newcomer takes the node id
    RECHECK = "recheck"  # the holder is silent past the grace: re-check it directly, then judge again
    TAKEOVER = "takeover"  # silent past the grace and its re-check failed: gone
    REFUSE = "refuse"  # the holder is alive: a second process claims its node id


def judge(
    holder: NodeRuntime | None, newcomer: types_pb2.NodeManagerProcess, now: float, grace: float, alarm: bool
) -> Claim:
    """What a registration from `newcomer` does to the node id `holder` holds (monotonic `now`).

    While the silent-nodes alarm is on, a silent holder is replaced only by a process on the same
    host boot (which reaches the controller, so the holder would too): from elsewhere, the
    controller may be the one cut off, and the holder's engines may be serving."""
    if holder is None:
        return Claim.NEW
    held_by = holder.info.process
    if not node_process.known(held_by) or not node_process.known(newcomer):
        return Claim.UNCHECKED
    if node_process.same_process(held_by, newcomer):
        return Claim.SAME
    if node_process.same_seat(held_by, newcomer):
        return Claim.RESTART
    if holder.state == NODE_LOST:
        return Claim.AFTER_LOST
    if holder.state == NODE_READY and now - holder.last_seen <= grace:
        return Claim.REFUSE
    if alarm and newcomer.boot_id != held_by.boot_id:
        return Claim.REFUSE
    if holder.state == NODE_SUSPECT and holder.recheck_failed_at is not None:
        return Claim.TAKEOVER
    return Claim.RECHECK


class NodeClaims:
    """The gate of RegisterNode: admits a process to a node id or refuses it (FAILED_PRECONDITION),
    re-checks a silent holder before it is replaced, and keeps the conflict log and its events."""

    def __init__(
        self,
        state: ClusterState,
        config: ControllerConfig,
        monitor: NodeMonitor,
        refused_counter: Counter,
        conflicts: ConflictLog,
    ):
        self.state, self.config, self.monitor = state, config, monitor
        self.refused_counter = refused_counter
        self.conflicts = conflicts  # the monitor reads it too: a silent node awaited by a newcomer is not lost

    def _judge(self, info: controller_pb2.NodeInfo) -> Claim:
        st = self.state
        return judge(
            st.nodes.get(info.node_id), info.process, st.mono(), self.monitor.budget.grace(), bool(self.monitor.alarm)
        )

    async def admit(self, info: controller_pb2.NodeInfo) -> types_pb2.NodeManagerProcess | None:
        """Returns the process whose node id this registration takes over (None: nobody else's)."""
        claim = self._judge(info)
        if claim is Claim.RECHECK:
            await self.monitor.recheck_now(self.state.nodes[info.node_id])
            claim = self._judge(info)
            if claim is Claim.RECHECK:  # the holder answered meanwhile, or the node changed hands
                claim = Claim.REFUSE if info.node_id in self.state.nodes else Claim.NEW
        if claim is Claim.REFUSE:
            self._refuse(info)
        holder = self.state.nodes.get(info.node_id)
        if claim not in (Claim.TAKEOVER, Claim.AFTER_LOST) or holder is None:
            return None
        if claim is Claim.TAKEOVER:
            self._take_over(holder, info)
        return holder.info.process

    def _take_over(self, holder: NodeRuntime, info: controller_pb2.NodeInfo) -> None:
        """The holder is gone. With the same host and accelerators the node goes on with the
        newcomer: every engine of the node gets a new generation (copies the old holder may still
        run are stale) and is started by the newcomer once it has killed what the old holder left
        on the host. Otherwise the holder is declared lost and its engines move."""
        st = self.state
        same_node = (holder.info.host, list(holder.info.accelerator_ids)) == (info.host, list(info.accelerator_ids))
        why = (
            f"taken over by {info.address} ({node_process.describe(info.process)}): silent and the direct "
            f"re-check failed ({holder.recheck_error})"
        )
        if not same_node:
            self.monitor.declare_lost(holder, why + "; another host or other accelerators: its engines move")
            return
        with st.batch():
            for slot in list(st.slots.on_node(holder.node_id)):
                st.slots.new_generation(slot, st.store.next_generation())
                slot.launched = False
                st.save_slot(slot)
                st.attention.add(slot.instance_id)
        holder.reason = why

    def registered(self, info: controller_pb2.NodeInfo) -> None:
        ended = self.conflicts.end(info.node_id, info.process.nonce)
        if ended is not None:
            self._over(ended, f"{ended.newcomer_address} took the node id over")

    def end_quiet(self) -> None:
        """A refused process that stopped asking: its conflict is over."""
        for conflict in self.conflicts.quiet(self.state.mono(), CONFLICT_QUIET_S):
            self._over(conflict, f"{conflict.newcomer_address} stopped asking")

    def _over(self, conflict: Conflict, how: str) -> None:
        self.state.event(
            controller_pb2.EVENT_TYPE_NODE_CONFLICT,
            f"node id {conflict.node_id} conflict over: {how} after {conflict.refused} refused registration(s) "
            f"since {node_process.utc(conflict.since_wall)}",
            node_id=conflict.node_id,
        )

    def _refuse(self, info: controller_pb2.NodeInfo) -> None:
        st = self.state
        holder = st.nodes[info.node_id]
        since = (
            f"since {node_process.utc(holder.registered_wall)}"
            if holder.registered_wall
            else "since before the controller restarted"
        )
        silent, grace = st.mono() - holder.last_seen, self.monitor.budget.grace()
        alive = (
            f"last heartbeat {silent:.1f}s ago"
            if holder.state == NODE_READY and silent <= grace
            else f"silent {silent:.1f}s: {self.monitor.alarm or holder.reason}"
        )
        message = (
            f"node id {info.node_id!r} is held by another live node manager: {holder.info.address} "
            f"({node_process.describe(holder.info.process)}), holding it {since}, {alive}; refused the registration "
            f"from {info.address} ({node_process.describe(info.process)}). Stop one of them or give one another "
            f"--node-id; the holder is replaced only once it is silent past the grace ({grace:g}s) "
            "and fails a direct re-check"
        )
        self.refused_counter.labels(reason="node_id_held").inc()
        started = self.conflicts.refused(info.node_id, info.process, info.address, message, st.wall(), st.mono())
        if started is not None:
            st.event(
                controller_pb2.EVENT_TYPE_NODE_CONFLICT,
                f"node id {info.node_id} conflict: {message}",
                node_id=info.node_id,
            )
        raise FailedPrecondition(message)
