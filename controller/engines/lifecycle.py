"""An engine copy's path through the controller, in one place and read top-down: a node reports
it (`observe`), a copy that died is a failure (`engine_failed`: the restart policy decides to
restart its rank or group, maybe after a backoff, or to give up), a restart issues new
generations (`restart`), and a launch sends StartEngine (`launch`); a start the node refuses is a
failure again, handled here too. A node lost or set aside has its ranks placed again (`evacuate`,
`move`). The reconcile pass (controller/capacity/scheduling.py) places instances and calls `launch` and
`restart`; the node monitor (controller/fleet/liveness.py) and adoption (controller/engines/adoption.py) call
`observe` and `evacuate`.

Everything runs on the controller's asyncio loop; a task that awaited a node manager re-checks
the slot or instance it started with before acting on the answer.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Protocol

from controller.engines.actuator import Actuator, engine_spec
from controller.engines.generations import Generations
from controller.engines.node_client import NodeCallError
from controller.metrics import ControllerMetrics
from controller.model import reported
from controller.model.cluster import ClusterState
from controller.model.instances import FAILED, PENDING, RESTARTING, STARTING, InstanceRecord, on_failure
from controller.model.nodes import NODE_LOST, NODE_READY, NodeRuntime
from controller.model.slots import EngineSlot
from controller.store.interface import StoreUnavailable
from motor.contract import names, pbtime
from motor.contract.exits import describe_exit
from motor.contract.start_refusals import Refusal
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
LIVE_ENGINE_STATES = {T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING}
# Engine states that mean the current copy is gone and must be replaced.
DEAD_ENGINE_STATES = {T.ENGINE_STATE_FAILED, T.ENGINE_STATE_STOPPED}


class ControllerLoop(Protocol):
    """What the controller's parts ask of its loop (the Controller is one)."""

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        """A task of the controller's, cancelled when it stops."""

    def wake(self) -> None:
        """Run the reconcile pass soon."""


@dataclass(eq=False)
class EngineLifecycle:
    state: ClusterState
    actuator: Actuator
    generations: Generations
    metrics: ControllerMetrics
    loop: ControllerLoop

    def __post_init__(self) -> None:
        # Until then (monotonic), nothing is started unless every known node has reported.
        self.startup_until = self.state.mono()
        self._restart_timers: dict[str, asyncio.TimerHandle] = {}

    def startup_done(self) -> bool:
        if self.state.mono() >= self.startup_until:
            return True
        return all(n.reported_since_start for n in self.state.nodes.values() if n.state != NODE_LOST)

    def cancel_timers(self) -> None:
        for handle in self._restart_timers.values():
            handle.cancel()

    # ------------------------------------------------------------------ reports

    def observe(self, node: NodeRuntime, engine: T.Engine, reason: str) -> None:
        """A node reported an engine copy (a heartbeat, an event, a registration, a re-check, a
        start's answer): a stale copy is fenced, the current one's state is kept, and a copy that
        died is a failure."""
        slot = self.state.slots.get(engine.engine_id)
        generation = engine.spec.generation
        if slot is None or slot.node_id != node.node_id or generation != slot.generation:
            self.generations.learn(generation, f"engine {engine.engine_id} on {node.node_id}")
            if self.state.keeping_unknown:
                return  # a new store: kept until a deployment is applied (controller/engines/adoption.py)
            if slot is not None and slot.node_id == node.node_id and generation == 0:
                return  # a copy not launched by a controller (cannot be stale-fenced safely)
            if engine.state in LIVE_ENGINE_STATES:
                if slot is None:
                    why = "it is not part of the deployment"
                elif slot.node_id != node.node_id:
                    why = f"it is assigned to {slot.node_id or 'no node'} now (generation {slot.generation})"
                else:
                    why = f"the current generation is {slot.generation}"
                self.state.nodes.room_changed.add(node.node_id)  # it holds accelerators there (fleet_view.py)
                self.actuator.stop_copy(
                    node.node_id,
                    engine.engine_id,
                    generation,
                    f"stale copy (generation {generation}): {why}",
                    fence=True,
                )
            return
        slot.launched = True
        if slot.adopt_ports(engine.spec):  # ports the node manager allocated
            self.state.save_slot(slot)
        if engine.HasField("stop_grace"):
            slot.stop_grace = pbtime.seconds(engine.stop_grace)
        if (slot.draining, slot.sleeping) != (engine.draining, engine.sleeping):
            slot.draining, slot.sleeping = engine.draining, engine.sleeping
            self.state.engines_changed([slot.engine_id])
        if slot.not_serving_reason != engine.not_serving_reason:
            self._serving_changed(slot, node.node_id, engine.not_serving_reason)
        if slot.state == engine.state and slot.health == engine.health and slot.health_reason == engine.health_reason:
            return
        # Interned: the same few reasons for thousands of engines are one string each.
        slot.state, slot.health, slot.health_reason = engine.state, engine.health, sys.intern(engine.health_reason)
        if (
            slot.failed_at is not None
            and engine.state == T.ENGINE_STATE_RUNNING
            and engine.health == T.HEALTH_STATUS_NORMAL
        ):
            self.metrics.recovery_seconds.observe(self.state.mono() - slot.failed_at)
            slot.failed_at = None
        self.state.engines_changed([slot.engine_id])
        if engine.state in DEAD_ENGINE_STATES and slot.handled_failure_generation != generation:
            self.engine_failed(slot, node.node_id, reason or engine.state_reason or exit_words(engine))
            return
        inst = self.state.instances.get(slot.instance_id)
        if inst is not None:
            self.state.evaluate(inst)

    def _serving_changed(self, slot: EngineSlot, node_id: str, reason: str) -> None:
        """The engine's stall watchdog changed its mind: out of (or back into) the endpoints now,
        and an event that names why."""
        slot.not_serving_reason = sys.intern(reason)
        self.state.engines_changed([slot.engine_id])
        if reason:
            what = f"engine {slot.engine_id} on {node_id} not serving: {reason}; out of the endpoints"
        else:
            what = f"engine {slot.engine_id} on {node_id} serving again"
        self.state.event(
            C.EVENT_TYPE_ENGINE_NOT_SERVING, what, node_id=node_id, instance_id=slot.instance_id,
            engine_id=slot.engine_id,
        )  # fmt: skip

    # ------------------------------------------------------------------ failures and restarts

    def engine_failed(self, slot: EngineSlot, node_id: str, reason: str, final: bool = False) -> None:
        """The current copy of a slot failed: restart its rank or group (maybe after a backoff), or
        give up when the crash-loop budget is spent, or at once when no restart can help (`final`:
        the node refused the spec itself)."""
        st = self.state
        slot.handled_failure_generation = slot.generation
        slot.last_failure_reason = reason
        if slot.failed_at is None:
            slot.failed_at = st.mono()
        what = f"engine {slot.engine_id} on {node_id} {reason}"
        st.event(
            C.EVENT_TYPE_ENGINE_FAILED, what, node_id=node_id, instance_id=slot.instance_id, engine_id=slot.engine_id
        )
        inst = st.instances.get(slot.instance_id)
        if inst is None:
            return
        policy = st.policy_of(inst)  # the instance's deployment's own restart policy
        if inst.state == FAILED:
            st.save_slot(slot)
            return
        if inst.state == RESTARTING:
            # A restart is already pending: this failure belongs to it (ranks that died together,
            # reported one by one, e.g. all at once when the controller comes back). One failure
            # per instance per restart, however the reports arrive.
            ranks = range(inst.data_parallel_size) if policy.group_scope else [slot.dp_rank]
            inst.restart_ranks = tuple(sorted(set(inst.restart_ranks) | set(ranks)))
            with st.batch():
                st.save_slot(slot)
                st.save_instance(inst)
            st.attention.add(inst.instance_id)
            return
        if final:
            with st.batch():
                st.save_slot(slot)
                inst.restart_ranks, inst.next_restart_at = (), None
                st.transition(
                    inst,
                    FAILED,
                    f"{what}; not restarted: the node would refuse the same spec again (fix what it names: the "
                    "node's settings or the deployment); left alone until the deployment is applied again",
                )
                st.save_instance(inst)
            return
        now = st.wall()
        decision = on_failure(inst, policy, now)
        with st.batch():
            st.save_slot(slot)
            if decision.give_up:
                inst.restart_ranks, inst.next_restart_at = (), None
                st.transition(
                    inst,
                    FAILED,
                    f"crash-loop budget spent: {decision.failures_in_window} failures within "
                    f"{policy.failure_window:g}s; last: {what}; left alone until the deployment is applied again",
                )
                st.save_instance(inst)
                return
            ranks = range(inst.data_parallel_size) if policy.group_scope else [slot.dp_rank]
            inst.restart_ranks = tuple(sorted(set(inst.restart_ranks) | set(ranks)))
            inst.next_restart_at = now + decision.delay
            when = "now" if decision.delay == 0 else f"in {decision.delay:g}s"
            scope = "its data-parallel group" if policy.group_scope else "the rank"
            st.transition(
                inst,
                RESTARTING,
                f"{what}; restarting {scope} {when} (failure {decision.failures_in_window} of "
                f"{policy.max_failures} allowed within {policy.failure_window:g}s)",
            )
            st.save_instance(inst)
        self.metrics.reschedules.labels(reason="engine_failed").inc()
        st.attention.add(inst.instance_id)
        self.schedule_restart(inst, decision.delay)

    def schedule_restart(self, inst: InstanceRecord, delay: float) -> None:
        timer = self._restart_timers.pop(inst.instance_id, None)
        if timer:
            timer.cancel()
        if delay <= 0 and self.startup_done():
            self.loop.spawn(self.restart(inst.instance_id), f"restart {inst.instance_id}")
        else:
            loop = asyncio.get_running_loop()
            self._restart_timers[inst.instance_id] = loop.call_later(max(delay, 0.0), self.loop.wake)

    async def restart(self, instance_id: str) -> None:
        st = self.state
        inst = st.instances.get(instance_id)
        if inst is None or inst.state != RESTARTING:
            return
        slots = [s for s in st.slots_of(instance_id) if s.dp_rank in set(inst.restart_ranks)]
        if any(s.busy for s in slots) or st.store.busy:
            return  # a start/stop is still in flight, or a big write: the reconcile loop comes back
        try:  # durable generations first: without them nothing changes and the reconcile loop comes back
            generations = [st.store.next_generation() for _ in slots]
        except StoreUnavailable as exc:
            st.refused(exc)
            return
        old: dict[str, tuple[str, int]] = {}
        with st.batch():
            for s, generation in zip(slots, generations):
                node = st.nodes.get(s.node_id)
                if s.node_id and (node is None or node.state != NODE_READY):
                    st.unplace(s)  # its node is not usable: place the rank afresh
                if s.node_id:
                    old[s.engine_id] = (s.node_id, s.generation)
                st.slots.new_generation(s, generation)
                s.restarts += 1
                st.save_slot(s)
            inst.restarts += 1
            ranks = ",".join(str(s.dp_rank) for s in slots)
            inst.restart_ranks, inst.next_restart_at = (), None
            if any(not s.node_id for s in st.slots_of(instance_id)):
                st.transition(inst, PENDING, f"restart {inst.restarts}: rank(s) {ranks} need a new place")
            else:
                st.transition(inst, STARTING, f"restart {inst.restarts}: starting rank(s) {ranks} again")
            st.save_instance(inst)
        await asyncio.gather(*(self._replace_copy(s, old.get(s.engine_id)) for s in slots if s.node_id))
        self.loop.wake()

    async def _replace_copy(self, slot: EngineSlot, old: tuple[str, int] | None) -> None:
        """Stop an older copy still running (group restarts), then launch the new generation."""
        st = self.state
        if old is not None:
            node_id, generation = old
            node = st.nodes.get(node_id)
            copy = node.engines.get(slot.engine_id) if node else None
            if node is not None and copy is not None and copy[reported.STATE] in LIVE_ENGINE_STATES:
                slot.busy = True
                try:
                    await self.actuator.stop(node.info, slot.engine_id, generation)
                except NodeCallError as exc:
                    logger.warning(
                        "could not stop %s (generation %d) on %s: %s", slot.engine_id, generation, node_id, exc
                    )
                finally:
                    slot.busy = False
        if st.slots.get(slot.engine_id) is slot:
            await self.launch(slot)

    # ------------------------------------------------------------------ launches

    async def launch(self, slot: EngineSlot) -> None:
        """StartEngine for a slot's current generation. A start the node refuses is a failure like
        any other; an unreachable node is tried again after a backoff; a node that answers as
        another node is set aside."""
        st = self.state
        inst = st.instances.get(slot.instance_id)
        node = st.nodes.get(slot.node_id)
        if inst is None or node is None or slot.busy:
            return
        rank0 = st.slots.get(names.engine_id(inst.instance_id, 0))
        spec = engine_spec(slot, inst, rank0.host if rank0 else slot.host, st.config_of(inst))
        slot.busy = True
        try:
            engine = await self.actuator.start(node.info, slot.engine_id, spec)
        except NodeCallError as exc:
            if st.slots.get(slot.engine_id) is not slot or slot.generation != spec.generation:
                return
            if slot.node_id != node.node_id:  # its node was lost meanwhile (the call abandoned): placed again now
                self.loop.wake()
                return
            if exc.waits:
                # An unreachable node (its liveness is the node monitor's call), or accelerators
                # still held by an old copy stopping there: try again after a backoff (one
                # RETRYING event counts the tries: controller/engines/actuator.py), not a failure.
                slot.retry_at = st.mono() + self.actuator.retry_delay(slot.engine_id)
                st.attention.add(slot.instance_id)
                return
            if exc.refusal is Refusal.WRONG_NODE:  # not the node's fault of an engine: placed elsewhere
                self.set_aside(node, str(exc))
                return
            # A spec the node refuses as such is refused again at every restart: FAILED at once.
            final = exc.refusal is Refusal.NEVER
            self.engine_failed(slot, node.node_id, f"could not be started: StartEngine {exc}", final=final)
            return
        finally:
            slot.busy = False  # whatever ended the call (a cancelled task too): the slot is never left busy
        if st.slots.get(slot.engine_id) is not slot or slot.generation != spec.generation:
            return
        slot.launched = True
        st.event(
            C.EVENT_TYPE_ENGINE_STARTED,
            f"engine {slot.engine_id} started on {node.node_id} (generation {spec.generation}, "
            f"port {engine.spec.port or spec.port}, pid {engine.pid})",
            node_id=node.node_id,
            instance_id=slot.instance_id,
            engine_id=slot.engine_id,
        )
        node.engines.setdefault(engine.engine_id or slot.engine_id, reported.keep(engine))
        self.observe(node, engine, "")

    # ------------------------------------------------------------------ moves off nodes

    async def move(self, instance_id: str, ranks: list[int], why: str) -> None:
        """Take ranks off their nodes (stopping copies that still run) so they are placed again."""
        st = self.state
        inst = st.instances.get(instance_id)
        if inst is None:
            return
        slots = [s for s in st.slots_of(instance_id) if s.dp_rank in set(ranks) and s.node_id]
        for s in slots:
            s.busy = True
        try:
            stops = []
            for s in slots:
                node = st.nodes.get(s.node_id)
                if node is not None and node.state == NODE_READY:
                    stops.append(self.actuator.stop(node.info, s.engine_id, s.generation))
            results = await asyncio.gather(*stops, return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    logger.warning("stopping a copy of %s while moving it: %s", instance_id, result)
        finally:
            for s in slots:
                s.busy = False
        if st.instances.get(instance_id) is not inst:
            return
        with st.batch():
            for s in slots:
                st.unplace(s)
                st.save_slot(s)
            if inst.state != FAILED:
                st.transition(inst, PENDING, f"{why}: waiting for placement")
        self.loop.wake()

    def set_aside(self, node: NodeRuntime, answer: str) -> None:
        """A StartEngine sent to the node's address was answered by another node's node manager (a
        wrong --advertise-address, a stolen certificate): the node gets no new engines until it
        registers again, and its ranks are placed elsewhere. No engine failed: no budget is spent."""
        if not node.unusable:
            self.state.nodes.room_changed.add(node.node_id)  # the placement view drops it
            node.unusable = node.reason = (
                f"its address {node.info.address} answers as another node: it gets no engines until it registers "
                "again with its own address (check its --advertise-address)"
            )
        self.state.events.repeat(
            ("misaddressed", node.node_id),
            C.EVENT_TYPE_NODE_CONFLICT,
            f"node {node.node_id}: {node.unusable}; StartEngine there: {answer}",
            node_id=node.node_id,
        )
        self.evacuate(node, f"node {node.node_id}, whose address answers as another node")

    def evacuate(self, node: NodeRuntime, what: str = "") -> None:
        """A node was declared lost (or set aside): its ranks are placed again (their whole group
        with them when the scope is the group or rank 0 moves)."""
        where = what or f"lost node {node.node_id}"
        st = self.state
        # A StartEngine still waiting on the node would hold its rank here until its timeout (15 s).
        self.actuator.client.abandon(node.node_id, f"abandoned: {where}")
        by_instance: dict[str, list[int]] = {}
        with st.batch():
            for s in st.slots.on_node(node.node_id):
                if s.failed_at is None:
                    s.failed_at = st.mono()
                st.unplace(s)
                st.save_slot(s)
                by_instance.setdefault(s.instance_id, []).append(s.dp_rank)
            for instance_id, ranks in sorted(by_instance.items()):
                inst = st.instances.get(instance_id)
                if inst is None or inst.state == FAILED:
                    continue
                if inst.state == RESTARTING:
                    inst.restart_ranks, inst.next_restart_at = (), None
                st.transition(inst, PENDING, f"rank(s) {','.join(map(str, ranks))} were on {where}")
                others = [s.dp_rank for s in st.slots_of(instance_id) if s.node_id]
                if others and (st.policy_of(inst).group_scope or 0 in ranks):
                    self.loop.spawn(
                        self.move(instance_id, others, what or f"node {node.node_id} lost"), f"move {instance_id}"
                    )
        self.loop.wake()


def exit_words(engine: T.Engine) -> str:
    """The failure's words when the node gave none (its reports normally carry them)."""
    if engine.state == T.ENGINE_STATE_STOPPED:
        return "stopped outside the controller"
    if engine.HasField("exit_signal") or engine.HasField("exit_code"):
        return describe_exit(
            engine.exit_code if engine.HasField("exit_code") else None,
            engine.exit_signal if engine.HasField("exit_signal") else None,
        )
    return "failed"
