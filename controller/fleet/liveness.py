"""Node liveness: a node silent past the grace turns SUSPECT and is re-checked directly; when
the re-check fails too it is LOST (a new generation; its engines move), unless so many nodes
are silent at once that the controller suspects its own network (the silent-nodes alarm).

Nodes that fall silent together are noticed up to a heartbeat interval apart (their last
heartbeats were), so a node is declared lost no sooner than two intervals after it turned
SUSPECT: by then every node silent since the same moment is SUSPECT and counted in the silent
share. A LOST node counts neither as silent nor as active.

Each node is judged by the interval and grace its latest answer told it (as Nomad sets each
client's TTL from its own heartbeat answer): nodes registering while one is silent make the
fleet's announced grace longer, but not the silent node's, so it is lost within the bound it was
given. A node told nothing by this process yet (known from the store) is judged by the fleet's.
"""

from __future__ import annotations

import asyncio
import logging

from google.protobuf.duration_pb2 import Duration

from controller.config import ControllerConfig
from controller.engines.lifecycle import ControllerLoop, EngineLifecycle
from controller.engines.node_client import NodeCallError, NodeClient
from controller.fleet.conflicts import ConflictLog
from controller.fleet.heartbeat_budget import HeartbeatBudget
from controller.model import reported
from controller.model.cluster import ClusterState
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from motor.contract import node_process
from motor.contract.heartbeats import MAX_BACKOFF
from motor.v1 import controller_pb2, types_pb2

C, T = controller_pb2, types_pb2
logger = logging.getLogger(__name__)


class NodeMonitor:
    def __init__(
        self,
        state: ClusterState,
        config: ControllerConfig,
        budget: HeartbeatBudget,
        client: NodeClient,
        lifecycle: EngineLifecycle,
        loop: ControllerLoop,
        conflicts: ConflictLog,
    ):
        self.state, self.config, self.budget, self.client = state, config, budget, client
        self.lifecycle, self.loop = lifecycle, loop
        # The node-id conflicts RegisterNode refuses (controller/fleet/claims.py keeps them).
        self.conflicts = conflicts
        self.alarm = ""
        self._rechecks: dict[str, asyncio.Task] = {}

    def awaited_takeover(self, node: NodeRuntime) -> bool:
        """A process on the node's host asks for its node id (then that one takes the node over,
        engines and all, instead of the node being lost): asked within the last three intervals,
        as it asks every interval while refused."""
        recent = self.state.mono() - 3 * self.config.heartbeat_interval
        boot_id = node.info.process.boot_id
        return bool(boot_id) and self.conflicts.asking(node.node_id, boot_id, recent)

    def check(self) -> None:
        """One pass of the node monitor (every min(0.5 s, heartbeat interval / 2))."""
        st = self.state
        now = st.mono()
        grace = self.budget.grace()
        # O(changed): only the READY nodes silent past their grace, and the SUSPECT ones.
        for node in st.nodes.ready_silent(now, grace):
            self.suspect_if_silent(node, now)
        self.refresh_alarm()
        for node in st.nodes.suspects():
            if node.state != NODE_SUSPECT or node.rechecking:
                continue
            if node.recheck_failed_at is not None and now - node.recheck_failed_at < max(self._grace(node), 1.0):
                if self.alarm:
                    node.reason = (
                        f"silent and the direct re-check failed ({node.recheck_error}); not declared lost while "
                        "the silent-nodes alarm is on"
                    )
                elif self.awaited_takeover(node):
                    node.reason = (
                        f"silent and the direct re-check failed ({node.recheck_error}); a node manager "
                        "on its host asks for its node id: it takes the node over at its next ask"
                    )
                elif now - node.suspect_since >= 2 * self._interval(node):
                    self.declare_lost(node)
            else:
                self._start_recheck(node)

    def controller_was_away(self, seconds: float) -> None:
        """The monitor ran `seconds` later than due: the controller was stopped (SIGSTOP, a
        suspended VM) or its loop held. The heartbeats sent meanwhile wait, unread, in its
        sockets; judged before they are read, every node would turn SUSPECT at once (and the
        silent-nodes alarm fire). Time away past a heartbeat interval is not counted as silence."""
        if seconds > self.budget.liveness_interval():
            logger.warning(
                "the controller did not run for %.1fs (stopped, or its loop held): not counted as the nodes' silence",
                seconds,
            )
            self.state.nodes.not_counting(seconds)

    def announce(self, node_id: str) -> tuple[Duration, Duration]:
        """(interval, grace) for a RegisterNode or heartbeat answer to `node_id`, remembered as
        what it was told: its silence is judged by them from now on."""
        interval, grace = self.budget.announcement()
        node = self.state.nodes.get(node_id)
        if node is not None:
            self.state.nodes.told(node, self.budget.announced, self.budget.held_grace())
        return interval, grace

    def _grace(self, node: NodeRuntime) -> float:
        return node.told_grace or self.budget.grace()

    def _interval(self, node: NodeRuntime) -> float:
        return node.told_interval or self.budget.liveness_interval()

    def suspect_if_silent(self, node: NodeRuntime, now: float) -> None:
        grace = self._grace(node)
        # A node known from the store that has not reported to this process yet may still be
        # backing off from the outage: it has the grace and a node manager's longest backoff.
        allowed = grace if node.reported_since_start else grace + MAX_BACKOFF
        if node.state == NODE_READY and now - node.last_seen > allowed:
            st = self.state
            silence = (
                f"no heartbeat for {now - node.last_seen:.1f}s"
                if node.reported_since_start
                else f"no heartbeat since this controller started ({now - node.last_seen:.1f}s ago; "
                f"a node manager waits at most {MAX_BACKOFF:g}s between two tries)"
            )
            st.nodes.set_state(
                node,
                NODE_SUSPECT,
                f"{silence} (grace {grace:g}s, heartbeat interval {self._interval(node):g}s); re-checking it directly",
            )
            node.recheck_failed_at, node.suspect_since = None, now
            st.event(C.EVENT_TYPE_NODE_SUSPECT, f"node {node.node_id} suspect: {node.reason}", node_id=node.node_id)
            st.evaluate_node(node.node_id)

    def _start_recheck(self, node: NodeRuntime) -> asyncio.Task:
        task = self._rechecks.get(node.node_id)
        if task is None or task.done():
            node.rechecking = True
            task = self._rechecks[node.node_id] = self.loop.spawn(self._recheck(node), f"recheck {node.node_id}")
        return task

    async def recheck_now(self, node: NodeRuntime) -> None:
        """Re-check a silent node at once (another process claims its node id); joins one under way."""
        self.suspect_if_silent(node, self.state.mono())
        if node.state == NODE_SUSPECT:
            await asyncio.shield(self._start_recheck(node))

    def refresh_alarm(self) -> None:
        silent, active = self.state.nodes.silent_share()
        share = silent / active if active else 0.0
        if share > self.config.silent_share_alarm:
            message = (
                f"{silent} of {active} nodes silent at once (more than {self.config.silent_share_alarm:.0%}): "
                "suspecting the controller's own network; not rescheduling them"
            )
            if not self.alarm:
                self.state.event(C.EVENT_TYPE_ALARM, f"alarm raised: {message}")
            self.alarm = message
        elif self.alarm:
            self.alarm = ""
            self.state.event(C.EVENT_TYPE_ALARM, f"alarm cleared: {silent} of {active} nodes silent")

    async def _recheck(self, node: NodeRuntime) -> None:
        generation = node.generation
        try:
            reply = await self.client.list_engines(node.info, self.config.recheck_timeout)
            answered = reply.process
            if (
                node_process.known(node.info.process)
                and node_process.known(answered)
                and not node_process.same_process(node.info.process, answered)
            ):
                raise NodeCallError(
                    "WRONG_PROCESS",
                    f"{node.info.address} is another node manager process now "
                    f"({node_process.describe(answered)}), not the holder",
                )
        except NodeCallError as exc:
            if node.generation == generation and node.state == NODE_SUSPECT:
                node.recheck_failed_at = self.state.mono()
                node.recheck_error = str(exc)
            return
        finally:
            node.rechecking = False
        engines = reply.engines
        if node.generation == generation and node.state == NODE_SUSPECT:
            node.last_seen = self.state.mono()
            self.node_back(node, "heartbeats were late but the direct re-check answered")
            for engine in engines:
                node.engines[engine.engine_id] = reported.keep(engine)
                self.lifecycle.observe(node, engine, "")

    def node_back(self, node: NodeRuntime, how: str) -> None:
        st = self.state
        st.nodes.set_state(node, NODE_READY, how)
        node.recheck_failed_at = None
        st.event(C.EVENT_TYPE_NODE_RECOVERED, f"node {node.node_id} ready again: {how}", node_id=node.node_id)
        self.refresh_alarm()
        st.evaluate_node(node.node_id)
        self.loop.wake()

    def declare_lost(self, node: NodeRuntime, why: str = "") -> None:
        st = self.state
        silence = st.mono() - node.last_seen
        why = why or f"no heartbeat for {silence:.1f}s and the direct re-check failed ({node.recheck_error})"
        with st.batch():
            # A new generation: the node's heartbeats are refused until it registers again.
            node.generation = st.store.next_generation()
            st.nodes.set_state(node, NODE_LOST, why)
            st.save_node(node)
        st.event(
            C.EVENT_TYPE_NODE_LOST,
            f"node {node.node_id} lost: {node.reason}; moving its {len(st.slots.on_node(node.node_id))} engine(s)",
            node_id=node.node_id,
        )
        self.lifecycle.evacuate(node)
