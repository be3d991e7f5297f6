"""Scheduling: the reconcile pass over the instances that need attention, placement (with the
reschedule rate limit), moves off nodes, and failures: the restart policy's decision, then
restarts (timers, new generations).

Everything runs on the controller's asyncio loop; a task that awaited a node manager re-checks
the slot or instance it started with before acting on the answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

from motor.v1 import controller_pb2, types_pb2

from controller.actuator import Actuator
from controller.config import ControllerConfig
from controller.fleet_view import FleetView
from controller.instances import FAILED, PENDING, RESTARTING, STARTING, InstanceRecord, on_failure
from controller.node_client import NodeCallError
from controller.nodes import NODE_LOST, NODE_READY, NodeRuntime
from controller.placement import Fleet, Unplaceable, place_instance
from controller.slicing import Budget, Steps, run_at_once
from controller.slots import EngineSlot
from controller.state import ClusterState
from controller.store import StoreUnavailable
from controller import reported

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
LIVE_ENGINE_STATES = {T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING}
# Launches spawned and not finished, at most: the node client runs 64 at a time anyway, and a
# pass that spawned one for each of 40,000 placed engines held 40,000 waiting tasks, a transient
# heap that doubled the controller's and set off a complete garbage walk (0.14-0.34 s).
LAUNCHES_OPEN = 1024


class TokenBucket:
    """Reschedule rate limit: `rate` per second, bursts up to `rate`."""

    def __init__(self, rate: float, clock: Callable[[], float]):
        self.rate, self.clock = rate, clock
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self.updated = clock()

    def available(self, count: int) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        # A move bigger than the burst goes through once the bucket is full.
        return count <= self.tokens or self.tokens >= self.capacity

    def take(self, count: int) -> None:
        self.tokens -= count


class Scheduler:
    def __init__(
        self,
        state: ClusterState,
        config: ControllerConfig,
        actuator: Actuator,
        launch: Callable[[EngineSlot], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine, str], object],
        wake: Callable[[], None],
        count_reschedule: Callable[[str], None],
        count_rate_limited: Callable[[int], None] = lambda engines: None,
    ):
        self.state, self.config, self.actuator = state, config, actuator
        self.launch, self.spawn, self.wake, self.count_reschedule = launch, spawn, wake, count_reschedule
        self.count_rate_limited = count_rate_limited
        # Instances whose move the rate limit holds back now (counted once per hold-back).
        self._held_back: set[str] = set()
        self.reschedule_bucket = TokenBucket(config.reschedule_rate, state.mono)
        # Until then (monotonic), nothing is started unless every known node has reported.
        self.startup_until = state.mono()
        self._restart_timers: dict[str, asyncio.TimerHandle] = {}
        self.fleet_view = FleetView(state)
        self.launches_open = 0  # launch tasks spawned and not finished (at most LAUNCHES_OPEN)

    def cancel_timers(self) -> None:
        for handle in self._restart_timers.values():
            handle.cancel()

    def startup_done(self) -> bool:
        if self.state.mono() >= self.startup_until:
            return True
        return all(n.reported_since_start for n in self.state.nodes.values() if n.state != NODE_LOST)

    # ------------------------------------------------------------------ the reconcile pass

    def reconcile_once(self) -> None:
        """One whole pass at once (tests); the controller's loop runs `reconcile_steps` in slices."""
        run_at_once(self.reconcile_steps())

    def reconcile_steps(self) -> Steps:
        """The pass over the instances that need attention, yielding between slices. It stops
        while a big store write runs outside the loop (it would wait for it): the next pass
        goes on."""
        st = self.state
        st.flush()  # writes the store refused before, when their backoff has passed
        if not self.startup_done() or st.store.busy:
            return
        budget = Budget()
        now_wall, now = st.wall(), st.mono()
        fleet: Fleet | None = None
        for instance_id in sorted(st.attention, key=st.placement_order):  # first come, first served
            if (yield from budget.checkpoint()):
                if st.store.busy:
                    return
                now_wall, now, fleet = st.wall(), st.mono(), None  # anything may have changed meanwhile
            if instance_id in st.leaving:
                # A deployment change removes or replaces it (controller/deployments.py): placed
                # meanwhile, it would be started only to be stopped (a delete of 10,000 PENDING
                # instances freeing room slice by slice started and stopped thousands of them).
                continue
            inst = st.instances.get(instance_id)
            if inst is None or inst.state == FAILED:
                st.attention.discard(instance_id)
                continue
            slots = st.slots_of(instance_id)
            if inst.state == RESTARTING:
                # Re-armed every pass once due: a restart whose timer or task was lost (its
                # generation could not be stored) is never stranded.
                if inst.next_restart_at is not None and inst.next_restart_at <= now_wall and now >= st.store_retry_at:
                    self.spawn(self.restart(instance_id), f"restart {instance_id}")
                    budget.spawned()
                continue
            if any(s.busy for s in slots):
                continue
            unplaced = [s for s in slots if not s.node_id]
            if unplaced:
                if now < st.store_retry_at:
                    continue  # placing needs new generations in the store: after its backoff
                if fleet is None:
                    fleet = self.fleet_view.fleet()
                self._place(inst, unplaced, fleet)
                continue
            waiting = False
            for s in slots:
                if s.launched:
                    continue
                waiting = True
                node = st.nodes.get(s.node_id)
                if node is not None and node.state == NODE_READY and s.retry_at <= now:
                    if self.launches_open >= LAUNCHES_OPEN:
                        continue  # the rest when launches finish (it wakes the next pass)
                    self.launches_open += 1
                    self.spawn(self._counted(self.launch(s)), f"launch {s.engine_id}")
                    budget.spawned()
            if not waiting:
                st.attention.discard(instance_id)

    async def _counted(self, launch: Coroutine[Any, Any, None]) -> None:
        try:
            await launch
        finally:
            self.launches_open -= 1
            if self.launches_open == LAUNCHES_OPEN // 2:
                self.wake()  # room for the launches the last passes held back

    # ------------------------------------------------------------------ placement and moves

    def _place(self, inst: InstanceRecord, unplaced: list[EngineSlot], fleet: Fleet) -> None:
        st = self.state
        rank0_moves = any(s.dp_rank == 0 for s in unplaced)
        placed_ranks = [s for s in st.slots_of(inst.instance_id) if s.node_id]
        if rank0_moves and placed_ranks:
            # Rank 0's host is every rank's --master-dp-ip: move the group with it.
            self.spawn(self.move(inst.instance_id, [s.dp_rank for s in placed_ranks], "rank 0 moves"), f"move {inst.instance_id}")
            return
        moved = sum(1 for s in unplaced if s.moved)
        if moved and not self.reschedule_bucket.available(moved):
            st.transition(inst, PENDING, f"waiting for the reschedule rate limit ({self.config.reschedule_rate:g} engines/s)")
            if inst.instance_id not in self._held_back:
                self._held_back.add(inst.instance_id)
                self.count_rate_limited(moved)
            return
        self._held_back.discard(inst.instance_id)
        try:
            placements = place_instance(
                [s.dp_rank for s in unplaced], inst.accelerators_per_engine, inst.single_container, fleet
            )
        except Unplaceable as exc:
            st.transition(inst, PENDING, f"cannot be placed: {exc}")
            return
        try:  # durable generations first (one write for the instance), or nothing changes
            with st.store.transaction():
                generations = [st.store.next_generation() for _ in unplaced]
        except StoreUnavailable as exc:
            for p in placements:
                fleet.give_back(fleet.nodes[p.node_id], p.accelerator_ids, p.port_count)
            st.refused(exc)
            return
        self.reschedule_bucket.take(moved)
        by_rank = {p.dp_rank: p for p in placements}
        with st.batch():
            for s, generation in zip(unplaced, generations):
                if s.moved:
                    self.count_reschedule("node_lost")
                p = by_rank[s.dp_rank]
                st.slots.place(s, p.node_id, p.host, list(p.accelerator_ids), p.port_count, generation)
                st.save_slot(s)
            where = ", ".join(f"rank {p.dp_rank} on {p.node_id}" for p in placements)
            st.transition(inst, STARTING, f"placed: {where}")
        self.wake()

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
        self.wake()

    def set_aside(self, node: NodeRuntime, answer: str) -> None:
        """A StartEngine sent to the node's address was answered by another node's node manager (a
        wrong --advertise-address, a stolen certificate): the node gets no new engines until it
        registers again, and its ranks are placed elsewhere. No engine failed: no budget is spent."""
        if not node.unusable:
            self.state.nodes.room_changed.add(node.node_id)  # the placement view drops it
            node.unusable = node.reason = (
                f"its address {node.info.address} answers as another node: it gets no engines until it registers "
                "again with its own address (check its --advertise-address)")
        self.state.events.repeat(("misaddressed", node.node_id), C.EVENT_TYPE_NODE_CONFLICT,
                                 f"node {node.node_id}: {node.unusable}; StartEngine there: {answer}", node_id=node.node_id)
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
                    self.spawn(self.move(instance_id, others, what or f"node {node.node_id} lost"), f"move {instance_id}")
        self.wake()

    # ------------------------------------------------------------------ restarts

    def engine_failed(self, slot: EngineSlot, node_id: str, reason: str) -> None:
        """The current copy of a slot failed: restart its rank or group (maybe after a backoff), or
        give up when the crash-loop budget is spent."""
        st = self.state
        slot.handled_failure_generation = slot.generation
        slot.last_failure_reason = reason
        if slot.failed_at is None:
            slot.failed_at = st.mono()
        what = f"engine {slot.engine_id} on {node_id} {reason}"
        st.event(C.EVENT_TYPE_ENGINE_FAILED, what, node_id=node_id, instance_id=slot.instance_id, engine_id=slot.engine_id)
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
        now = st.wall()
        decision = on_failure(inst, policy, now)
        with st.batch():
            st.save_slot(slot)
            if decision.give_up:
                inst.restart_ranks, inst.next_restart_at = (), None
                st.transition(
                    inst, FAILED,
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
                inst, RESTARTING,
                f"{what}; restarting {scope} {when} (failure {decision.failures_in_window} of "
                f"{policy.max_failures} allowed within {policy.failure_window:g}s)",
            )
            st.save_instance(inst)
        self.count_reschedule("engine_failed")
        st.attention.add(inst.instance_id)
        self.schedule_restart(inst, decision.delay)

    def schedule_restart(self, inst: InstanceRecord, delay: float) -> None:
        timer = self._restart_timers.pop(inst.instance_id, None)
        if timer:
            timer.cancel()
        if delay <= 0 and self.startup_done():
            self.spawn(self.restart(inst.instance_id), f"restart {inst.instance_id}")
        else:
            loop = asyncio.get_running_loop()
            self._restart_timers[inst.instance_id] = loop.call_later(max(delay, 0.0), self.wake)

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
        self.wake()

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
                    logger.warning("could not stop %s (generation %d) on %s: %s", slot.engine_id, generation, node_id, exc)
                finally:
                    slot.busy = False
        if st.slots.get(slot.engine_id) is slot:
            await self.launch(slot)
