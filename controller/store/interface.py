"""Durable controller state behind a small interface, so that another backend (etcd, with
leader election for a standby controller) can replace SQLite without touching the logic.

What is stored: the desired deployments, each under its name with its revision, the generation counter, nodes
(identity, generation, state), engine assignments and instance records (restart counters,
crash-loop window). Every write is committed before the caller acknowledges the change;
`transaction()` groups several writes into one commit.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from motor.errors import MotorError, Unavailable


@dataclass
class StoredNode:
    node_id: str
    info: bytes  # serialized motor.v1.NodeInfo
    generation: int
    state: int  # motor.v1.NodeState
    reason: str


# The key under which a store written before deployments had names holds its one deployment
# (SQLite: the meta rows `deployment` and `revision`; etcd: state/deployment). The controller
# moves it under its name when it loads it (controller/deploy/changes.py: `upgrade`).
LEGACY_DEPLOYMENT = ""


@dataclass
class StoredState:
    # name -> (serialized motor.v1.Deployment, its revision); LEGACY_DEPLOYMENT: a store written
    # before deployments had names.
    deployments: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    # A deployment was applied or deleted on this store once (it is not new: controller/engines/adoption.py).
    ever_applied: bool = False
    generation: int = 0
    nodes: list[StoredNode] = field(default_factory=list)
    assignments: dict[str, dict[str, Any]] = field(default_factory=dict)
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    # name -> the deployment's rollout record (paused, why and by whom, the previous revision for
    # undo, whether the revision is the autoscaler's own change: controller/model/deployments.py).
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def deployment(self) -> bytes | None:
        """The only deployment (None when there are none or several)."""
        return next(iter(self.deployments.values()))[0] if len(self.deployments) == 1 else None

    @property
    def revision(self) -> int:
        return next(iter(self.deployments.values()))[1] if len(self.deployments) == 1 else 0


@dataclass
class StoreChange:
    """A deployment change as one transaction: the deployment row, and the instance and assignment
    rows it deletes and writes (ApplyDeployment, DeleteDeployment; thousands of rows).
    `deployment` None: the deployment `name` is deleted."""

    deployment: bytes | None
    revision: int
    deleted_instances: list[str] = field(default_factory=list)
    deleted_assignments: list[str] = field(default_factory=list)
    instances: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    assignments: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    name: str = LEGACY_DEPLOYMENT
    # The deployment's rollout record, written with it (None: left as it is; deleted with the deployment).
    rollout: dict[str, Any] | None = None

    @property
    def rows(self) -> int:
        return len(self.deleted_instances) + len(self.deleted_assignments) + len(self.instances) + len(self.assignments)


class Store(abc.ABC):
    """What the controller needs from durable storage. Writes are durable when they return
    (or when the enclosing transaction() block exits)."""

    @abc.abstractmethod
    def load(self) -> StoredState: ...

    @abc.abstractmethod
    def save_deployment(self, deployment: bytes | None, revision: int, name: str = LEGACY_DEPLOYMENT) -> None:
        """Store the deployment `name` (None: delete it); the other deployments are left alone."""

    @abc.abstractmethod
    def save_rollout(self, name: str, data: dict[str, Any] | None) -> None:
        """Store the rollout record of the deployment `name` (None: delete it)."""

    @abc.abstractmethod
    def mark_applied(self) -> None:
        """Remember that a deployment change was made on this store (it is no longer new)."""

    @abc.abstractmethod
    def next_generation(self, above: int = 0) -> int:
        """A number larger than any returned before, by this or an earlier controller process,
        and larger than `above` (a generation a node reports that this store never issued: its
        predecessor's, when the store was lost)."""

    @abc.abstractmethod
    def last_generation(self) -> int:
        """The largest number next_generation returned so far (0: none); no I/O."""

    @abc.abstractmethod
    def save_node(self, node: StoredNode) -> None: ...

    @abc.abstractmethod
    def save_assignment(self, engine_id: str, data: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def delete_assignment(self, engine_id: str) -> None: ...

    @abc.abstractmethod
    def save_instance(self, instance_id: str, data: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def delete_instance(self, instance_id: str) -> None: ...

    @abc.abstractmethod
    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]: ...

    # True while a big write runs outside the loop (SqliteStore.write_change_async): writers that
    # can wait (the write-behind flush, the reconcile pass) wait for it instead of blocking.
    busy = False

    def write_change(self, change: StoreChange) -> None:
        """Write `change` in one transaction (durable when it returns)."""
        with self.transaction():
            self.mark_applied()
            self.save_deployment(change.deployment, change.revision, change.name)
            self._save_rollout_of(change)
            for instance_id in change.deleted_instances:
                self.delete_instance(instance_id)
            for engine_id in change.deleted_assignments:
                self.delete_assignment(engine_id)
            for instance_id, data in change.instances:
                self.save_instance(instance_id, data)
            for engine_id, data in change.assignments:
                self.save_assignment(engine_id, data)

    def _save_rollout_of(self, change: StoreChange) -> None:
        if change.deployment is None and change.name != LEGACY_DEPLOYMENT:
            # Kept after the delete: a deployment applied again under the name goes on from its
            # last revision, so one revision number never names two specs.
            self.save_rollout(change.name, {"deleted_at_revision": change.revision})
        elif change.rollout is not None:
            self.save_rollout(change.name, change.rollout)

    async def write_change_async(self, change: StoreChange) -> None:
        """`write_change` without holding the event loop for long (SQLite: in a thread)."""
        self.write_change(change)

    async def flush(self) -> None:
        """Return when every write made so far is durable. SQLite's writes already are when they
        return; the etcd store sends its writes from a task and waits for them here."""

    def close(self) -> None:
        pass


class StoreUnavailable(Unavailable):
    """A write was refused (a full disk, an I/O error): nothing of it is stored. Callers answer
    UNAVAILABLE with this cause and leave memory as it was, or retry the write later."""


class StoreUnreadable(MotorError):
    """The stored state cannot be read: the controller stops (exit 2) rather than start empty
    by accident and forget the deployment, the generations and the restart counters."""
