"""ApplyDeployment and DeleteDeployment, without blocking the controller's loop.

The controller holds any number of deployments, each under its name with its own revision,
restart policy and engine config. A change concerns one deployment and leaves the others
alone. Instance ids are "<group>-<index>": an instance group name belongs to one deployment
(applying a deployment with a group another one has is INVALID_ARGUMENT), so an instance
belongs to exactly one deployment, found by its group (the deployments' home: `Deployments.owner`).

A change is planned per group (controller/deploy/rollout_plan.py: the instances kept, those on an older
spec left for the rollout to replace (controller/deploy/rollout.py) or, with strategy recreate, replaced
at once, those that go, the new ones), written to the store as one transaction (with the
deployment's rollout record), and only then made in memory: persist first, so
a store that refuses it (a full disk: UNAVAILABLE) leaves memory and the engines as they were.
Planning and the memory change are generators that yield between slices (controller/rules/slicing.py);
the store write runs in a thread (SQLite), so the loop goes on answering heartbeats and other
calls during a 10,000-instance change. The API answers once the change is durable and made in
memory: what an answer says is what ListInstances shows.

While a change is made in memory (seconds for 10,000 instances), readers see each instance either
as it was or as the change leaves it, never half of one: ListInstances may list some old and some
new instances; GetDeployment shows the new deployment from the moment it is durable. Changes are
made one at a time (a second ApplyDeployment waits for the first), and once written a change is
finished even if its caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field

from controller.deploy.availability import Availability
from controller.deploy.model_roots import check_local_paths
from controller.deploy.rollout_plan import plan_layout
from controller.engines.actuator import Actuator
from controller.engines.adoption import Adoption
from controller.model.cluster import ClusterState
from controller.model.deployments import Deployments, engine_config_json, rollout_record
from controller.model.instances import FAILED, RESTARTING, InstanceRecord
from controller.model.slots import EngineSlot
from controller.routing.endpoints import EndpointFeed
from controller.rules.deployment_checks import validate_deployment
from controller.rules.expansion import InstanceSpec
from controller.rules.slicing import Budget, Steps, in_slices, run_at_once, run_sliced
from controller.store.interface import LEGACY_DEPLOYMENT, StoreChange, StoreUnavailable
from motor.contract import names
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2

C = controller_pb2
NewInstances = dict[str, tuple[InstanceRecord, list[EngineSlot]]]


@dataclass
class Plan:
    name: str
    deployment: C.Deployment | None
    revision: int
    removed: list[tuple[str, str]] = field(default_factory=list)  # (instance id, why)
    new: NewInstances = field(default_factory=dict)
    kept: list[InstanceSpec] = field(default_factory=list)
    same: bool = False  # the spec applied already: only FAILED instances get a new chance
    rollout: dict | None = None  # the rollout record written with the change (controller/deploy/rollout.py)
    ended_adoption: bool = False  # a delete on a new store (controller/engines/adoption.py)


class DeploymentChanges:
    """The changes of a deployment (apply, delete, a rollout's step), made through its home
    (controller/model/deployments.py), which holds the deployment, its indexes and its rollout."""

    def __init__(
        self,
        state: ClusterState,
        deployments: Deployments,
        max_engines: int,
        endpoints: EndpointFeed,
        actuator: Actuator,
        adoption: Adoption,
        wake: Callable[[], None],
        spawn: Callable[[Coroutine, str], asyncio.Task],
        availability: Availability | None = None,
    ):
        self.state, self.home, self.max_engines, self.endpoints = state, deployments, max_engines, endpoints
        self.actuator, self.adoption, self.wake, self.spawn = actuator, adoption, wake, spawn
        self._one_at_a_time = asyncio.Lock()
        # What "available" means, for a change (which units to keep) and the rollouts
        # (controller/deploy/availability.py).
        self.availability = availability or Availability(state, endpoints)

    @property
    def busy(self) -> bool:
        """A change is being made (the old and the new instances are both in memory meanwhile)."""
        return self._one_at_a_time.locked()

    # ------------------------------------------------------------------ the calls

    def apply_now(self, deployment: C.Deployment) -> tuple[C.Deployment, int]:
        """Apply at once, holding the loop (start-up --deployment, unit tests)."""
        validated = validate_deployment(deployment, self.max_engines)
        plan = run_at_once(self._plan(validated))
        if not plan.same:
            self._persist(plan, self._store_change(plan))
        run_at_once(self._change_memory(plan))
        return self.home.by_name[validated.name]

    def delete_now(self, name: str = "") -> None:
        plan = run_at_once(self._plan(None, self.home.named(name, deleting=True)))
        if plan is not None:
            self._persist(plan, self._store_change(plan))
            run_at_once(self._change_memory(plan))

    async def apply(
        self,
        deployment: C.Deployment,
        adjust: Callable[[C.Deployment], C.Deployment] | None = None,
        autoscaled: bool = False,
    ) -> tuple[C.Deployment, int]:
        """ApplyDeployment in slices; answers once the change is durable and made in memory.
        `adjust` (the autoscaler's counts) is applied again in the change's turn, to the
        deployment as the changes before it left it: what it read before its turn, a change made
        meanwhile may have moved on. `autoscaled`: the autoscaler's own change, so marked in the
        rollout record it writes."""
        fit = adjust or (lambda d: d)
        validated = validate_deployment(fit(deployment), self.max_engines)  # refused before it waits its turn
        check_local_paths(validated, self.state.nodes.values())
        if adjust is None:
            return await self._in_turn(lambda: self._sliced(validated, autoscaled=autoscaled))
        return await self._in_turn(
            lambda: self._sliced(validate_deployment(fit(deployment), self.max_engines), autoscaled=autoscaled)
        )

    def dry_run(self, deployment: C.Deployment) -> tuple[C.Deployment, int]:
        """ApplyDeployment's checks without the change: the deployment with its defaults and the
        revision an apply would give it now (the current one when nothing would change)."""
        validated = validate_deployment(deployment, self.max_engines)
        self._check_groups(validated)
        current = self.home.by_name.get(validated.name)
        last = self.home.last_revision(validated.name)
        same = current is not None and (
            validated.SerializeToString(deterministic=True) == current[0].SerializeToString(deterministic=True)
        )
        return validated, last if same else last + 1

    async def delete(self, name: str = "") -> None:
        self.home.named(name, deleting=True)  # refused before it waits its turn; checked again in it
        await self._in_turn(lambda: self._sliced(None, self.home.named(name, deleting=True)))

    async def apply_on_new_store(self, deployment: C.Deployment) -> tuple[C.Deployment, int] | None:
        """The deferred start-up --deployment (controller/startup_deployment.py), in its turn;
        None when an API apply or delete ended the new store's wait first (the newer word)."""
        validated = validate_deployment(deployment, self.max_engines)

        async def change():
            return await self._sliced(validated) if self.adoption.waiting else None

        return await self._in_turn(change)

    async def _in_turn(self, change: Callable[[], Coroutine]):
        async def turn():
            async with self._one_at_a_time:
                return await change()

        # Shielded: a caller that goes away (deadline, cancel) does not stop a change half made.
        return await asyncio.shield(self.spawn(turn(), "deployment change"))

    async def _sliced(
        self, validated: C.Deployment | None, name: str = "", autoscaled: bool = False
    ) -> tuple[C.Deployment | None, int]:
        name = validated.name if validated is not None else name
        plan = await run_sliced(self._plan(validated, name, autoscaled))
        if plan is None:
            return None, 0
        if not plan.same:
            change = await run_sliced(self._build_change(plan))
            with self._leaving(plan):
                await self.state.store.write_change_async(change)
        await run_sliced(self._change_memory(plan))
        return self.home.by_name.get(name, (None, plan.revision))

    # ------------------------------------------------------------------ the steps

    def _plan(self, validated: C.Deployment | None, name: str = "", autoscaled: bool = False) -> Steps[Plan | None]:
        """What changes in the deployment `validated` names, or `name` (`validated` None: delete
        it; the plan None: nothing to do). The other deployments' instances are not looked at."""
        budget = Budget()
        name = validated.name if validated is not None else name or self.home.named(name, deleting=True)
        current = self.home.by_name.get(name)
        if validated is None and current is None:
            # A new store waiting to adopt what the nodes run: a delete ends the wait (revision 1).
            return Plan(LEGACY_DEPLOYMENT, None, 1, ended_adoption=True) if self.adoption.waiting else None
        if validated is None:
            plan = Plan(name, None, current[1])
            plan.removed = [(i, "deleted with the deployment") for i in self.state.instances_of(name)]
            return plan
        self._check_groups(validated)
        self._check_model_names(validated)
        records = [self.state.instances[i] for i in self.state.instances_of(name)]
        layout = yield from plan_layout(validated, records, budget, self.availability.serving)
        if current is not None and (
            validated.SerializeToString(deterministic=True) == current[0].SerializeToString(deterministic=True)
        ):
            return Plan(name, current[0], current[1], kept=layout.kept, same=True)
        last = self.home.last_revision(name)
        plan = Plan(name, validated, last + 1, removed=layout.removed, kept=layout.kept)
        config = engine_config_json(validated)  # one string shared by the new records
        for spec in layout.new:
            plan.new[spec.instance_id] = self._new_instance(spec, plan.revision, validated.model, name, config)
            yield from budget.checkpoint()
        previous = current[0].SerializeToString(deterministic=True) if current is not None else None
        plan.rollout = rollout_record(previous, current[1] if current else 0, self.state.wall(), autoscaled)
        return plan

    def _check_groups(self, validated: C.Deployment) -> None:
        """INVALID_ARGUMENT when a group name is another deployment's (its instance ids would be too)."""
        owner = self.home.owner
        taken = [
            f"instance_groups[{i}].name: {g.name!r} is a group of deployment {owner(g.name)!r} (instances are "
            "named '<group>-<index>' across all deployments): choose another group name"
            for i, g in enumerate(validated.instance_groups)
            if owner(g.name) not in ("", validated.name)
        ]
        if taken:
            raise InvalidArgument("; ".join(taken))

    def _check_model_names(self, validated: C.Deployment) -> None:
        """INVALID_ARGUMENT when an adapter of the deployment takes the name of another
        deployment's model or adapter, or its model is another deployment's adapter: a router
        sending by model would send one name's requests to engines that serve something else."""
        others: dict[str, str] = {}  # name -> what it is, where
        for name, (deployment, _) in self.home.by_name.items():
            if name == validated.name:
                continue
            others.setdefault(deployment.model, f"the model of deployment {name!r}")
            for adapter in deployment.adapters:
                others.setdefault(adapter.name, f"an adapter of deployment {name!r}")
        taken = [
            f"adapters[{i}].name: {a.name!r} is {others[a.name]}: give the adapter a name no other deployment serves"
            for i, a in enumerate(validated.adapters)
            if a.name in others
        ]
        if others.get(validated.model, "").startswith("an adapter"):
            taken.insert(
                0,
                f"model: {validated.model!r} is {others[validated.model]}: rename that adapter or serve this "
                "model under another name",
            )
        if taken:
            raise InvalidArgument("; ".join(taken))

    def _store_change(self, plan: Plan) -> StoreChange:
        return run_at_once(self._build_change(plan))

    def _build_change(self, plan: Plan) -> Steps[StoreChange]:
        """The rows the change writes and deletes, serialized in slices (the store's part is one transaction)."""
        budget = Budget()
        deployment = plan.deployment.SerializeToString(deterministic=True) if plan.deployment is not None else None
        change = StoreChange(deployment, plan.revision, name=plan.name, rollout=plan.rollout)
        for instance_id, _ in plan.removed:
            change.deleted_instances.append(instance_id)
            change.deleted_assignments.extend(s.engine_id for s in self.state.slots_of(instance_id))
            yield from budget.checkpoint()
        for inst, slots in plan.new.values():
            change.instances.append((inst.instance_id, inst.to_dict()))
            change.assignments.extend((s.engine_id, s.to_dict()) for s in slots)
            yield from budget.checkpoint()
        return change

    def _persist(self, plan: Plan, change: StoreChange) -> None:
        with self._leaving(plan):
            self.state.store.write_change(change)

    @contextlib.contextmanager
    def _leaving(self, plan: Plan) -> Iterator[None]:
        """Around the store write: StoreUnavailable (a full disk) leaves memory as it was. From the
        write until memory has caught up (an instance removed, a replaced one installed again),
        the write-behind leaves the rows of the instances the change removes or replaces alone:
        it would write back, or delete, what the change wrote."""
        st = self.state
        leaving = {instance_id for instance_id, _ in plan.removed}
        st.leaving |= leaving
        try:
            yield
        except StoreUnavailable as exc:
            st.leaving -= leaving
            st.refused(exc)
            raise
        st.store_ok()

    def _change_memory(self, plan: Plan) -> Steps[None]:
        st, budget = self.state, Budget()
        name = plan.name
        self.home.set_deployment(name, plan.deployment, plan.revision)
        self.endpoints.changed(())  # the models Motor serves may have changed (deployed_models)

        # Each slice's writes (paired ids, FAILED retries) go out together when the slice ends.
        def remove(item: tuple[str, str]) -> None:
            self._remove_instance(*item, budget)
            if item[0] not in plan.new:
                st.leaving.discard(item[0])  # a replaced one: once installed again

        def install(item: tuple[InstanceRecord, list[EngineSlot]]) -> None:
            self._install(*item)
            st.leaving.discard(item[0].instance_id)

        yield from in_slices(plan.removed, remove, budget, st.batch)
        yield from in_slices(plan.new.values(), install, budget, st.batch)
        if self.adoption.waiting:  # a new store: take over what the nodes run as described
            if plan.ended_adoption:
                self.adoption.end("deployment deleted on a new store")
                return
            with st.batch():
                self.adoption.adopt((inst for inst, _ in plan.new.values()), name)
        yield from in_slices(plan.kept, lambda spec: self._keep(spec, plan.revision), budget, st.batch)
        if plan.same:
            return
        self.home.record_change(name, plan.revision, plan.rollout if plan.deployment is not None else None)
        # Not st.event: that would re-read every engine for the endpoint feed, which heard of each
        # instance that went or came already.
        if plan.deployment is None:
            st.events.emit(
                C.EVENT_TYPE_DEPLOYMENT_CHANGED, f"deployment {name!r} deleted; stopping its engines", deployment=name
            )
        else:
            st.events.emit(
                C.EVENT_TYPE_DEPLOYMENT_CHANGED,
                f"deployment {name!r} applied (revision {plan.revision}, {self._serving_count(name)})",
                deployment=name,
            )
        self.wake()

    def _serving_count(self, name: str) -> str:
        """The deployment's instances now (a rolling update's old ones too: they serve until
        replaced), and how many of them serve."""
        st = self.state
        mine = [i for i in st.instances.values() if not i.spare and st.deployment_of(i) == name]
        return f"{len(mine)} instances, {sum(1 for i in mine if i.state == C.INSTANCE_STATE_READY)} serving"

    # ------------------------------------------------------------------ one instance

    def step(self, name: str, removed: list[tuple[str, str]], new: list[InstanceSpec]) -> None:
        """One step of a rolling update (a few instances), at once: durable first (StoreUnavailable
        leaves everything as it was), then in memory; a withdrawn instance leaves the routers
        before its engines are stopped (they drain)."""
        deployment, revision = self.home.by_name[name]
        plan = Plan(name, deployment, revision, removed=removed)
        config = self.home.config(name)
        plan.new = {
            spec.instance_id: self._new_instance(spec, revision, deployment.model, name, config) for spec in new
        }
        self._persist(plan, self._store_change(plan))
        with self.state.batch():
            for instance_id, why in plan.removed:
                self._remove_instance(instance_id, why)
                self.state.leaving.discard(instance_id)
            for inst, slots in plan.new.values():
                self._install(inst, slots)
        self.wake()

    def _new_instance(
        self, spec: InstanceSpec, revision: int, model: str, name: str, config: str
    ) -> tuple[InstanceRecord, list[EngineSlot]]:
        facts = asdict(spec)  # what the spec says of it, all but its place in the group
        del facts["index"]
        inst = InstanceRecord(
            **facts, state_changed_at=self.state.wall(), revision=revision, model=model, deployment=name, config=config
        )
        return inst, [
            EngineSlot(names.engine_id(spec.instance_id, r), spec.instance_id, r)
            for r in range(spec.data_parallel_size)
        ]

    def _install(self, inst: InstanceRecord, slots: list[EngineSlot]) -> None:  # memory only: the change wrote it
        st = self.state
        st.instances[inst.instance_id] = inst
        st.attention.add(inst.instance_id)
        for slot in slots:
            st.slots.add(slot)

    def _keep(self, spec: InstanceSpec, revision: int) -> None:
        inst = self.state.instances.get(spec.instance_id)
        if inst is None:
            return
        if (inst.paired_instance_id, inst.revision) != (spec.paired_instance_id, revision):
            # Its spec is the new revision's too (a change of the restart policy, the strategy, another group).
            inst.paired_instance_id, inst.revision = spec.paired_instance_id, revision
            inst.config = self.home.config(self.state.deployment_of(inst), inst.config)
            self.state.save_instance(inst)
        if inst.state == FAILED:
            self.retry_failed(inst)

    def retry_failed(self, inst: InstanceRecord) -> None:
        st = self.state
        st.attention.add(inst.instance_id)
        inst.failure_times, inst.consecutive_failures = (), 0
        inst.restart_ranks = tuple(range(inst.data_parallel_size))
        inst.next_restart_at = st.wall()
        st.transition(inst, RESTARTING, "deployment applied again: retrying the FAILED instance")

    def _remove_instance(self, instance_id: str, why: str, budget: Budget | None = None) -> None:
        """From memory, and stop its engines (the change deleted its rows)."""
        st = self.state
        slots = st.slots_of(instance_id)  # while the instance is known: its ranks, not a scan of every slot
        st.instances.pop(instance_id, None)
        self.endpoints.refresh_engines(
            [s.engine_id for s in slots]
        )  # routers hear of it before any of its engines is stopped
        st.attention.discard(instance_id)
        for slot in slots:
            st.slots.remove(slot.engine_id)
            if slot.node_id:
                self.actuator.stop_copy(slot.node_id, slot.engine_id, slot.generation, f"instance {instance_id} {why}")
                if budget is not None:
                    budget.spawned()
