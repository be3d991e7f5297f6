"""Rolling updates: a deployment whose instances' spec changed is rolled out per group in waves
bounded by max_surge and max_unavailable (controller/deploy/rollout_plan.py has the units), driven from
the reconcile pass (controller/capacity/scheduling.py).

A step: start new units while the group holds fewer than count + max_surge and fewer than count
are current; withdraw an old unit (from the routers first, then the engines drain and stop, the
scale-down path) while the available units stay at least count - max_unavailable. Available
(controller/deploy/availability.py): every engine listed to the routers and routed by the front door, a
new unit also READY for `min_ready`. COMPLETE: every unit current and `count` of them available.

A new unit that fails (a crash, an engine ABNORMAL, a FAILED instance) or is not available within
`progress_deadline` of the last progress pauses the rollout: the old units keep serving and are
never restarted by it. Every step goes through the store (the instances carry their spec, the
paused flag, its reason and the previous deployment are the rollout record), so a restarted
controller reads where the rollout stands from the store and goes on from there.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.deploy.availability import Availability
from controller.deploy.rollout_plan import UnitGroup, retiring, unit_groups
from controller.engines.actuator import Actuator
from controller.model.cluster import ClusterState
from controller.model.deployments import COMPLETE, PAUSED, PROGRESSING, Deployments, Rollout
from controller.model.instances import FAILED, READY, InstanceRecord
from controller.routing.endpoints import SERVING_INSTANCE_STATES
from controller.rules.deployment_checks import strategy_problems
from controller.rules.expansion import GroupSpecs, InstanceSpec
from controller.rules.slicing import Budget, Steps, run_at_once
from controller.store.interface import StoreUnavailable
from motor.contract import pbtime
from motor.errors import FailedPrecondition
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
# Instances one step starts or withdraws at most: a step is written to the store on the loop, and
# 10,000 idle old instances withdrawn in one step held it 0.7 s. The next pass goes on at once.
STEP_LIMIT = 64


class DeploymentWrites(Protocol):
    """What a rollout changes through the deployment's changes (controller/deploy/changes.py), durable
    first like any change."""

    wake: Callable[[], None]

    @property
    def busy(self) -> bool: ...  # a change is being made: the rollout waits for it

    def step(self, name: str, removed: list[tuple[str, str]], new: list[InstanceSpec]) -> None: ...

    def retry_failed(self, inst: InstanceRecord) -> None: ...

    def apply(
        self,
        deployment: C.Deployment,
        adjust: Callable[[C.Deployment], C.Deployment] | None = None,
        autoscaled: bool = False,
    ) -> Coroutine[Any, Any, tuple[C.Deployment, int]]: ...


@dataclass
class Wave:
    """What one step of a rollout does (its groups' steps fill it in turn) and finds."""

    specs: GroupSpecs
    strategy: C.UpdateStrategy
    stopping: set[tuple[str, str]]  # (group, index) of ids whose engines are still being stopped
    removed: list[tuple[str, str]] = field(default_factory=list)  # (instance id, why)
    new: list[InstanceSpec] = field(default_factory=list)
    available_current: int = 0
    complete: bool = True


@dataclass
class Counts:
    updated: int = 0
    available: int = 0
    old: int = 0
    updated_available: int = 0  # what COMPLETE waits for: the desired count


@dataclass(eq=False)
class Rollouts:
    """The rollouts of every deployment: stepped from the reconcile pass, paused, resumed and
    undone by an operator. Their records live with the deployments (controller/model/deployments.py)."""

    state: ClusterState
    deployments: Deployments
    changes: DeploymentWrites
    availability: Availability
    actuator: Actuator

    @property
    def rollouts(self) -> dict[str, Rollout]:
        return self.deployments.rollouts

    def _move(self, name: str, rollout: Rollout, state: int, reason: str, event: bool = True, **where) -> None:
        self.deployments.move(name, rollout, state, reason, event, **where)

    def _save(self, name: str, rollout: Rollout) -> None:
        self.state.store.save_rollout(name, rollout.record())

    # ------------------------------------------------------------------ the operator's calls

    def pause(self, name: str) -> None:
        name = self.deployments.named(name)
        rollout = self.rollouts.setdefault(name, Rollout())
        before, by_operator = (rollout.state, rollout.reason), rollout.paused_by_operator
        self._move(name, rollout, PAUSED, "paused by an operator (`motorctl rollout resume` goes on)")
        rollout.paused_by_operator = True
        try:
            self._persist_or_undo(name, rollout, before)
        except StoreUnavailable:
            rollout.paused_by_operator = by_operator
            raise

    def resume(self, name: str) -> None:
        name = self.deployments.named(name)
        rollout = self.rollouts.setdefault(name, Rollout())
        if rollout.state != PAUSED:
            return
        before, since = (rollout.state, rollout.reason), rollout.since
        rollout.since, rollout.progress_at = self.state.wall(), self.state.mono()
        self._move(name, rollout, PROGRESSING, "resumed")
        try:
            self._persist_or_undo(name, rollout, before)
        except StoreUnavailable:
            rollout.since = since
            raise
        hashes = GroupSpecs(self.deployments.by_name[name][0]).hashes
        for inst in self._records(name):  # a FAILED new instance gets a new chance
            if inst.state == FAILED and hashes.get(inst.group) == inst.spec_hash:
                self.changes.retry_failed(inst)
        self.changes.wake()

    async def pause_durably(self, name: str) -> None:
        """PauseRollout: answers once the pause is in the store (etcd writes from a task: without
        the wait a leader lost right after the answer would forget a pause it acknowledged)."""
        self.pause(name)
        await self.state.store.flush()

    async def resume_durably(self, name: str) -> None:
        self.resume(name)
        await self.state.store.flush()

    def _persist_or_undo(self, name: str, rollout: Rollout, before: tuple[int, str]) -> None:
        try:
            self._save(name, rollout)
        except StoreUnavailable as exc:
            rollout.state, rollout.reason = before
            self.state.refused(exc)
            raise

    async def undo(self, name: str) -> tuple[C.Deployment, int]:
        """Apply the previous revision's deployment again (a new revision, rolled out alike)."""
        name = self.deployments.named(name)
        rollout = self.rollouts.get(name)
        if rollout is None or rollout.previous is None:
            raise FailedPrecondition(f"name: deployment {name!r} has no previous revision to go back to")
        previous = C.Deployment.FromString(base64.b64decode(rollout.previous))
        return await self.changes.apply(previous)

    # ------------------------------------------------------------------ views

    def counts(self, name: str) -> Counts:
        deployment = self.deployments.by_name[name][0]
        groups, strays = run_at_once(unit_groups(GroupSpecs(deployment), self._records(name)))
        counts = Counts(old=sum(1 for r in strays if not r.spare))  # of a renamed group
        counts.available = sum(1 for r in strays if not r.spare and self.availability.serving([r]))
        for ug in groups:
            for k in ug.units:
                size = len(ug.records(k))
                if ug.is_current(k):
                    counts.updated += size
                else:
                    counts.old += size
                if self._available(ug, k, effective(deployment.strategy)):
                    counts.available += size
                    if ug.is_current(k):
                        counts.updated_available += size
        return counts

    def status(self, name: str) -> tuple[int, str]:
        rollout = self.rollouts.get(name, Rollout())
        return rollout.state, rollout.reason

    def paused_by_operator(self, name: str) -> bool:
        rollout = self.rollouts.get(name)
        return rollout is not None and rollout.state == PAUSED and rollout.paused_by_operator

    def autoscaled(self, name: str) -> bool:
        """The deployment's revision is the autoscaler's own change (its rollout brings no new spec)."""
        rollout = self.rollouts.get(name)
        return rollout is not None and rollout.autoscaled

    # ------------------------------------------------------------------ the pass

    def steps(self) -> Steps:
        """A step of every rollout in progress (from the reconcile pass)."""
        if self.changes.busy or self.state.mono() < self.state.store_retry_at:
            return
        budget = Budget()
        for name, rollout in list(self.rollouts.items()):
            if rollout.state != PROGRESSING or name not in self.deployments.by_name:
                continue
            deployment = self.deployments.by_name[name][0]
            groups, strays = yield from unit_groups(GroupSpecs(deployment), self._records(name), budget)
            if self.changes.busy or self.rollouts.get(name) is not rollout:
                return  # a change began meanwhile: the next pass reads it
            if rollout.state != PROGRESSING:
                continue  # paused meanwhile (an operator's pause is never overwritten)
            try:
                self._step(name, rollout, deployment, groups, strays)
            except StoreUnavailable as exc:
                self.state.refused(exc)
                return

    def _step(
        self,
        name: str,
        rollout: Rollout,
        deployment: C.Deployment,
        groups: list[UnitGroup],
        strays: list[InstanceRecord] | None = None,
    ) -> None:
        """One step, read top-down: a failing new unit pauses it; per group, scale the new units
        up, clean up the old-spec spares and the renamed group's instances, scale the old units
        down; then complete, or sync the status (progress, the deadline) and write the wave."""
        failing = self._failing(rollout, groups)
        if failing:
            self._pause_itself(name, rollout, *failing)
            return
        wave = Wave(GroupSpecs(deployment), effective(deployment.strategy), self._stopping())
        taken_over = retiring(groups, strays or [], wave.specs)
        for place, ug in enumerate(groups):
            self._step_group(wave, ug, taken_over.get(place, []))
        if wave.complete:
            done = f"complete: every instance runs revision {self._revision(name)} and is available"
            self._move(name, rollout, COMPLETE, done, event=rollout.announced)
            return
        if self._sync_status(name, rollout, wave, groups):
            return  # paused: no progress within the deadline
        if wave.removed or wave.new:
            self._write(name, rollout, wave)

    def _stopping(self) -> set[tuple[str, str]]:
        """(group, index) of the ids whose engines are still being stopped (a withdrawn or removed
        instance draining): a new unit does not take one, or its start would meet the old copy."""
        stopping = {engine_id.split("/")[0].rpartition("-")[::2] for _, engine_id, _ in self.actuator.unfinished}
        return {(g, i) for g, i in stopping if i.isdigit()}

    def _step_group(self, wave: Wave, ug: UnitGroup, renamed: list[InstanceRecord]) -> None:
        """One group's part of the wave. `renamed`: instances of a renamed group, old units of
        this one (withdrawn while enough serve)."""
        current, old = ug.current(), ug.old()
        draining = {int(i) for g, i in wave.stopping if g in ug.groups}
        in_use = {*ug.units, *ug.spares, *draining}
        available = {k for k in ug.units if self._available(ug, k, wave.strategy)}
        renamed_serving = [r for r in renamed if self.availability.serving([r])]
        available_here = sum(1 for k in current if k in available)
        wave.available_current += available_here
        # Complete only when the new revision's count serves: not merely started.
        if renamed or old or len(current) < ug.count or available_here < ug.count:
            wave.complete = False
        self._scale_up_new(wave, ug, len(current), len(renamed), in_use)
        self._clean_up_old_spares(wave, ug, bool(old or renamed), available_here, in_use)
        serving = len(available) + len(renamed_serving) // len(ug.groups)
        serving = self._withdraw_renamed(wave, ug, renamed, renamed_serving, serving)
        self._scale_down_old(wave, ug, old, available, serving)

    def _scale_up_new(self, wave: Wave, ug: UnitGroup, current: int, renamed: int, in_use: set[int]) -> None:
        """Start new units while the group holds fewer than count + max_surge and fewer than count are current."""
        held = len(ug.units) + renamed // len(ug.groups)
        starts = min(ug.count + wave.strategy.max_surge - held, ug.count - current, STEP_LIMIT - len(wave.new))
        wave.new.extend(ug.new_specs(wave.specs, max(0, starts), in_use))

    def _clean_up_old_spares(
        self, wave: Wave, ug: UnitGroup, old_serving: bool, available_here: int, in_use: set[int]
    ) -> None:
        """Old-spec spares (kept by the change, or an old serving unit a promotion made a spare)
        are replaced once the new version serves the whole count: until then the old version is
        the proven one a failure should promote."""
        keep_spares, old_spares = ug.spare_layout()
        if old_spares:
            wave.complete = False
        if old_spares and not old_serving and available_here >= ug.count:
            stale = [r for k in old_spares for r in ug.records(k, ug.spares)]
            wave.removed.extend((r.instance_id, "a spare of an older spec") for r in stale)
            taken = {*in_use, *(s.index for s in wave.new if s.group == ug.groups[0])}
            wave.new.extend(ug.new_specs(wave.specs, ug.spare_count - len(keep_spares), taken, spare=True))

    def _withdraw_renamed(
        self,
        wave: Wave,
        ug: UnitGroup,
        renamed: list[InstanceRecord],
        renamed_serving: list[InstanceRecord],
        serving: int,
    ) -> int:
        """Withdraw a renamed group's instances (those serving nothing first) while the serving
        units stay at least count - max_unavailable; the serving count left."""
        floor = ug.count - wave.strategy.max_unavailable
        for r in sorted(renamed, key=lambda r: r in renamed_serving):
            if len(wave.removed) >= STEP_LIMIT:
                break
            if r in renamed_serving or r.state in SERVING_INSTANCE_STATES:
                if serving - 1 < floor:
                    break
                serving -= 1 if r in renamed_serving else 0
            wave.removed.append((r.instance_id, "its group was renamed: replaced by the rollout"))
        return serving

    def _scale_down_old(self, wave: Wave, ug: UnitGroup, old: list[int], available: set[int], serving: int) -> None:
        """Withdraw old units while the available ones stay at least count - max_unavailable:
        those plainly down first (they cost nothing). One READY but not listed may be serving
        unseen (a restarted controller has not heard from its node yet): it goes only while
        enough others are available."""
        floor = ug.count - wave.strategy.max_unavailable

        def down(k: int) -> bool:
            return not all(r.state in SERVING_INSTANCE_STATES for r in ug.records(k))

        for k in sorted(old, key=lambda k: (k in available, not down(k))):
            if len(wave.removed) >= STEP_LIMIT:
                break
            if k not in available and not down(k) and serving < floor:
                continue
            if k in available:
                if serving - 1 < floor:
                    break
                serving -= 1
            wave.removed.extend((r.instance_id, "replaced by the rollout") for r in ug.records(k))

    def _sync_status(self, name: str, rollout: Rollout, wave: Wave, groups: list[UnitGroup]) -> bool:
        """Progress (more new units available) resets the deadline; a wave with nothing to do
        waits for a new unit, or pauses past progress_deadline. True when it paused."""
        rollout.announced = True
        if wave.available_current > rollout.available_current:
            rollout.progress_at = self.state.mono()
        rollout.available_current = wave.available_current
        deadline = pbtime.seconds(wave.strategy.progress_deadline)
        waiting = self._first_unavailable(groups, wave.strategy)
        if not wave.removed and not wave.new and waiting is not None:
            if self.state.mono() - rollout.progress_at > deadline:
                self._pause_itself(
                    name, rollout, waiting, f"not available within progress_deadline ({deadline:g}s): {waiting.reason}"
                )
                return True
            rollout.reason = f"waiting for {waiting.instance_id} to be available: {waiting.reason}"
        return False

    def _write(self, name: str, rollout: Rollout, wave: Wave) -> None:
        """The wave's withdrawals and starts, durable first (controller/deploy/changes.py: step)."""
        rollout.progress_at = self.state.mono()
        self.changes.step(name, wave.removed, wave.new)
        steps = (
            ("withdrawn and drained", [i for i, _ in wave.removed]),
            ("started", [s.instance_id for s in wave.new]),
        )
        for why, ids in steps:
            if ids:
                self._move(name, rollout, PROGRESSING, f"{', '.join(ids)} {why}")

    def _pause_itself(self, name: str, rollout: Rollout, inst: InstanceRecord, cause: str) -> None:
        rollout.paused_by_operator = False
        self._move(
            name,
            rollout,
            PAUSED,
            f"paused: new instance {inst.instance_id} {cause}; the old instances keep serving "
            "(apply a fixed spec, `motorctl rollout undo` or `resume`)",
            instance_id=inst.instance_id,
        )
        logger.warning("rollout of %s: %s", name, rollout.reason)
        self._save(name, rollout)

    # ------------------------------------------------------------------ what a unit is

    def _records(self, name: str) -> list[InstanceRecord]:
        return [self.state.instances[i] for i in self.state.instances_of(name)]

    def _revision(self, name: str) -> int:
        return self.deployments.by_name[name][1]

    def _available(self, ug: UnitGroup, index: int, strategy: C.UpdateStrategy) -> bool:
        """Every instance of the unit there and available (controller/deploy/availability.py); a current
        unit also READY for `min_ready` (an old one serving is available however recently it came
        back: withdrawing it costs service)."""
        records = ug.records(index)
        if len(records) != len(ug.groups):
            return False
        settle = pbtime.seconds(strategy.min_ready) if ug.is_current(index) else None
        return self.availability.available(records, settle)

    def _failing(self, rollout: Rollout, groups: list[UnitGroup]) -> tuple[InstanceRecord, str] | None:
        """The first current instance that failed since the rollout (re)started, and how."""
        for ug in groups:
            # A new spare too: a promotion may have swapped a failing new serving unit into one.
            units = [ug.records(k) for k in ug.current()]
            units += [ug.records(k, ug.spares) for k in ug.spares if ug.is_current(k, ug.spares)]
            for unit in units:
                for inst in unit:
                    if inst.state == FAILED and inst.state_changed_at >= rollout.since:
                        return inst, f"is FAILED: {inst.reason}"
                    if any(t >= rollout.since for t in inst.failure_times):
                        return inst, f"failed: {self._cause(inst)}"
                    for slot in self.state.slots_of(inst.instance_id):
                        if slot.health == T.HEALTH_STATUS_ABNORMAL:
                            return inst, f"engine {slot.engine_id} is ABNORMAL: {slot.health_reason}"
        return None

    def _cause(self, inst: InstanceRecord) -> str:
        """What made the instance fail (its engine's last failure), not what its restart waits for."""
        for slot in self.state.slots_of(inst.instance_id):
            if slot.last_failure_reason:
                return f"engine {slot.engine_id} {slot.last_failure_reason}"
        return inst.reason

    def _first_unavailable(self, groups: list[UnitGroup], strategy: C.UpdateStrategy) -> InstanceRecord | None:
        for ug in groups:
            for k in ug.current():
                if not self._available(ug, k, strategy):
                    records = ug.records(k)  # all READY: not yet for min_ready, or not routed yet
                    return next((r for r in records if r.state != READY), records[0]) if records else None
        return None


def effective(strategy: C.UpdateStrategy) -> C.UpdateStrategy:
    """`strategy` with its defaults (a deployment stored before strategies had none)."""
    out = C.UpdateStrategy()
    out.CopyFrom(strategy)
    strategy_problems(out)
    return out
