"""Adopting what the nodes run when the controller's store is new (docs/controller.md, "A lost
database").

A store to which no deployment was ever applied (a first start, or a database that was lost:
moved away, a new disk) knows nothing of the engines the nodes may already run. Until the
first deployment is applied, such a controller stops nothing it does not know (it says so in
RegisterNode's `keep_unassigned`, so the node managers keep them too). The first
ApplyDeployment then places every new instance whose ranks all run on READY nodes exactly as
the deployment describes them (instance and rank, role, engine config, accelerator count, one
master address) with those very copies: same processes, same generations, nothing restarted.
What it does not describe is stopped from then on by the usual fencing. DeleteDeployment on a
new store ends the wait the same way (everything unknown is stopped).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from controller.engines.lifecycle import EngineLifecycle
from controller.model import reported
from controller.model.cluster import ClusterState
from controller.model.instances import STARTING, InstanceRecord
from controller.model.nodes import NODE_READY, NodeRuntime
from controller.rules.placement import ports_per_engine
from controller.store.interface import StoredState
from motor.contract import names
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
LIVE = {T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING}


class Adoption:
    def __init__(self, state: ClusterState, lifecycle: EngineLifecycle):
        self.state, self.lifecycle = state, lifecycle

    @property
    def waiting(self) -> bool:
        """A new store: engines it does not know are kept until a deployment (the lifecycle reads
        the same flag from the state when a node reports one)."""
        return self.state.keeping_unknown

    def loaded(self, stored: StoredState) -> None:
        self.state.keeping_unknown = not stored.deployments and not stored.ever_applied

    def adopt(self, instances: Iterable[InstanceRecord], deployment: str = "") -> int:
        """The first deployment on a new store: adopt every instance whose ranks all run as it
        describes them; returns how many. The wait ends: unknown copies are fenced from now on."""
        copies = self.live_copies()
        adopted = 0
        for inst in instances:
            found, why = self._matching(inst, copies)
            if found is not None:
                self._take(inst, found)
                adopted += 1
            else:
                self._replace_survivors(inst, copies, why)
        self.end(
            f"first deployment on a new store: {adopted} instance(s) adopted with the engines the nodes run", deployment
        )
        return adopted

    def live_copies(self) -> dict[str, list[tuple[NodeRuntime, T.Engine]]]:
        """Engine id -> the copies READY nodes run of it (starting or running): what can be adopted."""
        copies: dict[str, list[tuple[NodeRuntime, T.Engine]]] = {}
        for node in self.state.nodes.values():
            if node.state == NODE_READY:
                for engine_id, kept in node.engines.items():
                    if kept[reported.STATE] in LIVE:
                        copies.setdefault(engine_id, []).append((node, reported.message(kept)))
        return copies

    def end(self, why: str, deployment: str = "") -> None:
        self.state.keeping_unknown = False
        self.state.event(
            C.EVENT_TYPE_DEPLOYMENT_CHANGED,
            f"{why}; engines the nodes run that the deployment does not describe are stopped from now on",
            deployment=deployment,
        )

    def _matching(
        self, inst: InstanceRecord, copies: dict[str, list[tuple[NodeRuntime, T.Engine]]]
    ) -> tuple[list[tuple[NodeRuntime, T.Engine]] | None, str]:
        """The copies that run the whole instance as described, or None and why not."""
        found = []
        for rank in range(inst.data_parallel_size):
            candidates = copies.get(names.engine_id(inst.instance_id, rank), [])
            if not candidates:
                return None, f"rank {rank} of {inst.instance_id} is not running"
            if len(candidates) > 1:  # which one is the instance's is not clear
                return None, f"rank {rank} of {inst.instance_id} runs on {len(candidates)} nodes"
            node, engine = candidates[0]
            spec = engine.spec
            used = self.state.slots.used_accelerators(node.node_id)
            master = found[0][1].spec.master_dp_ip if found else spec.master_dp_ip  # rank 0's host, for every rank
            if (
                spec.role != inst.role
                or spec.config_json != self.state.config_of(inst)
                or spec.single_container != inst.single_container
                or spec.master_dp_ip != master
                or len(spec.accelerator_ids) != inst.accelerators_per_engine
                or not set(spec.accelerator_ids) <= set(node.info.accelerator_ids) - used
            ):
                return (
                    None,
                    f"rank {rank} of {inst.instance_id} on {node.node_id} runs another spec than the deployment's",
                )
            found.append((node, engine))
        return found, ""

    def _replace_survivors(
        self, inst: InstanceRecord, copies: dict[str, list[tuple[NodeRuntime, T.Engine]]], why: str
    ) -> None:
        """Ranks of an instance that cannot be adopted whole still run: they are stopped (fenced,
        each with one event saying why) and the instance starts anew, a restart it counts."""
        survivors = [
            (node, engine)
            for rank in range(inst.data_parallel_size)
            for node, engine in copies.get(names.engine_id(inst.instance_id, rank), [])
        ]
        if not survivors:
            return
        inst.restarts += 1
        self.state.save_instance(inst)
        for node, engine in survivors:
            self.lifecycle.actuator.stop_copy(
                node.node_id,
                engine.engine_id,
                engine.spec.generation,
                f"replaced: {why}, so the instance starts anew (not adopted)",
                fence=True,
            )

    def _take(self, inst: InstanceRecord, found: list[tuple[NodeRuntime, T.Engine]]) -> None:
        st = self.state
        slots = st.slots_of(inst.instance_id)
        with st.batch():
            for slot, (node, engine) in zip(slots, found):
                spec = engine.spec
                st.slots.place(
                    slot,
                    node.node_id,
                    spec.host,
                    list(spec.accelerator_ids),
                    ports_per_engine(inst.single_container, spec.kv_events),
                    spec.generation,
                )
                slot.adopt_ports(spec)
                st.save_slot(slot)
            where = ", ".join(
                f"rank {e.spec.dp_rank} on {n.node_id} (pid {e.pid}, generation {e.spec.generation})" for n, e in found
            )
            st.transition(inst, STARTING, f"adopted the engines the nodes run: {where}")
        logger.info("instance %s adopted: %s", inst.instance_id, where)
        for node, engine in found:
            self.lifecycle.observe(node, engine, "")
