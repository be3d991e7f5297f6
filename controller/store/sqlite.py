"""The embedded default store: SQLite in WAL mode, one file beside the controller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

from controller.store.interface import (
    LEGACY_DEPLOYMENT,
    Store,
    StoreChange,
    StoredNode,
    StoredState,
    StoreUnavailable,
    StoreUnreadable,
)
from motor.service.config import prepare_directory

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB);
CREATE TABLE IF NOT EXISTS nodes (node_id TEXT PRIMARY KEY, info BLOB NOT NULL, generation INTEGER NOT NULL,
                                  state INTEGER NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS assignments (engine_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS instances (instance_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS deployments (name TEXT PRIMARY KEY, data BLOB NOT NULL, revision INTEGER NOT NULL);
"""


class SqliteStore(Store):
    """The embedded default. WAL journal: a commit survives kill -9 of the controller."""

    def __init__(self, path: str):
        self.path = path
        if path != ":memory:":
            name = os.path.basename(path)  # the database and its WAL files must be files
            prepare_directory("db", os.path.dirname(os.path.abspath(path)), files=(name, f"{name}-wal", f"{name}-shm"))
        try:
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            problems = [row[0] for row in self.db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError(f"damaged: {problems[0]}")
            self.db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnreadable(
                f"the database {path} cannot be read ({exc}): restore it from a backup, or start empty with "
                f"--discard-unreadable-db (moves it aside; the deployment must be applied again)"
            ) from None
        self._depth = 0
        self._generation: int | None = None  # the counter, once read
        # The connection is used by the loop and, for a big write, by a worker thread: one at a time.
        self._lock = threading.RLock()

    @classmethod
    def discard(cls, path: str) -> str:
        """Move an unreadable database (and its WAL files) aside; returns the new name."""
        aside = f"{path}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
        for suffix in ("", "-wal", "-shm"):
            if os.path.lexists(path + suffix):
                os.rename(path + suffix, aside + suffix)
        return aside

    def _refused(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(
            f"the controller's database {self.path} refused a write ({exc}); nothing was changed, try again"
        )

    def _execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self.db.execute(sql, args)
        except sqlite3.Error as exc:
            raise self._refused(exc) from None

    def _rollback(self) -> None:
        # SQLite may already have rolled back by itself (SQLITE_FULL at COMMIT): a second
        # ROLLBACK would fail with "cannot rollback - no transaction is active".
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        self._generation = None  # a counter raised in the rolled-back transaction is read again

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:  # held to the end: a worker thread's write waits, and waits for it
            if self._depth == 0:
                self._execute("BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if self._depth == 0:
                    self._rollback()
                raise
            self._depth -= 1
            if self._depth == 0:
                try:
                    self._execute("COMMIT")
                except StoreUnavailable:
                    self._rollback()
                    raise

    async def write_change_async(self, change: StoreChange) -> None:
        """In a worker thread (SQLite lets go of the interpreter while it writes): the loop goes on
        answering heartbeats. `busy` meanwhile; a loop-side write waits for the lock."""
        self.busy = True
        try:
            await asyncio.to_thread(self._write_rows, change)
        finally:
            self.busy = False

    def _write_rows(self, change: StoreChange) -> None:
        # Serialized before the lock is taken: the lock is held only for SQLite's own work.
        instances = [(key, json.dumps(data)) for key, data in change.instances]
        assignments = [(key, json.dumps(data)) for key, data in change.assignments]
        with self.transaction():
            self.mark_applied()
            self.save_deployment(change.deployment, change.revision, change.name)
            self._save_rollout_of(change)
            try:
                self.db.executemany(
                    "DELETE FROM instances WHERE instance_id = ?", [(k,) for k in change.deleted_instances]
                )
                self.db.executemany(
                    "DELETE FROM assignments WHERE engine_id = ?", [(k,) for k in change.deleted_assignments]
                )
                self.db.executemany("INSERT OR REPLACE INTO instances (instance_id, data) VALUES (?, ?)", instances)
                self.db.executemany("INSERT OR REPLACE INTO assignments (engine_id, data) VALUES (?, ?)", assignments)
            except sqlite3.Error as exc:
                raise self._refused(exc) from None

    def _meta(self, key: str) -> Any:
        with self._lock:
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def _set_meta(self, key: str, value: Any) -> None:
        self._execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def load(self) -> StoredState:
        with self._lock:
            return self._load()

    def _load(self) -> StoredState:
        state = StoredState()
        legacy = self._meta("deployment")
        if legacy is not None:
            state.deployments[LEGACY_DEPLOYMENT] = (bytes(legacy), int(self._meta("revision") or 0))
        for name, data, revision in self.db.execute("SELECT name, data, revision FROM deployments ORDER BY name"):
            state.deployments[name] = (bytes(data), revision)
        state.ever_applied = bool(state.deployments) or any(self._meta(k) is not None for k in ("revision", "applied"))
        state.generation = int(self._meta("generation") or 0)
        for node_id, info, generation, node_state, reason in self.db.execute(
            "SELECT node_id, info, generation, state, reason FROM nodes ORDER BY node_id"
        ):
            state.nodes.append(StoredNode(node_id, bytes(info), generation, node_state, reason))
        for engine_id, data in self.db.execute("SELECT engine_id, data FROM assignments"):
            state.assignments[engine_id] = json.loads(data)
        for instance_id, data in self.db.execute("SELECT instance_id, data FROM instances"):
            state.instances[instance_id] = json.loads(data)
        for key, data in self.db.execute("SELECT key, value FROM meta WHERE key LIKE 'rollout:%'"):
            state.rollouts[key[len("rollout:") :]] = json.loads(data)
        return state

    def save_deployment(self, deployment: bytes | None, revision: int, name: str = LEGACY_DEPLOYMENT) -> None:
        with self.transaction():
            if name == LEGACY_DEPLOYMENT:
                self._set_meta("deployment", deployment)
                self._set_meta("revision", revision)
            elif deployment is None:
                self._execute("DELETE FROM deployments WHERE name = ?", (name,))
            else:
                self._execute(
                    "INSERT OR REPLACE INTO deployments (name, data, revision) VALUES (?, ?, ?)",
                    (name, deployment, revision),
                )

    def save_rollout(self, name: str, data: dict[str, Any] | None) -> None:
        if data is None:
            self._execute("DELETE FROM meta WHERE key = ?", (f"rollout:{name}",))
        else:
            self._set_meta(f"rollout:{name}", json.dumps(data, sort_keys=True))

    def mark_applied(self) -> None:
        self._set_meta("applied", 1)

    def next_generation(self, above: int = 0) -> int:
        with self.transaction():
            value = max(int(self._meta("generation") or 0), above) + 1
            self._set_meta("generation", value)
        self._generation = value
        return value

    def last_generation(self) -> int:
        if self._generation is None:
            self._generation = int(self._meta("generation") or 0)
        return self._generation

    def save_node(self, node: StoredNode) -> None:
        self._execute(
            "INSERT OR REPLACE INTO nodes (node_id, info, generation, state, reason) VALUES (?, ?, ?, ?, ?)",
            (node.node_id, node.info, node.generation, node.state, node.reason),
        )

    def save_assignment(self, engine_id: str, data: dict[str, Any]) -> None:
        self._execute(
            "INSERT OR REPLACE INTO assignments (engine_id, data) VALUES (?, ?)", (engine_id, json.dumps(data))
        )

    def delete_assignment(self, engine_id: str) -> None:
        self._execute("DELETE FROM assignments WHERE engine_id = ?", (engine_id,))

    def save_instance(self, instance_id: str, data: dict[str, Any]) -> None:
        self._execute(
            "INSERT OR REPLACE INTO instances (instance_id, data) VALUES (?, ?)", (instance_id, json.dumps(data))
        )

    def delete_instance(self, instance_id: str) -> None:
        self._execute("DELETE FROM instances WHERE instance_id = ?", (instance_id,))

    def close(self) -> None:
        self.db.close()
