"""Node managers' reports: RegisterNode, heartbeats (unary and streamed) and engine events.

Each is checked before it is read (controller/rules/node_reports.py), then the node table is updated
and every reported engine handed to its lifecycle (controller/engines/lifecycle.py). The heartbeat is
the hot path: a dictionary update per engine reported, work only for what changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from controller.config import ControllerConfig
from controller.engines.actuator import Actuator
from controller.engines.adoption import Adoption
from controller.engines.generations import Generations
from controller.engines.lifecycle import EngineLifecycle
from controller.engines.node_client import NodeClient
from controller.fleet.claims import NodeClaims, check_registration
from controller.fleet.liveness import NodeMonitor
from controller.fleet.node_stores import NodeStoreAlarms
from controller.model import reported as reported_engine
from controller.model.cluster import ClusterState
from controller.model.nodes import NODE_LOST, NODE_READY, NODE_SUSPECT, NodeRuntime
from controller.rules.node_reports import check_engine_count, check_reported_engine, check_reported_engines
from motor.clock import Clock
from motor.contract import names, node_process
from motor.v1 import controller_pb2, types_pb2

C, T = controller_pb2, types_pb2
RegisterNodeResponse = C.RegisterNodeResponse


class NodeReports:
    """What node managers tell the controller, read into its tables."""

    def __init__(
        self,
        state: ClusterState,
        config: ControllerConfig,
        clock: Clock,
        claims: NodeClaims,
        monitor: NodeMonitor,
        generations: Generations,
        adoption: Adoption,
        actuator: Actuator,
        lifecycle: EngineLifecycle,
        node_stores: NodeStoreAlarms,
        nodes_client: NodeClient,
        spawn: Callable,
        wake: Callable[[], None],
    ):
        self.state, self.config = state, config
        self.mono, self.wall = clock.monotonic, clock.time
        self.claims, self.monitor, self.generations, self.adoption = claims, monitor, generations, adoption
        self.actuator, self.lifecycle, self.node_stores = actuator, lifecycle, node_stores
        self.nodes_client, self.spawn, self.wake = nodes_client, spawn, wake

    async def register_node(
        self, info: C.NodeInfo, engines: Iterable[T.Engine], highest_generation: int = 0
    ) -> RegisterNodeResponse:
        """Register a node manager process under its node id, unless another live process holds it
        (controller/fleet/claims.py): FAILED_PRECONDITION naming both then. `replaced` in the answer: the
        process it took the node id over from."""
        engines = list(engines)
        highest = max([highest_generation, *(e.spec.generation for e in engines)])
        check_registration(info, highest)
        check_engine_count(info.node_id, len(engines), self.config.max_engines_per_node, "engines")
        check_reported_engines(engines)
        replaced = await self.claims.admit(info)
        generation, assignments = self._register(info, engines, highest)
        self.claims.registered(info)
        reply = RegisterNodeResponse(
            generation=generation,
            assignments=assignments,
            generation_limit=self.generations.limit(),
            keep_unassigned=self.adoption.waiting,
        )
        if replaced is not None:
            reply.replaced.CopyFrom(replaced)
        return reply

    def _register(
        self, info: C.NodeInfo, engines: Iterable[T.Engine], highest: int
    ) -> tuple[int, list[C.EngineAssignment]]:
        st = self.state
        previous = st.nodes.get(info.node_id)
        with st.batch():
            generation = self.generations.for_registration(highest)
            node = NodeRuntime(
                info, generation, NODE_READY, f"registered (generation {generation})", last_seen=self.mono()
            )
            node.last_heartbeat_wall = node.registered_wall = self.wall()
            node.reported_since_start = True
            st.nodes.put(node)
            st.save_node(node)
        reported = {e.engine_id: e for e in engines}
        for slot in st.slots.on_node(info.node_id):
            copy = reported.get(slot.engine_id)
            if copy is None or copy.spec.generation != slot.generation:
                slot.launched = False  # the node does not run it (any more): start it again
                st.attention.add(slot.instance_id)
        if (
            previous is not None
            and not node_process.same_seat(previous.info.process, info.process)
            and node_process.known(previous.info.process)
            and node_process.known(info.process)
        ):
            kind, how = (
                C.EVENT_TYPE_NODE_REGISTERED,
                (
                    f"taken over by a new node manager process ({node_process.describe(info.process)}) "
                    f"from {previous.info.address} ({node_process.describe(previous.info.process)})"
                ),
            )
        elif previous is not None and previous.state == NODE_LOST:
            kind, how = C.EVENT_TYPE_NODE_RECOVERED, "registered again after being lost"
        elif previous is not None:
            kind, how = C.EVENT_TYPE_NODE_REGISTERED, "re-registered"
        else:
            kind, how = C.EVENT_TYPE_NODE_REGISTERED, "registered"
        st.event(
            kind,
            f"node {info.node_id} {how} (generation {generation}, {len(info.accelerator_ids)} accelerators, "
            f"{len(reported)} engines reported, address {info.address})",
            node_id=info.node_id,
        )
        with self.actuator.fences_of_one_report(info.node_id):
            for engine in reported.values():
                self.lifecycle.observe(node, engine, "")
        node.engines = {k[reported_engine.ENGINE_ID]: k for k in map(reported_engine.keep, reported.values())}
        moved_from = previous.info.address if previous is not None and previous.info.address != info.address else ""
        if moved_from and not any(n.info.address == moved_from for n in st.nodes.values()):  # rare: O(fleet) is fine
            self.spawn(self.nodes_client.forget(moved_from), f"forget {moved_from}")
        assignments = [
            C.EngineAssignment(engine_id=s.engine_id, generation=s.generation) for s in st.slots.on_node(info.node_id)
        ]
        self.monitor.refresh_alarm()
        self.wake()
        return generation, assignments

    def heartbeat(
        self,
        node_id: str,
        generation: int,
        engines: Iterable[T.Engine],
        delta: bool = False,
        removed: Iterable[str] = (),
        store_failing: str = "",
    ) -> None:
        """The hot path (unary Heartbeat and every StreamHeartbeats message): a dictionary update
        per engine reported; work only for what changed. `delta`: `engines` holds only the
        engines that changed and `removed` those the node no longer runs; the others stay.
        `store_failing`: why the node cannot write its engine records (controller/fleet/node_stores.py)."""
        node = self.state.nodes.member(node_id, generation)
        engines = list(engines)
        count = (
            len(engines)
            if not delta
            else len(node.engines)
            + sum(e.engine_id not in node.engines for e in engines)
            - sum(engine_id in node.engines for engine_id in set(removed))
        )
        check_engine_count(node_id, count, self.config.max_engines_per_node, "engines")
        before = node.engines
        kept = [reported_engine.keep(e, before.get(e.engine_id)) for e in engines]
        # What is the same as its last report was checked then.
        check_reported_engines(
            engines, {i for i, k in enumerate(kept) if k is before.get(k[reported_engine.ENGINE_ID])}
        )
        names.check_printable(store_failing, "store_failing")
        self.state.nodes.heard_from(node, self.mono())
        node.last_heartbeat_wall = self.wall()
        if not node.reported_since_start and node.state == NODE_READY:  # loaded from the store: no longer "waiting"
            node.reason = f"reporting again since the controller started (generation {node.generation})"
        node.reported_since_start = True
        if node.state == NODE_SUSPECT:
            self.monitor.node_back(node, "heartbeats arrived again")
        self.node_stores.report(node_id, store_failing)
        reported: dict[str, reported_engine.Reported] = before if delta else {}
        for engine_id in removed if delta else ():
            reported.pop(engine_id, None)
        with self.actuator.fences_of_one_report(node_id):
            for engine, k in zip(engines, kept):
                reported[k[reported_engine.ENGINE_ID]] = k  # the kept id: one string per engine, not two
                self.lifecycle.observe(node, engine, "")
        node.engines = reported

    def report_engine_event(self, node_id: str, generation: int, engine: T.Engine, reason: str) -> None:
        node = self.state.nodes.member(node_id, generation)
        check_reported_engine(engine, "engine")
        node.engines[engine.engine_id] = reported_engine.keep(engine)
        self.lifecycle.observe(node, engine, reason)
