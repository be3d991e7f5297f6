"""Write latency and failures of the controller's store (SQLite or etcd), measured around the
Store interface so that every store is measured alike.

A write is one save/delete outside a transaction, or a whole transaction() block (its writes are
durable together when it exits); `flush` is the wait for writes sent in the background (etcd).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Histogram

from controller.store.interface import LEGACY_DEPLOYMENT, Store, StoreChange, StoredNode, StoredState

OPERATIONS = ("write", "transaction", "flush")
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class StoreMetrics:
    """Created without a registry; the controller registers `collectors` in its own."""

    def __init__(self):
        self.seconds = Histogram(
            "motor_controller_store_write_seconds",
            "Time the controller waits for its store to make a write durable, by operation. Every state "
            "change waits for it: a p99 rising above 0.1 s means a slow disk (SQLite) or a slow etcd.",
            ["operation"],
            buckets=WRITE_BUCKETS,
            registry=None,
        )
        self.failures = Counter(
            "motor_controller_store_write_failures",
            "Store writes that raised, by operation: the controller's state may not survive a restart. Check "
            "the database's disk or etcd and the controller's log (alert MotorControllerStoreFailing).",
            ["operation"],
            registry=None,
        )
        for operation in OPERATIONS:
            self.seconds.labels(operation)
            self.failures.labels(operation)
        self.collectors = [self.seconds, self.failures]

    @contextlib.contextmanager
    def failing(self, operation: str) -> Iterator[None]:
        """Counts an exception raised inside as a failure of `operation`."""
        try:
            yield
        except Exception:
            self.failures.labels(operation).inc()
            raise

    @contextlib.contextmanager
    def measure(self, operation: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            with self.failing(operation):
                yield
        finally:
            self.seconds.labels(operation).observe(time.perf_counter() - began)


class MeasuredStore(Store):
    """Delegates to `store`, measuring its writes; anything else (etcd's on_change...) passes through."""

    def __init__(self, store: Store, metrics: StoreMetrics):
        self.inner, self.metrics = store, metrics
        self._depth = 0  # inside transaction(): its exit is the write that is measured

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _write(self, method: str, *args: Any) -> Any:
        if self._depth:
            with self.metrics.failing("write"):
                return getattr(self.inner, method)(*args)
        with self.metrics.measure("write"):
            return getattr(self.inner, method)(*args)

    def load(self) -> StoredState:
        return self.inner.load()

    def save_deployment(self, deployment: bytes | None, revision: int, name: str = LEGACY_DEPLOYMENT) -> None:
        self._write("save_deployment", deployment, revision, name)

    def save_rollout(self, name: str, data: dict[str, Any] | None) -> None:
        self._write("save_rollout", name, data)

    def mark_applied(self) -> None:
        self._write("mark_applied")

    def next_generation(self, above: int = 0) -> int:
        return self._write("next_generation", above)

    def last_generation(self) -> int:
        return self.inner.last_generation()

    def save_node(self, node: StoredNode) -> None:
        self._write("save_node", node)

    def save_assignment(self, engine_id: str, data: dict[str, Any]) -> None:
        self._write("save_assignment", engine_id, data)

    def delete_assignment(self, engine_id: str) -> None:
        self._write("delete_assignment", engine_id)

    def save_instance(self, instance_id: str, data: dict[str, Any]) -> None:
        self._write("save_instance", instance_id, data)

    def delete_instance(self, instance_id: str) -> None:
        self._write("delete_instance", instance_id)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        if self._depth:  # nested: part of the outer one
            with self.inner.transaction():
                yield
            return
        # Only the store's own failures count (entering, committing), not an error of the block,
        # which rolls the transaction back.
        block = self.inner.transaction()
        with self.metrics.failing("transaction"):
            block.__enter__()
        self._depth += 1
        try:
            yield
        except BaseException as exc:
            if not block.__exit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            with self.metrics.measure("transaction"):
                block.__exit__(None, None, None)
        finally:
            self._depth -= 1

    @property
    def busy(self) -> bool:  # type: ignore[override]
        return self.inner.busy

    def write_change(self, change: StoreChange) -> None:
        with self.metrics.measure("transaction"):
            self.inner.write_change(change)

    async def write_change_async(self, change: StoreChange) -> None:
        with self.metrics.measure("transaction"):
            await self.inner.write_change_async(change)

    async def flush(self) -> None:
        with self.metrics.measure("flush"):
            await self.inner.flush()

    def close(self) -> None:
        self.inner.close()
