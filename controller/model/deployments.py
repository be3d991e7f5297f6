"""Every deployment's state, in one home: its spec and revision, the indexes the hot paths look
up (the deployment owning each group and the group's sizes, the restart policy, the engine
config, the served model, the adapters), the last revision of a deleted one, and its rollout
record (paused or not, why and by whom, the deployment it replaced, since when a failure pauses
it, whether the revision is the autoscaler's own).

Writers: a change (controller/deploy/changes.py: `set_deployment`, `record_change`) and a rollout's
own moves (controller/deploy/rollout.py: `move`). Readers go through the named reads below: the tables
(ClusterState, given this home when it is made, answers "which deployment, which policy, which
config" for an instance), the rollouts, the spares, the autoscaler, the views and the endpoint
feed. A change writes the deployment and its new rollout record together, so nothing is told of
it afterwards.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass

from controller.model.events import EventBus
from controller.model.instances import Policy
from controller.rules.expansion import integral_numbers, struct_dict
from controller.store.interface import LEGACY_DEPLOYMENT, Store, StoredState, StoreUnavailable
from motor.clock import Clock
from motor.contract import names
from motor.contract.names import enum_short_name
from motor.contract.user_config import SECTION_BY_ROLE
from motor.errors import InvalidArgument, NotFound
from motor.state_machine import Transitions
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)

C = controller_pb2
COMPLETE, PROGRESSING, PAUSED = C.ROLLOUT_STATE_COMPLETE, C.ROLLOUT_STATE_PROGRESSING, C.ROLLOUT_STATE_PAUSED

# COMPLETE: every unit current; PROGRESSING: old units being replaced; PAUSED: by an operator or a
# failing new unit, until resumed or another spec is applied.
TRANSITIONS = Transitions.between(
    {
        COMPLETE: {PROGRESSING, PAUSED},
        PROGRESSING: {COMPLETE, PAUSED},
        PAUSED: {PROGRESSING, COMPLETE},
    },
    lambda state: enum_short_name(C.RolloutState, state),
)


def rollout_record(previous: bytes | None, previous_revision: int, since: float, autoscaled: bool = False) -> dict:
    """The rollout record a change writes: not paused, the deployment it replaced (for undo), the
    time from which a new instance's failure pauses it (controller/deploy/rollout.py), and whether
    the change is the autoscaler's own (a new count of the spec already rolled out)."""
    return {
        "paused": False,
        "reason": "",
        "previous": base64.b64encode(previous).decode() if previous is not None else None,
        "previous_revision": previous_revision,
        "since": since,
        "autoscaled": autoscaled,
    }


def engine_config_json(deployment: C.Deployment) -> str:
    """A deployment's engine_config as its engines are started with it (the StartEngine config_json):
    each engine section also names the deployment's model, which its engine server holds it to."""
    config = integral_numbers(struct_dict(deployment.engine_config))
    for key, section in config.items():
        if key in SECTION_BY_ROLE.values() and isinstance(section, dict) and deployment.model:
            section["deployment_model"] = deployment.model
            args = section.get("engine_args")
            if section.get("engine_type") == "sim" and (args is None or isinstance(args, dict)):
                # The simulated engine serves the deployment's model unless its arguments name one
                # (controller/rules/engine_sections.py refuses one that names another).
                section["engine_args"] = {"model": deployment.model, **(args or {})}
    return json.dumps(config, sort_keys=True)


@dataclass
class Rollout:
    """One deployment's rollout. `since` (wall clock): failures of current units before it are
    forgiven (a resume); `progress_at` (monotonic): the last progress, for the deadline."""

    state: int = COMPLETE
    reason: str = ""
    previous: str | None = None  # base64 of the deployment the last change replaced
    previous_revision: int = 0
    since: float = 0.0
    progress_at: float = 0.0
    available_current: int = 0
    announced: bool = True  # False when loaded: finding it complete then is no news
    # Both read by the autoscaler (controller/capacity/autoscaler.py) and stored in the record, so
    # that a restarted controller or a new leader holds a group exactly when the one before did.
    # The revision is the autoscaler's own change: its rollout only starts or stops instances of
    # the spec already rolled out.
    autoscaled: bool = False
    # PAUSED by an operator (PauseRollout), not by the rollout itself (a failing new instance, the deadline).
    paused_by_operator: bool = False

    def record(self) -> dict:
        return {
            "paused": self.state == PAUSED,
            "reason": self.reason,
            "previous": self.previous,
            "previous_revision": self.previous_revision,
            "since": self.since,
            "autoscaled": self.autoscaled,
            "paused_by_operator": self.state == PAUSED and self.paused_by_operator,
        }


# What an instance whose deployment is gone (its removal under way) runs under.
DEFAULT_POLICY = Policy()
DEFAULT_CONFIG = "{}"


class Deployments:
    def __init__(self, store: Store, events: EventBus, clock: Clock):
        self.store, self.events, self.clock = store, events, clock
        self.by_name: dict[str, tuple[C.Deployment, int]] = {}  # name -> (deployment, revision)
        # name -> the last revision of a deleted deployment: applied again, it goes on from there.
        self.deleted_revisions: dict[str, int] = {}
        self.rollouts: dict[str, Rollout] = {}
        self._legacy: tuple[bytes, int] | None = None  # loaded from a store of before names: moved by `upgrade`
        # Indexes of `by_name` for the hot paths (a heartbeat, a scrape, the endpoint feed), kept
        # by `set_deployment` only and read through the methods below. Group names are unique
        # across deployments, so a group has one owner.
        self._owner: dict[str, str] = {}  # group -> deployment
        self._sizes: dict[str, tuple[int, int]] = {}  # group -> (count, spares)
        self._policies: dict[str, Policy] = {}
        self._configs: dict[str, str] = {}  # the engine config its StartEngines carry
        self._served_models: dict[str, tuple[str, ...]] = {}  # the model names its engines answer to
        self._adapters: dict[str, dict[str, str]] = {}  # its LoRA adapters, name -> path (only those that have some)

    # ------------------------------------------------------------------ the indexes

    def owner(self, group: str) -> str:
        """The deployment the instance group belongs to ("" when no deployment has it)."""
        return self._owner.get(group, "")

    def spares_of(self, group: str) -> int:
        """The warm spares the group asks for (0 for an unknown group)."""
        return self._sizes.get(group, (0, 0))[1]

    def groups_with_spares(self) -> list[str]:
        """Every group that asks for warm spares, by name."""
        return sorted(group for group, (_, spares) in self._sizes.items() if spares)

    def policy(self, name: str) -> Policy:
        """The deployment's restart policy (the default for one that is gone)."""
        return self._policies.get(name, DEFAULT_POLICY)

    def config(self, name: str, default: str = DEFAULT_CONFIG) -> str:
        """The engine config the deployment's StartEngines carry (`default` for one that is gone)."""
        return self._configs.get(name, default)

    def served_models(self, name: str) -> tuple[str, ...]:
        """The model names the deployment's engines answer to (none for one that is gone)."""
        return self._served_models.get(name, ())

    def adapters(self, name: str) -> dict[str, str]:
        """The deployment's LoRA adapters, name -> path (empty when it has none)."""
        return self._adapters.get(name, {})

    def model_names(self) -> tuple[str, ...]:
        """Every name a deployment serves (its model, its adapters), sorted: what Motor serves,
        whether an engine of it serves now or not."""
        names = {model for models in self._served_models.values() for model in models}
        names.update(adapter for adapters in self._adapters.values() for adapter in adapters)
        return tuple(sorted(names))

    def any_adapters(self) -> bool:
        return bool(self._adapters)

    # ------------------------------------------------------------------ reading

    def last_revision(self, name: str) -> int:
        """The deployment's revision; for one deleted, the last it had (an apply continues from
        it, and a dry run says so); 0 for a name never applied."""
        current = self.by_name.get(name)
        return current[1] if current is not None else self.deleted_revisions.get(name, 0)

    @property
    def deployment(self) -> C.Deployment | None:
        """The only deployment (None when there are none or several): the view of the API without names."""
        return next(iter(self.by_name.values()))[0] if len(self.by_name) == 1 else None

    @property
    def revision(self) -> int:
        return next(iter(self.by_name.values()))[1] if len(self.by_name) == 1 else 0

    def named(self, name: str, deleting: bool = False) -> str:
        """The deployment a request names; without a name, the only one. NOT_FOUND for an unknown
        name, INVALID_ARGUMENT when several exist and none is named."""
        if name:
            if name not in self.by_name:
                known = ", ".join(sorted(self.by_name)) or "none"
                raise NotFound(f"name: no deployment is named {names.excerpt(name)} (deployments: {known})")
            return name
        if len(self.by_name) > 1:
            raise InvalidArgument(
                f"name: required: {len(self.by_name)} deployments exist "
                f"({', '.join(sorted(self.by_name))}); name the one to " + ("delete" if deleting else "read")
            )
        if not self.by_name:
            if deleting:
                return LEGACY_DEPLOYMENT  # a delete of nothing succeeds (it ends a new store's wait)
            raise NotFound("name: no deployment has been applied; apply one with `motorctl apply -f FILE`")
        return next(iter(self.by_name))

    # ------------------------------------------------------------------ writing

    def set_deployment(self, name: str, deployment: C.Deployment | None, revision: int) -> None:
        """The deployment and its indexes (None: it is gone)."""
        old = self.by_name.pop(name, None)
        if old is not None:
            for group in old[0].instance_groups:
                self._owner.pop(group.name, None)
                self._sizes.pop(group.name, None)
            for index in (self._policies, self._configs, self._served_models, self._adapters):
                index.pop(name, None)
        if deployment is not None:
            self.by_name[name] = (deployment, revision)
            for group in deployment.instance_groups:
                self._owner[group.name] = name
                self._sizes[group.name] = (group.count, group.spares)
            self._policies[name] = Policy.from_proto(deployment.restart_policy)
            self._configs[name] = engine_config_json(deployment)
            self._served_models[name] = (deployment.model,)
            if deployment.adapters:
                self._adapters[name] = {a.name: a.path for a in deployment.adapters}

    def record_change(self, name: str, revision: int, record: dict | None) -> None:
        """A change of a spec was made in memory (after `set_deployment`): a deleted deployment's
        revision is remembered (`record` None); a new spec gets its new rollout record,
        unpaused, rolling out."""
        if record is None:
            self.deleted_revisions[name] = revision
            self.rollouts.pop(name, None)
            return
        rollout = self._from_record(record)
        old = self.rollouts.get(name)
        rollout.state = old.state if old is not None else COMPLETE
        self.rollouts[name] = rollout
        self.move(name, rollout, PROGRESSING, f"revision {revision} applied; rolling out")

    def move(self, name: str, rollout: Rollout, state: int, reason: str, event: bool = True, **where) -> None:
        """A rollout's state and reason (the state machine checked), announced as an event."""
        if state != rollout.state:
            TRANSITIONS.check(f"rollout of {name}", rollout.state, state, reason)
        rollout.state, rollout.reason = state, reason
        if event:
            self.events.emit(C.EVENT_TYPE_ROLLOUT, f"rollout of {name!r}: {reason}", deployment=name, **where)

    def _from_record(self, record: dict) -> Rollout:
        return Rollout(
            reason=record.get("reason", ""),
            previous=record.get("previous"),
            previous_revision=record.get("previous_revision", 0),
            since=record.get("since", self.clock.time()),
            progress_at=self.clock.monotonic(),
            # A record written before these were stored: not the autoscaler's, and its pause holds.
            autoscaled=bool(record.get("autoscaled", False)),
        )

    # ------------------------------------------------------------------ the store

    def loaded(self, stored: StoredState) -> None:
        """The stored deployments and their rollouts; the one of a store written before
        deployments had names is loaded under its own name (its instances keep their ids:
        nothing restarts)."""
        for key, record in stored.rollouts.items():
            if "deleted_at_revision" in record:
                self.deleted_revisions[key] = int(record["deleted_at_revision"])
        for key, (data, revision) in stored.deployments.items():
            deployment = C.Deployment.FromString(data)
            if key == LEGACY_DEPLOYMENT:
                self._legacy = (data, revision)
                if deployment.name in stored.deployments:
                    continue  # moved already; the old row is cleared by `upgrade`
            self.set_deployment(deployment.name if key == LEGACY_DEPLOYMENT else key, deployment, revision)
        for name in self.by_name:
            record = stored.rollouts.get(name, {})
            rollout = self._from_record(record)
            rollout.state = PAUSED if record.get("paused") else PROGRESSING  # the next pass says if complete
            rollout.paused_by_operator = bool(record.get("paused_by_operator", False))
            rollout.announced = False
            self.rollouts[name] = rollout

    def upgrade(self) -> None:
        """Move the deployment of a store written before names under its name (the leader, at
        start). A store that refuses it keeps it where it was: it is moved at the next start."""
        if self._legacy is None:
            return
        data, revision = self._legacy
        name = C.Deployment.FromString(data).name
        try:
            with self.store.transaction():
                if name in self.by_name:
                    deployment, revision = self.by_name[name]
                    self.store.save_deployment(deployment.SerializeToString(deterministic=True), revision, name)
                self.store.save_deployment(None, revision, LEGACY_DEPLOYMENT)
        except StoreUnavailable as exc:
            logger.warning(
                "could not move the deployment %r of an older store under its name (%s); tried again at the next start",
                name,
                exc,
            )
            return
        self._legacy = None
        logger.info("store upgraded: its deployment %r is now stored under its name (revision %d)", name, revision)
