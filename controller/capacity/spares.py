"""Warm spares: promotion and room for serving instances. The other spare rules live with their
concern, each in one place: a change plans spare units apart from the serving ones and keeps the
old-spec ones under rolling (controller/deploy/rollout_plan.py: plan_layout, UnitGroup.spare_layout); a
rollout replaces the old-spec ones once the new version serves the whole count
(controller/deploy/rollout.py); spares are placed after the serving instances (ClusterState.placement_order)
and never routed (endpoints.can_serve).

A group with `spares: N` has count serving instances and N more that carry the spare flag
(InstanceRecord.spare), each "<group>-<index>". A spare is placed and started like any instance,
on a node that holds no serving instance of its group where one has room (`avoid`).

- Promotion: when a serving instance fails (its engine died, was killed after abnormal
  heartbeats, or its node was lost) or merely stops serving (READY -> DEGRADED: an engine
  ABNORMAL, e.g. dead while the node manager still kills its tree) and a spare of its group is
  READY, the two swap flags in one store transaction: the spare is routed at once, the other
  goes on as the new spare (restarting if it failed). One trigger: every instance state change
  (ClusterState.transition -> its listener, the Controller -> `state_changed`), where the
  failure paths record what happened. Ids and counts never change, so a controller restart
  reads back exactly who serves.
- A P/D pair (a prefill instance and its decode partner) is promoted whole: the READY spare pair
  takes the place of the pair whose member failed, and the failed pair becomes the spare pair.
  A data-parallel instance is one instance: its ranks are promoted together.
- Only a proven spare is promoted: every member runs the spec of the instance it replaces (what
  a restart would start anyway) or a spec an instance of its group serves on now without a recent
  failure. A spare of a version that serves nowhere (a paused bad version's new instance that a
  promotion turned into a spare, READY between its crashes) is never promoted: it waits as a
  spare until a change replaces it.
- A spare that fails restarts as a spare: nothing serving is touched.
- Spares never hold accelerators a serving instance waits for: no spare is placed while a
  serving instance cannot be, and such an instance preempts a placed spare (its engines stop,
  it waits as PENDING until there is room again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from controller.deploy.availability import Availability
from controller.engines.actuator import Actuator
from controller.model.cluster import ClusterState
from controller.model.instances import DEGRADED, FAILED, PENDING, READY, RESTARTING, InstanceRecord, state_name
from controller.model.slots import EngineSlot
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
# What a serving instance enters when it goes down (a failure decided, its node lost).
GONE_DOWN = (RESTARTING, FAILED, PENDING)


class Spares:
    """The spare rules over the shared state (keeps nothing of its own)."""

    def __init__(self, state: ClusterState, actuator: Actuator, availability: Availability):
        self.state, self.actuator, self.availability = state, actuator, availability

    # ------------------------------------------------------------------ reading

    def members(self, group: str) -> Iterator[InstanceRecord]:
        """The group's instances, serving and spare, by id. Ids are not 0..count+spares-1 (a rolling
        update starts new ones at free indices), so every instance is looked at: called for groups
        with spares only, on a failure, a spare READY or a placement, not on every pass."""
        return iter(sorted((i for i in self.state.instances.values() if i.group == group), key=lambda i: i.instance_id))

    def unit(self, inst: InstanceRecord) -> list[InstanceRecord]:
        """What is promoted or retired together: the instance and its P/D partner, if any."""
        partner = self.state.instances.get(inst.paired_instance_id) if inst.paired_instance_id else None
        return [inst] if partner is None else [inst, partner]

    def ready(self, unit: list[InstanceRecord]) -> bool:
        return all(i.spare and i.state == READY for i in unit)

    def ready_spare(self, group: str, replacing: list[InstanceRecord] = ()) -> list[InstanceRecord] | None:
        """A READY and proven spare unit of the group (lowest index first) to serve in place of
        `replacing` (nothing: as added capacity), or None."""
        if not self.state.deployments.spares_of(group):
            return None
        for inst in self.members(group):
            if inst.spare and inst.state == READY:
                unit = self.unit(inst)
                if self.ready(unit) and self.proven(unit, replacing):
                    return unit
        return None

    def proven(self, unit: list[InstanceRecord], replacing: list[InstanceRecord] = ()) -> bool:
        """Every member runs the spec of the instance of its group it replaces (a restart would
        start that spec anyway), or a spec that serves now: a spare of a version that serves
        nowhere (a paused bad version's) is not what a failure should bring into service."""
        for member in unit:
            if any(r.group == member.group and r.spec_hash == member.spec_hash for r in replacing):
                continue
            if not any(self._serves_on(other, member.spec_hash) for other in self.members(member.group)):
                return False
        return True

    def _serves_on(self, inst: InstanceRecord, spec_hash: str) -> bool:
        """A serving instance on `spec_hash`, listed to the routers now (controller/deploy/availability.py:
        serving) and without a failure in its restart policy's window (a crashing version is READY
        between its crashes)."""
        if inst.spare or inst.spec_hash != spec_hash or not self.availability.serving([inst]):
            return False
        now, window = self.state.wall(), self.state.policy_of(inst).failure_window
        return not any(now - t < window for t in inst.failure_times)

    # ------------------------------------------------------------------ promotion

    def promote_for(self, failed: InstanceRecord, why: str) -> bool:
        """A serving instance failed: a READY spare of its group takes its place (one store
        transaction for the swap). True when one did; `failed` goes on as usual (its restart),
        now as a spare."""
        if failed.spare:
            return False  # a spare restarts as a spare
        retired = self.unit(failed)
        spare = self.ready_spare(failed.group, retired)
        if spare is None:
            return False
        st = self.state
        with st.batch():
            self._flag(spare, False)
            self._flag(retired, True)
        names = ", ".join(i.instance_id for i in spare)
        st.event(
            C.EVENT_TYPE_SPARE,
            f"spare {names} promoted: serves in place of {', '.join(i.instance_id for i in retired)} ({why}), "
            "which restarts as the new spare",
            instance_id=spare[0].instance_id,
            deployment=st.deployment_of(spare[0]),
        )
        return True

    def promote_to_serve(self, group: str, why: str) -> list[InstanceRecord] | None:
        """Scale-up (controller/capacity/autoscaler.py): a READY spare unit of the group serves from now on,
        its flag turned off like a promotion's; the deployment's change that raises the count then
        starts a new spare in its place. None when no spare is READY."""
        spare = self.ready_spare(group)
        if spare is None:
            return None
        with self.state.batch():
            self._flag(spare, False)
        st = self.state
        st.event(
            C.EVENT_TYPE_SPARE,
            f"spare {', '.join(i.instance_id for i in spare)} promoted: serves as added capacity ({why})",
            instance_id=spare[0].instance_id,
            deployment=st.deployment_of(spare[0]),
        )
        return spare

    def state_changed(self, inst: InstanceRecord, old: int) -> None:
        """The one trigger of a promotion (ClusterState.transition calls it on every state change).
        A serving instance that stops serving (READY -> DEGRADED: an engine ABNORMAL, or dead and
        its tree still being killed) or goes down (its engine failed: RESTARTING or FAILED; its
        node lost: PENDING) is replaced by a READY spare at once: it goes on as the spare (it
        serves again, or restarts, out of the routers). A spare that becomes READY takes the place
        of a serving instance that is down."""
        if not inst.spare and old != FAILED and (old == READY or inst.state in GONE_DOWN):
            self.promote_for(inst, f"it is {state_name(inst.state)}: {inst.reason}")
        elif inst.spare and inst.state == READY:
            self._became_ready(inst)

    def _became_ready(self, inst: InstanceRecord) -> None:
        unit = self.unit(inst)
        if not self.ready(unit):
            return  # its partner is not READY yet: promoted when it is
        # A P/D pair takes the place of a pair with any member down: look in each member's group
        # (the prefill may be READY last while the decode that failed is in the other group).
        for group in dict.fromkeys(i.group for i in unit):
            for member in self.members(group):
                if not member.spare and self._down(member):
                    self.promote_for(member, f"it is {state_name(member.state)} after a failure")
                    return

    @staticmethod
    def _down(inst: InstanceRecord) -> bool:
        """Not serving after having served or failed (a first start still loading is not down)."""
        return inst.state != READY and (inst.state in (DEGRADED, RESTARTING) or bool(inst.failure_times))

    def _flag(self, unit: list[InstanceRecord], spare: bool) -> None:
        st = self.state
        for inst in unit:
            inst.spare = spare
            st.save_instance(inst)
            st.engines_changed([s.engine_id for s in st.slots_of(inst.instance_id)])

    # ------------------------------------------------------------------ room for serving instances

    def avoid(self, inst: InstanceRecord) -> frozenset[str]:
        """Nodes a spare should not go to when others have room: those of its group's serving
        instances (a node lost would take a serving instance and its spare together)."""
        if not inst.spare:
            return frozenset()
        st = self.state
        return frozenset(
            s.node_id
            for other in self.members(inst.group)
            if not other.spare
            for s in st.slots_of(other.instance_id)
            if s.node_id
        )

    def preempt_for(self, waiting: InstanceRecord, helps: Callable[[EngineSlot], bool]) -> bool:
        """A serving instance cannot be placed: stop one placed spare (of any deployment) with a
        rank whose accelerators would give it room (`helps`). True when one was preempted (the
        next pass places `waiting`)."""
        st = self.state
        for group in st.deployments.groups_with_spares():
            for inst in self.members(group):
                if not inst.spare or inst.state in (PENDING, FAILED):
                    continue
                slots = st.slots_of(inst.instance_id)
                if any(s.busy for s in slots):
                    continue  # a start or stop in flight: the next pass looks again
                if not any(s.node_id and s.accelerator_ids and helps(s) for s in slots):
                    continue
                self.preempt(inst, f"its accelerators go to serving instance {waiting.instance_id}, waiting for room")
                return True
        return False

    def preempt(self, inst: InstanceRecord, why: str) -> None:
        st = self.state
        slots = [s for s in st.slots_of(inst.instance_id) if s.node_id]
        with st.batch():
            for s in slots:
                self.actuator.stop_copy(s.node_id, s.engine_id, s.generation, f"spare {inst.instance_id} preempted")
                st.unplace(s, moved=False)
                st.save_slot(s)
            inst.restart_ranks, inst.next_restart_at = (), None
            st.transition(inst, PENDING, f"preempted: {why}")
        st.event(
            C.EVENT_TYPE_SPARE,
            f"spare {inst.instance_id} preempted: {why}",
            instance_id=inst.instance_id,
            deployment=st.deployment_of(inst),
        )
