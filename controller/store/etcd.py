"""The controller's durable state in etcd (`--store etcd://...`), behind the same `Store` interface
as SQLite.

Layout under the prefix (default `/motor`; docs/ha.md):
    state/deployments/<name>    {"revision": n, "deployment": base64 of motor.v1.Deployment}
    state/deployment            the one deployment of a store written before deployments had names
                                (same value, or "deployment": null); moved under its name when loaded
    state/applied               present once a deployment change was made (the store is not new)
    state/generation            the generation counter
    state/nodes/<node id>       {"info": base64 of motor.v1.NodeInfo, "generation", "state", "reason"}
    state/assignments/<engine>  the assignment's JSON
    state/instances/<instance>  the instance record's JSON
    state/rollouts/<name>       the deployment's rollout record (paused, why and by whom, the previous
                                revision, whether the revision is the autoscaler's own change;
                                after a delete, its last revision: applied again, it goes on from it)
    election/leader, election/epoch   (controller/ha/election.py)

How a write avoids blocking the event loop: the Store methods stay synchronous and only change
an in-memory mirror and stage the write; a writer task on the loop sends staged writes in order,
each `transaction()` block as one etcd transaction guarded by `fence()` (the leader's
create-revision compare). `await flush()` returns once everything staged before it is
committed; the controller awaits it before it acknowledges a change or acts on one. A guard
that fails marks the store fenced: nothing more is written and `flush()` raises `Fenced`. When
etcd cannot answer (no quorum), the writer retries the same batch, in order, until it can.

A standby does not write: `follow()` keeps its mirror current from etcd's watch, so read RPCs
answer from shared state, and `reload()` reads everything again when it becomes leader.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import heapq
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aetcd
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_not_exception_type,
    wait_exponential,
)

from controller.rules.slicing import Budget
from controller.store.etcd_client import UNAVAILABLE_ERRORS
from controller.store.interface import LEGACY_DEPLOYMENT, Store, StoreChange, StoredNode, StoredState
from motor.service.retry import RepeatedFailure, worth_reporting

logger = logging.getLogger(__name__)

# etcd's default --max-txn-ops: a larger batch is sent as several transactions.
MAX_TXN_OPS = 128
# Transactions of one large batch sent at once (their keys are distinct, so order does not matter).
TXNS_IN_FLIGHT = 8


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    if worth_reporting(state.attempt_number):
        log = logger.info if isinstance(error, UNAVAILABLE_ERRORS) else logger.warning
        log("etcd did not take a write (attempt %d, retrying): %r", state.attempt_number, error)


class Fenced(Exception):
    """A write was refused because this controller no longer leads; nothing more is written."""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


@dataclass
class _Mirror:
    """What etcd holds under state/, kept in memory (nodes by id: thousands are saved one by one)."""

    deployments: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    ever_applied: bool = False
    generation: int = 0
    nodes: dict[str, StoredNode] = field(default_factory=dict)
    assignments: dict[str, dict[str, Any]] = field(default_factory=dict)
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)


class EtcdStore(Store):
    def __init__(self, client: aetcd.Client, prefix: str, fence: Callable[[], list[Any]]):
        self.client = client
        self.root = f"{prefix}/state/"
        self.fence = fence  # the compares every write carries (the election's: this controller leads)
        self.revision = 0  # etcd revision the mirror reflects (standby) or was loaded at
        self.fenced: str | None = None  # why writes stopped, once a guard failed
        self._mirror = _Mirror()
        self._depth = 0
        self._batch: dict[str, bytes | None] = {}
        self._queue: list[tuple[int, dict[str, bytes | None]]] = []
        self._staged = 0  # sequence number of the last staged batch
        self._committed = 0
        # flush() callers: (staged sequence number they wait for, tie-breaker, future), a heap,
        # so that a commit wakes only those it satisfies (thousands of launches may wait at once).
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._writer: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._listeners: list[Callable[[str], None]] = []

    # --- reading ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Load the whole state (call before load()); starts the writer."""
        await self.reload()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="etcd-store-writer")

    async def reload(self) -> None:
        """Read everything again (a new leader: every write of the previous one is visible)."""
        reply = await self.client.get_prefix(self.root.encode())
        mirror = _Mirror()
        for kv in reply.kvs:
            self._apply(mirror, kv.key.decode(), kv.value)
        self._mirror = mirror
        self.revision = reply.header.revision
        # What etcd holds now replaces whatever a deposed leader staged and could not write.
        self._batch, self._queue, self._committed = {}, [], self._staged
        self.fenced = None
        self._wake_waiters()

    def load(self) -> StoredState:
        m = self._mirror
        return StoredState(
            dict(sorted(m.deployments.items())),
            m.ever_applied or bool(m.deployments),
            m.generation,
            [m.nodes[k] for k in sorted(m.nodes)],
            copy.deepcopy(m.assignments),
            copy.deepcopy(m.instances),
            copy.deepcopy(m.rollouts),
        )

    def on_change(self, listener: Callable[[str], None]) -> None:
        """`listener(key)` runs after a followed change was applied to the mirror (standbys)."""
        self._listeners.append(listener)

    async def follow(self) -> None:
        """Apply every change in etcd to the mirror, for as long as it runs (a standby). A broken
        watch is opened again after 0.5 s, 1 s ... 5 s, told once when it breaks, once when it resumes."""
        breaks = RepeatedFailure(0.5, 5.0)
        while True:
            try:
                watch = await self.client.watch_prefix(self.root.encode(), start_revision=self.revision + 1)
                try:
                    async for event in watch:
                        if breaks.count:
                            logger.info("watch of the controller state resumed after %d break(s)", breaks.recovered())
                        key = event.kv.key.decode()
                        self._apply(self._mirror, key, None if event.kind == "DELETE" else event.kv.value)
                        self.revision = max(self.revision, event.kv.mod_revision)
                        for listener in list(self._listeners):
                            try:
                                listener(key)
                            except Exception:
                                logger.exception("state listener failed")
                finally:
                    await watch.cancel()
            except aetcd.exceptions.RevisionCompactedError:
                logger.info("watch fell behind etcd's compaction: reading the whole state again")
                await self._reload_when_possible()
            except (*UNAVAILABLE_ERRORS, aetcd.exceptions.ClientError) as exc:
                if breaks.failed(exc):
                    logger.info(
                        "watch of the controller state broke (%s, %d time(s) in a row); resuming", exc, breaks.count
                    )
                await asyncio.sleep(breaks.delay())

    async def _reload_when_possible(self) -> None:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(UNAVAILABLE_ERRORS), wait=wait_exponential(0.1, max=2)
        ):
            with attempt:
                await self.reload()

    def _apply(self, state: _Mirror, key: str, value: bytes | None) -> None:
        """Set one key of `state` from etcd's bytes (None: deleted)."""
        name = key[len(self.root) :]
        section, _, item = name.partition("/")
        data = None if value is None else json.loads(value)
        if name in ("deployment", "applied") and value is not None:
            state.ever_applied = True
        if name == "deployment" or section == "deployments":
            deployment = _unb64(data["deployment"]) if data else None
            key = item if section == "deployments" else LEGACY_DEPLOYMENT
            state.deployments.pop(key, None)
            if deployment is not None:
                state.deployments[key] = (deployment, data["revision"])
        elif name == "generation":
            state.generation = int(data or 0)
        elif section == "nodes":
            state.nodes.pop(item, None)
            if data is not None:
                state.nodes[item] = StoredNode(
                    item, _unb64(data["info"]) or b"", data["generation"], data["state"], data["reason"]
                )
        elif section in ("assignments", "instances", "rollouts"):
            table = getattr(state, section)
            if data is None:
                table.pop(item, None)
            else:
                table[item] = data

    # --- writing ------------------------------------------------------------------------------

    def _stage(self, name: str, data: Any) -> None:
        key = self.root + name
        value = None if data is None else json.dumps(data, sort_keys=True).encode()
        self._apply(self._mirror, key, value)
        with self.transaction():
            self._batch[key] = value

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._batch:
            batch, self._batch = self._batch, {}
            self._staged += 1
            self._queue.append((self._staged, batch))
            self._wake.set()

    def save_deployment(self, deployment: bytes | None, revision: int, name: str = LEGACY_DEPLOYMENT) -> None:
        if name == LEGACY_DEPLOYMENT:
            self._stage("deployment", {"revision": revision, "deployment": _b64(deployment)})
        else:
            self._stage(
                f"deployments/{name}",
                None if deployment is None else {"revision": revision, "deployment": _b64(deployment)},
            )

    def save_rollout(self, name: str, data: dict[str, Any] | None) -> None:
        self._stage(f"rollouts/{name}", data)

    def mark_applied(self) -> None:
        self._stage("applied", 1)

    def next_generation(self, above: int = 0) -> int:
        value = max(self._mirror.generation, above) + 1
        self._stage("generation", value)
        return value

    def last_generation(self) -> int:
        return self._mirror.generation

    def save_node(self, node: StoredNode) -> None:
        data = {"info": _b64(node.info), "generation": node.generation, "state": node.state, "reason": node.reason}
        self._stage(f"nodes/{node.node_id}", data)

    def save_assignment(self, engine_id: str, data: dict[str, Any]) -> None:
        self._stage(f"assignments/{engine_id}", data)

    def delete_assignment(self, engine_id: str) -> None:
        self._stage(f"assignments/{engine_id}", None)

    def save_instance(self, instance_id: str, data: dict[str, Any]) -> None:
        self._stage(f"instances/{instance_id}", data)

    def delete_instance(self, instance_id: str) -> None:
        self._stage(f"instances/{instance_id}", None)

    async def write_change_async(self, change: StoreChange) -> None:
        """Staged in slices, yielding to the loop (the writer task sends it to etcd; flush() waits for it)."""
        budget = Budget()
        rows = [
            *((f"instances/{k}", None) for k in change.deleted_instances),
            *((f"assignments/{k}", None) for k in change.deleted_assignments),
            *((f"instances/{k}", v) for k, v in change.instances),
            *((f"assignments/{k}", v) for k, v in change.assignments),
        ]
        with self.transaction():  # one batch: what others stage meanwhile joins it (sent together, in order)
            self.mark_applied()
            self.save_deployment(change.deployment, change.revision, change.name)
            self._save_rollout_of(change)
            for name, data in rows:
                self._stage(name, data)
                if budget.spent():
                    await asyncio.sleep(0)
                    budget.restart()

    @property
    def staged(self) -> int:
        """How many batches were staged so far (a caller compares it to know if it wrote)."""
        return self._staged

    async def flush(self) -> None:
        """Return when every write staged so far is in etcd; raise Fenced if it never will be."""
        target = self._staged
        if self._committed >= target:
            return
        if self.fenced is not None:
            raise Fenced(self.fenced)
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (target, id(waiter), waiter))
        await waiter

    def _wake_waiters(self) -> None:
        while self._waiters and (self.fenced is not None or self._waiters[0][0] <= self._committed):
            _, _, waiter = heapq.heappop(self._waiters)
            if not waiter.done():
                if self.fenced is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(Fenced(self.fenced))

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and self.fenced is None:
                # Everything queued goes out together: later writes of a key replace earlier ones.
                upto, merged = self._queue[-1][0], {}
                for _, batch in self._queue:
                    merged.update(batch)
                try:
                    await self._commit(merged)
                except Fenced as exc:
                    self.fenced = str(exc) or "leadership lost"
                    logger.warning("etcd store fenced: %s", self.fenced)
                self._queue = [item for item in self._queue if item[0] > upto]
                if self.fenced is None:
                    self._committed = upto
                self._wake_waiters()

    async def _commit(self, writes: dict[str, bytes | None]) -> None:
        """Send `writes` (distinct keys), as one guarded transaction per MAX_TXN_OPS, a few at once."""
        tx = self.client.transactions
        items = list(writes.items())
        group = MAX_TXN_OPS * TXNS_IN_FLIGHT
        for first in range(
            0, len(items), group
        ):  # ops built a group at a time: a 50,000-key change does not hold the loop
            ops = [
                tx.delete(k.encode()) if v is None else tx.put(k.encode(), v) for k, v in items[first : first + group]
            ]
            chunks = [ops[start : start + MAX_TXN_OPS] for start in range(0, len(ops), MAX_TXN_OPS)]
            await asyncio.gather(*(self._commit_chunk(chunk) for chunk in chunks))

    async def _commit_chunk(self, ops: list[Any]) -> None:
        # Whatever etcd answers short of refusing the guard (no quorum, "leader changed", too many
        # requests...) is retried, in order, until it answers: a change is never dropped.
        async for attempt in AsyncRetrying(
            retry=retry_if_not_exception_type(Fenced),
            wait=wait_exponential(0.05, max=1),
            reraise=True,
            before_sleep=_log_retry,
        ):
            with attempt:
                try:
                    guard = self.fence()
                except Exception as exc:  # NotLeader: the election says we stopped leading
                    raise Fenced(str(exc)) from exc
                succeeded, _ = await self.client.transaction(compare=guard, success=ops, failure=[])
        if not succeeded:
            raise Fenced("the leader key changed: another controller leads now")

    def close(self) -> None:
        if self._writer:
            self._writer.cancel()
