"""The node manager's seam to the operating system: process operations.

Every OS call the node manager makes about an engine's processes (launch, exit watch, finding
and killing its tree) goes through a `ProcessOps` (as Supervisor's `options` object does); every
reading of time or wait goes through the `Clock` all services share (`motor/clock.py`). The real
ops wrap `motor.processes`; tests replace both with fakes to drive the kill decision, adoption and
restarts in milliseconds, beside the tests that use real processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

from motor import processes
from motor.processes import ExitStatus, TreeId

Remembered = Iterable[tuple[int, float]]  # (pid, create time) of descendants seen alive


class Launched(Protocol):
    """A process just launched (a `subprocess.Popen` for real)."""

    pid: int


class ExitWatcher(Protocol):
    """Notices one process's exit (`motor.processes.ExitWatch` for real)."""

    status: ExitStatus | None  # set once the exit is confirmed
    exited: asyncio.Event  # set at the same time
    noticed_at: float | None  # time.monotonic() then (the failover bench reads it)

    def close(self) -> None: ...


class ProcessOps(Protocol):
    def launch(self, argv: list[str], log_path: str, env: dict[str, str], token: str, cwd: str) -> Launched:
        """Exec `argv` in its own process group, tagged with `token`; OSError when it cannot."""

    def create_time(self, pid: int) -> float | None: ...

    def same_process(self, pid: int, started: float | None) -> bool:
        """`pid` is alive and is the process that started at `started` (not a reused pid)."""

    def descendants(self, pid: int) -> list[tuple[int, float]]: ...

    def watch_exit(
        self, pid: int, on_exit: Callable[[ExitStatus], None], child: Launched | None, started: float | None
    ) -> ExitWatcher:
        """Start watching `pid`; `child` is given when it is our own child (exit code known)."""

    async def find_tree(self, tree: TreeId, remembered: Remembered = ()) -> list[int]:
        """Pids of every live process of the tree."""

    async def kill_tree_confirmed(self, tree: TreeId, remembered: Remembered = ()) -> list[int]:
        """SIGKILL the tree until none of it is left; pids still alive at the end (empty: success)."""

    async def node_tokens(self, node_id: str, holder: str = "") -> set[str]:
        """Tokens of the live processes on this host launched for `node_id` by the node manager whose
        state directory is `holder` (any, when empty)."""

    async def terminate_tree(
        self, tree: TreeId, exited: asyncio.Event, deadline: float, remembered: Remembered = ()
    ) -> tuple[bool, list[int]]:
        """SIGTERM, `deadline` seconds, then SIGKILL: (nothing needed SIGKILL, pids left alive)."""


def _pids(procs: Iterable[object]) -> list[int]:
    return [proc.pid for proc in procs]  # type: ignore[attr-defined]


class RealProcessOps:
    """`ProcessOps` on real processes (motor.processes); /proc scans run in a worker thread."""

    def launch(self, argv: list[str], log_path: str, env: dict[str, str], token: str, cwd: str) -> Launched:
        return processes.launch(argv, log_path, env=env, token=token, cwd=cwd)

    def create_time(self, pid: int) -> float | None:
        return processes.create_time(pid)

    def same_process(self, pid: int, started: float | None) -> bool:
        return processes.same_process(pid, started)

    def descendants(self, pid: int) -> list[tuple[int, float]]:
        return processes.descendants(pid)

    def watch_exit(
        self, pid: int, on_exit: Callable[[ExitStatus], None], child: Launched | None, started: float | None
    ) -> ExitWatcher:
        watch = processes.ExitWatch(pid, on_exit, popen=child, started=started)  # type: ignore[arg-type]
        watch.start()
        return watch

    async def find_tree(self, tree: TreeId, remembered: Remembered = ()) -> list[int]:
        return _pids(await asyncio.to_thread(processes.find_tree, tree, list(remembered)))

    async def kill_tree_confirmed(self, tree: TreeId, remembered: Remembered = ()) -> list[int]:
        return _pids(await processes.kill_tree_confirmed(tree, remembered))

    async def node_tokens(self, node_id: str, holder: str = "") -> set[str]:
        return await asyncio.to_thread(processes.node_tokens, node_id, holder)

    async def terminate_tree(
        self, tree: TreeId, exited: asyncio.Event, deadline: float, remembered: Remembered = ()
    ) -> tuple[bool, list[int]]:
        graceful, left = await processes.terminate_tree(tree, exited, deadline, remembered)
        return graceful, _pids(left)
