"""A deployment's instances as units, per group: what a change keeps, leaves to the rollout, stops
and starts, and what each step of a rolling update sees.

A unit is one instance "<group>-<index>", or, for paired groups (a prefill group's `pair_with`),
the prefill instance and the decode instance of the same index: a pair is started, counted
available and withdrawn together, so instance i keeps pairing with instance i. A unit is current
when every instance of it exists and runs the deployment's spec (its spec_hash). A new unit takes
the lowest index of its groups that no instance holds: the old one keeps serving under its own id
while the new one loads.

Warm spares (controller/capacity/spares.py) are units too, kept apart: the serving units are what a
rollout counts and replaces in waves. Under rolling the spare units on an older spec stay until
the new version serves the whole count (a failure meanwhile promotes the proven version), then the
rollout replaces them at once (they serve nothing); under recreate a change replaces them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from controller.model.instances import InstanceRecord
from controller.rules.expansion import GroupSpecs, InstanceSpec
from controller.rules.slicing import Budget, Steps
from motor.v1 import controller_pb2

C = controller_pb2


@dataclass
class UnitGroup:
    """The units of one group, or of a prefill group and its decode group."""

    groups: tuple[str, ...]
    count: int
    hashes: tuple[str, ...]
    # index -> the unit's instances, one per group (None: that one does not exist)
    units: dict[int, list[InstanceRecord | None]] = field(default_factory=dict)
    spare_count: int = 0
    # The warm spare units, the same way (a promotion moves a unit between the two).
    spares: dict[int, list[InstanceRecord | None]] = field(default_factory=dict)

    def is_current(self, index: int, units: dict[int, list[InstanceRecord | None]] | None = None) -> bool:
        unit = (self.units if units is None else units)[index]
        return all(r is not None and r.spec_hash == h for r, h in zip(unit, self.hashes))

    def spare_layout(self) -> tuple[list[int], list[int]]:
        """The spare units to keep (current, up to spare_count) and those to stop (old, or too many)."""
        current = [k for k in sorted(self.spares) if self.is_current(k, self.spares)]
        keep = current[: self.spare_count]
        return keep, [k for k in sorted(self.spares) if k not in keep]

    def current(self) -> list[int]:
        return [k for k in sorted(self.units) if self.is_current(k)]

    def old(self) -> list[int]:
        return [k for k in sorted(self.units) if not self.is_current(k)]

    def records(self, index: int, units: dict[int, list[InstanceRecord | None]] | None = None) -> list[InstanceRecord]:
        return [r for r in (self.units if units is None else units)[index] if r is not None]

    def free_indices(self, taken: Collection[int]) -> Iterator[int]:
        index = 0
        while True:
            if index not in taken:
                yield index
            index += 1

    def new_specs(
        self, specs: GroupSpecs, how_many: int, taken: Collection[int] | None = None, spare: bool = False
    ) -> list[InstanceSpec]:
        """Specs of `how_many` new units at the lowest indices not `taken` (default: held by any
        instance, serving or spare)."""
        free = self.free_indices({*self.units, *self.spares} if taken is None else taken)
        return [specs.spec(g, k, spare) for k in (next(free) for _ in range(how_many)) for g in self.groups]


def retiring(
    groups: list[UnitGroup], strays: list[InstanceRecord], specs: GroupSpecs
) -> dict[int, list[InstanceRecord]]:
    """The instances of groups no longer in the deployment (renamed under rolling), by the unit
    group that takes them over (the first with a group of their role): the rollout withdraws them
    as old units while enough others are available."""
    out: dict[int, list[InstanceRecord]] = {}
    for record in strays:
        for place, ug in enumerate(groups):
            if any(specs.groups[g].role == record.role for g in ug.groups):
                out.setdefault(place, []).append(record)
                break
    return out


def index_of(record: InstanceRecord) -> int:
    """The index of "<group>-<index>" (ids are made so; the group name is its prefix)."""
    return int(record.instance_id[len(record.group) + 1 :])


def unit_groups(
    specs: GroupSpecs, records: Iterable[InstanceRecord], budget: Budget | None = None
) -> Steps[tuple[list[UnitGroup], list[InstanceRecord]]]:
    """The deployment's unit groups filled with `records`, and the records of no group of it."""
    out: list[UnitGroup] = []
    of_group: dict[str, tuple[UnitGroup, int]] = {}
    for name, group in specs.groups.items():
        if name in of_group:
            continue  # the decode group of a pair met earlier
        partner = specs.partners.get(name) if group.pair_with else None
        members = (name,) if partner is None or partner in of_group else (name, partner)
        unit_group = UnitGroup(members, group.count, tuple(specs.hashes[g] for g in members), spare_count=group.spares)
        out.append(unit_group)
        for place, member in enumerate(members):
            of_group[member] = (unit_group, place)
    strays = []
    for record in records:
        found = of_group.get(record.group)
        if found is None:
            strays.append(record)
        else:
            unit_group, place = found
            units = unit_group.spares if record.spare else unit_group.units
            units.setdefault(index_of(record), [None] * len(unit_group.groups))[place] = record
        if budget is not None:
            yield from budget.checkpoint()
    return out, strays


@dataclass
class Layout:
    """What a change does to one deployment's instances."""

    kept: list[InstanceSpec] = field(default_factory=list)  # already on the new spec
    old: list[str] = field(default_factory=list)  # on an older spec: the rollout replaces them
    removed: list[tuple[str, str]] = field(default_factory=list)  # (instance id, why)
    new: list[InstanceSpec] = field(default_factory=list)


def plan_layout(
    deployment: C.Deployment,
    records: Iterable[InstanceRecord],
    budget: Budget | None = None,
    serving: Callable[[list[InstanceRecord]], bool] | None = None,
) -> Steps[Layout]:
    """Per unit group: keep up to `count` current units; with a rolling strategy keep old ones for
    the rollout to replace, with recreate stop them at once; stop the rest; start new units for
    what is missing (a higher count, or recreate).

    Which units stay is decided by what serves (`serving`, over a unit's records: available now):
    serving units are kept before those that do not, old or new, so a change never stops a
    serving unit the count still needs (a fix applied while a bad version is paused keeps the
    old instance that serves and stops the crashing one). Under rolling, every serving old unit is
    kept while the kept units serve fewer than `count` (the rollout withdraws it once a new one is
    available), then old ones up to `count`; a lower count stops non-serving units first."""
    rolling = deployment.strategy.type != C.UPDATE_STRATEGY_TYPE_RECREATE
    specs = GroupSpecs(deployment)
    groups, strays = yield from unit_groups(specs, records, budget)
    layout = Layout()
    roles = {g.role for g in deployment.instance_groups}
    for r in strays:
        if rolling and r.role in roles and not r.spare and serving is not None and serving([r]):
            # Its group was renamed: it serves until the rollout has the new group available.
            layout.old.append(r.instance_id)
        else:
            layout.removed.append((r.instance_id, "no longer in the deployment"))
    for ug in groups:

        def up(k: int, ug: UnitGroup = ug) -> bool:
            unit = ug.records(k)
            return serving is not None and len(unit) == len(ug.groups) and serving(unit)

        # Serving units first, then by index (sorted is stable).
        current = sorted(ug.current(), key=lambda k: not up(k))
        old = sorted(ug.old(), key=lambda k: not up(k))
        keep = current[: ug.count]
        keep_old: list[int] = []
        if rolling:
            serving_kept = sum(1 for k in keep if up(k))
            keep_old = [k for k in old if up(k)][: max(0, ug.count - serving_kept)]
            rest = [k for k in old if k not in keep_old]
            keep_old += rest[: max(0, ug.count - len(keep) - len(keep_old))]
        layout.kept.extend(specs.spec(g, k) for k in sorted(keep) for g in ug.groups)
        layout.old.extend(r.instance_id for k in sorted(keep_old) for r in ug.records(k))
        for k in sorted(current[ug.count :] + [k for k in old if k not in keep_old]):
            if k in current:
                why = "no longer in the deployment"
            elif not rolling:
                why = "its spec changed; replaced at once (strategy recreate)"
            else:
                why = "on an older spec and not serving: stopped (the serving instances are kept)"
            layout.removed.extend((r.instance_id, why) for r in ug.records(k))
        # Spares serve nothing: with recreate those on an older spec (or too many) stop at once and
        # new ones start. With rolling the old-spec spares stay until the rollout has the new
        # version serving (controller/deploy/rollout.py replaces them then): a new version that turns
        # out bad must not be what a failure promotes, nor cost the spare that was READY.
        keep_spares, stop_spares = ug.spare_layout()
        keep_old_spares: list[int] = []
        if rolling:
            old_spares = [k for k in stop_spares if not ug.is_current(k, ug.spares)]
            keep_old_spares = old_spares[: max(0, ug.spare_count - len(keep_spares))]
            stop_spares = [k for k in stop_spares if k not in keep_old_spares]
            layout.old.extend(r.instance_id for k in keep_old_spares for r in ug.records(k, ug.spares))
        # Recreate starts the new units under the ids of those it stops (the old behaviour).
        taken = {*ug.units, *ug.spares} if rolling else {*keep, *keep_spares}
        serving_new = ug.new_specs(specs, max(0, ug.count - len(keep) - len(keep_old)), taken)
        layout.new.extend(serving_new)
        layout.kept.extend(specs.spec(g, k, spare=True) for k in keep_spares for g in ug.groups)
        for k in stop_spares:
            why = "a spare of an older spec, or one too many: replaced at once (it serves nothing)"
            layout.removed.extend((r.instance_id, why) for r in ug.records(k, ug.spares))
        taken |= {s.index for s in serving_new}
        layout.new.extend(
            ug.new_specs(specs, ug.spare_count - len(keep_spares) - len(keep_old_spares), taken, spare=True)
        )
        if budget is not None:
            yield from budget.checkpoint()
    return layout
