"""Node liveness: a node silent past the grace turns SUSPECT and is re-checked directly; when
the re-check fails too it is LOST (a new generation; its engines move), unless so many nodes
are silent at once that the controller suspects its own network (the silent-nodes alarm).

Nodes that fall silent together are noticed up to a heartbeat interval apart (their last
heartbeats were), so a node is declared lost no sooner than two intervals after it turned
SUSPECT: by then every node silent since the same moment is SUSPECT and counted in the silent
share. A LOST node counts neither as silent nor as active.
"""

from __future__ import annotations

from typing import Callable, Coroutine

from motor.v1 import controller_pb2, types_pb2

from controller.config import ControllerConfig
from controller.node_client import NodeCallError, NodeClient
from controller.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from controller.state import ClusterState

C, T = controller_pb2, types_pb2


class NodeMonitor:
    def __init__(
        self,
        state: ClusterState,
        config: ControllerConfig,
        client: NodeClient,
        spawn: Callable[[Coroutine, str], object],
        wake: Callable[[], None],
        observe: Callable[[NodeRuntime, T.Engine, str], None],
        evacuate: Callable[[NodeRuntime], None],
    ):
        self.state, self.config, self.client = state, config, client
        self.spawn, self.wake, self.observe, self.evacuate = spawn, wake, observe, evacuate
        self.alarm = ""

    def check(self) -> None:
        """One pass of the node monitor (every min(0.5 s, heartbeat interval / 2))."""
        st = self.state
        now = st.mono()
        grace = self.config.node_grace
        for node in st.nodes.values():
            if node.state == NODE_READY and now - node.last_seen > grace:
                st.nodes.set_state(node, NODE_SUSPECT, f"no heartbeat for {now - node.last_seen:.1f}s (grace {grace:g}s); re-checking it directly")
                node.recheck_failed_at, node.suspect_since = None, now
                st.event(C.EVENT_TYPE_NODE_SUSPECT, f"node {node.node_id} suspect: {node.reason}", node_id=node.node_id)
                st.evaluate_node(node.node_id)
        self.refresh_alarm()
        for node in list(st.nodes.values()):
            if node.state != NODE_SUSPECT or node.rechecking:
                continue
            if node.recheck_failed_at is not None and now - node.recheck_failed_at < max(grace, 1.0):
                if self.alarm:
                    node.reason = (
                        f"silent and the direct re-check failed ({node.recheck_error}); not declared lost while "
                        "the silent-nodes alarm is on"
                    )
                elif now - node.suspect_since >= 2 * self.config.heartbeat_interval:
                    self._declare_lost(node)
            else:
                node.rechecking = True
                self.spawn(self._recheck(node), f"recheck {node.node_id}")

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
            engines = await self.client.list_engines(node.info, self.config.recheck_timeout)
        except NodeCallError as exc:
            if node.generation == generation and node.state == NODE_SUSPECT:
                node.recheck_failed_at = self.state.mono()
                node.recheck_error = str(exc)
            return
        finally:
            node.rechecking = False
        if node.generation == generation and node.state == NODE_SUSPECT:
            node.last_seen = self.state.mono()
            self.node_back(node, "heartbeats were late but the direct re-check answered")
            for engine in engines:
                node.engines[engine.engine_id] = engine
                self.observe(node, engine, "")

    def node_back(self, node: NodeRuntime, how: str) -> None:
        st = self.state
        st.nodes.set_state(node, NODE_READY, how)
        node.recheck_failed_at = None
        st.event(C.EVENT_TYPE_NODE_RECOVERED, f"node {node.node_id} ready again: {how}", node_id=node.node_id)
        self.refresh_alarm()
        st.evaluate_node(node.node_id)
        self.wake()

    def _declare_lost(self, node: NodeRuntime) -> None:
        st = self.state
        silence = st.mono() - node.last_seen
        with st.store.transaction():
            # A new generation: the node's heartbeats are refused until it registers again.
            node.generation = st.store.next_generation()
            st.nodes.set_state(node, NODE_LOST, f"no heartbeat for {silence:.1f}s and the direct re-check failed ({node.recheck_error})")
            st.save_node(node)
        st.event(
            C.EVENT_TYPE_NODE_LOST,
            f"node {node.node_id} lost: {node.reason}; moving its {len(st.slots.on_node(node.node_id))} engine(s)",
            node_id=node.node_id,
        )
        self.evacuate(node)
