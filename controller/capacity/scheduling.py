"""Scheduling: the reconcile pass over the instances that need attention and placement (with the
reschedule rate limit). What happens to a placed engine (launch, failure, restart, moves off
nodes) is controller/engines/lifecycle.py's; the pass calls it.

Everything runs on the controller's asyncio loop.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from controller.capacity.fleet_view import FleetView
from controller.capacity.spares import Spares
from controller.config import ControllerConfig
from controller.deploy.rollout import Rollouts
from controller.engines.lifecycle import ControllerLoop, EngineLifecycle
from controller.metrics import ControllerMetrics
from controller.model.cluster import ClusterState
from controller.model.instances import FAILED, PENDING, RESTARTING, STARTING, InstanceRecord
from controller.model.nodes import NODE_READY
from controller.model.slots import EngineSlot
from controller.rules.placement import Fleet, Unplaceable, place_instance
from controller.rules.slicing import Budget, Steps, run_at_once
from controller.store.interface import StoreUnavailable
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
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
        lifecycle: EngineLifecycle,
        metrics: ControllerMetrics,
        loop: ControllerLoop,
        spares: Spares,
        rollouts: Rollouts,
    ):
        self.state, self.config, self.lifecycle, self.metrics, self.loop = state, config, lifecycle, metrics, loop
        self.spares, self.rollouts = spares, rollouts  # rollouts: a step of each ends every pass
        # Instances whose move the rate limit holds back now (counted once per hold-back).
        self._held_back: set[str] = set()
        self.reschedule_bucket = TokenBucket(config.reschedule_rate, state.mono)
        self.fleet_view = FleetView(state, kv_events=config.kv_events)
        self.launches_open = 0  # launch tasks spawned and not finished (at most LAUNCHES_OPEN)
        self._serving_waits = False
        self._spread: dict[str, Counter[str]] | None = None  # group -> its serving instances by node (one pass)
        self._spares_to_preempt = True

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
        if not self.lifecycle.startup_done() or st.store.busy:
            return
        budget = Budget()
        now_wall, now = st.wall(), st.mono()
        fleet: Fleet | None = None
        self._spread = None  # counted again at this pass's first placement
        self._serving_waits = False  # a serving instance found no room in this pass: no spare is placed
        self._spares_to_preempt = True  # until a look finds none that would help (one look per pass at most)
        for instance_id in sorted(st.attention, key=st.placement_order):  # first come, first served
            if (yield from budget.checkpoint()):
                if st.store.busy:
                    return
                # Anything may have changed meanwhile. (The spread counts are kept: a preference,
                # not room; counting them again at every slice made a 10,000-instance apply quadratic.)
                now_wall, now, fleet = st.wall(), st.mono(), None
            if instance_id in st.leaving:
                # A deployment change removes or replaces it (controller/deploy/changes.py): placed
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
                    self.loop.spawn(self.lifecycle.restart(instance_id), f"restart {instance_id}")
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
                    self.loop.spawn(self._counted_launch(s), f"launch {s.engine_id}")
                    budget.spawned()
            if not waiting:
                st.attention.discard(instance_id)
        yield from self.rollouts.steps()

    @staticmethod
    def _would_fit(inst: InstanceRecord, spare_rank: EngineSlot, fleet: Fleet) -> bool:
        """Whether one rank of `inst` fits on the spare rank's node once the spare is stopped."""
        node = fleet.nodes.get(spare_rank.node_id)
        return node is not None and len(node.free_accelerators) + len(spare_rank.accelerator_ids) >= (
            inst.accelerators_per_engine
        )

    async def _counted_launch(self, slot: EngineSlot) -> None:
        # The launch coroutine is made here, in the task: a task cancelled before it runs (the
        # controller stopping) leaves no coroutine that was never awaited.
        try:
            await self.lifecycle.launch(slot)
        finally:
            self.launches_open -= 1
            if self.launches_open == LAUNCHES_OPEN // 2:
                self.loop.wake()  # room for the launches the last passes held back

    # ------------------------------------------------------------------ placement

    def _group_spread(self, inst: InstanceRecord) -> Counter[str]:
        """The nodes holding the serving instances of `inst`'s group, each counted once per
        instance (its ranks together): placement spreads the group from them. Counted for every
        group in one sweep at a pass's first placement, then kept up to date by its placements."""
        if self._spread is None:  # every group's, in one sweep of the instances
            st = self.state
            self._spread = {}
            for other in st.instances.values():
                if not other.spare:
                    nodes = {s.node_id for s in st.slots_of(other.instance_id) if s.node_id}
                    if nodes:
                        self._spread.setdefault(other.group, Counter()).update(nodes)
        return self._spread.setdefault(inst.group, Counter())

    def _place(self, inst: InstanceRecord, unplaced: list[EngineSlot], fleet: Fleet) -> None:
        st = self.state
        rank0_moves = any(s.dp_rank == 0 for s in unplaced)
        placed_ranks = [s for s in st.slots_of(inst.instance_id) if s.node_id]
        if rank0_moves and placed_ranks:
            # Rank 0's host is every rank's --master-dp-ip: move the group with it.
            self.loop.spawn(
                self.lifecycle.move(inst.instance_id, [s.dp_rank for s in placed_ranks], "rank 0 moves"),
                f"move {inst.instance_id}",
            )
            return
        moved = sum(1 for s in unplaced if s.moved)
        if moved and not self.reschedule_bucket.available(moved):
            st.transition(
                inst, PENDING, f"waiting for the reschedule rate limit ({self.config.reschedule_rate:g} engines/s)"
            )
            if inst.instance_id not in self._held_back:
                self._held_back.add(inst.instance_id)
                self.metrics.rate_limited.inc(moved)
            return
        self._held_back.discard(inst.instance_id)
        if inst.spare and self._serving_waits:
            st.transition(inst, PENDING, "a warm spare: waits while a serving instance has no room")
            return
        try:
            placements = place_instance(
                [s.dp_rank for s in unplaced],
                inst.accelerators_per_engine,
                inst.single_container,
                fleet,
                self.spares.avoid(inst),
                self._group_spread(inst),
                self.config.kv_events,
            )
        except Unplaceable as exc:
            st.transition(inst, PENDING, f"cannot be placed: {exc}")
            if not inst.spare:
                self._serving_waits = True
                if self._spares_to_preempt:
                    if self.spares.preempt_for(inst, lambda s: self._would_fit(inst, s, fleet)):
                        self.loop.wake()
                    else:
                        self._spares_to_preempt = False
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
        if not inst.spare:
            self._group_spread(inst).update({p.node_id for p in placements})
        by_rank = {p.dp_rank: p for p in placements}
        with st.batch():
            for s, generation in zip(unplaced, generations):
                if s.moved:
                    self.metrics.reschedules.labels(reason="node_lost").inc()
                p = by_rank[s.dp_rank]
                st.slots.place(s, p.node_id, p.host, list(p.accelerator_ids), p.port_count, generation)
                st.save_slot(s)
            where = ", ".join(f"rank {p.dp_rank} on {p.node_id}" for p in placements)
            st.transition(inst, STARTING, f"placed: {where}")
        self.loop.wake()
